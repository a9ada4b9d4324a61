"""embedserve: OpenAI-compatible embeddings on SGLang + FlashInfer, built to run for weeks.

The request path, layer by layer (lower layers never import higher ones):
``contracts`` (documents shared between processes) -> ``config`` and ``model_info`` ->
``gateway`` core (tokenise, admit, coalesce) -> ``engines`` -> ``health`` ->
``gateway`` API -> ``runtime`` (CLI, stack, supervision). See docs/ARCHITECTURE.md.
"""

__version__ = "0.2.0"
