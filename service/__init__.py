"""embedserve: OpenAI-compatible embeddings on SGLang + FlashInfer, built to run for weeks.

The request path, layer by layer (lower layers never import higher ones):
``contracts`` (documents shared between processes) -> ``config`` and ``model_info`` ->
``gateway`` core (tokenise, admit, coalesce) -> ``engines`` -> ``health`` ->
``gateway`` API -> ``runtime`` (CLI, stack, supervision). See docs/ARCHITECTURE.md.
"""


def __getattr__(name: str) -> str:
    """``__version__``: pyproject.toml's version as installed, the one source. Read on first
    use, so importing the package stays light (a Ctrl-C during start-up meets less of it)."""
    if name != "__version__":
        raise AttributeError(name)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("embedserve")
    except PackageNotFoundError:  # a checkout that was never installed
        return "0+unknown"
