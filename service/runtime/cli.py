"""``embedserve``: one command, subcommands per job. Flags override the ``EMBEDSERVE_*``
environment for this process; engines that ``up`` starts get the resolved settings whole."""

from __future__ import annotations

import argparse
import sys
from typing import Any

# Everything else is imported inside ``main``: a Ctrl-C while it loads is then an exit
# status, not a KeyboardInterrupt traceback.

# Commands served by another module's ``main(argv)``: name -> (module, one-line help).
_DELEGATED = {
    "engine": ("embedserve.engines.sglang", "the SGLang engine (--dry-run prints its command line)"),
    "cpu-engine": ("embedserve.engines.cpu", "the CPU engine alone"),
    "health": ("embedserve.health.cli", "print the memory forecast of a running gateway"),
    "loadtest": ("embedserve.loadtest.cli", "drive an embeddings endpoint and write a report"),
    "quality": (
        "embedserve.loadtest.quality.cli",
        "compare a candidate endpoint's vectors and retrieval with a baseline's (exit 1: worse)",
    ),
    "quality-corpus": (
        "embedserve.loadtest.quality.corpus",
        "build the quality gate's retrieval corpus from the Python documentation (python3-doc)",
    ),
    "synth-model": (
        "embedserve.runtime.synth_model",
        "build a random-weight Qwen3-Embedding checkpoint with Qwen3's tokenizer",
    ),
    "restart-controller": (
        "embedserve.controller.restart_controller",
        "evict one embedserve pod at a time when its hours-to-OOM run low",
    ),
}

# The extra that brings what a command imports beyond the base install.
_EXTRAS = {"loadtest": "loadtest", "cpu-engine": "cpu", "synth-model": "synth", "engine": "gpu"}

_FLAGS = {  # flag -> (section, field) of the settings it overrides
    "model": ("model", "path"),
    "model_name": ("model", "name"),
    "max_seq_len": ("model", "max_seq_len"),
    "engine_kind": ("engine", "kind"),
    "engine_url": ("engine", "urls"),
    "host": ("gateway", "host"),
    "port": ("gateway", "port"),
    "engine_port": ("engine", "port"),
    "engines_per_gpu": ("engine", "engines_per_gpu"),
    "cpu_backend": ("engine", "cpu_backend"),
    "cpu_quantization": ("engine", "cpu_quantization"),
}


#: For configuration mistakes: the flag that sets a field, by its dotted name.
FLAG_OF = {f"{section}.{field}": "--" + flag.replace("_", "-") for flag, (section, field) in _FLAGS.items()}


def _stack_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    # Values are checked by the settings (one sentence naming the variable and the flag).
    ap = argparse.ArgumentParser(prog=prog, description=doc)
    ap.add_argument("--model", help="model folder (default: the bundled all-MiniLM-L6-v2; "
                    "`embedserve config` prints where it lies)")
    ap.add_argument("--model-name", help="model id clients send (default: the folder's name)")
    ap.add_argument("--max-seq-len", metavar="TOKENS", help="the one sequence-length cap")
    ap.add_argument("--engine-kind", metavar="{auto,cpu,sglang,torch,external}",
                    help="auto (default): SGLang when a GPU and the gpu extra are present, else the "
                    "CPU engine; torch: embedserve's own engine on a GPU (rerankers); external: no "
                    "local engine, use --engine-url")
    ap.add_argument("--engine-url", action="append", help="use these engines (repeatable)")
    ap.add_argument("--host", help="gateway address (default 127.0.0.1)")
    ap.add_argument("--port", help="gateway port (default 8000)")
    ap.add_argument("--engine-port", help="engine port (default 30000)")
    ap.add_argument("--engines-per-gpu", metavar="N|auto",
                    help="SGLang engines on each GPU (default auto: by model size and GPU memory)")
    ap.add_argument("--cpu-backend", help="the CPU engine's backend: onnx (default) or torch")
    ap.add_argument("--cpu-quantization", help="none (default) or int8 (onnx backend)")
    return ap


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given, as settings on top of the environment's."""
    out: dict[str, dict[str, Any]] = {}
    for flag, (section, field) in _FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            out.setdefault(section, {})[field] = value
    return out


def _joined_values(argv: list[str], flag: str) -> list[str]:
    """``FLAG -5MB/s`` as ``FLAG=-5MB/s``: argparse takes a value that starts with a dash for
    another option and answers "expected one argument", where the value's own check has the
    sentence that says what is wrong with it."""
    out: list[str] = []
    values = iter(argv)
    for arg in values:
        out.append(arg)
        if arg == flag:
            value = next(values, None)
            if value is not None:
                out[-1] = f"{flag}={value}"
    return out


def _run_stack(argv: list[str], prog: str, doc: str, default_kind: str | None, drill: bool = False) -> int:
    parser = _stack_parser(prog, doc)
    if drill:
        parser.add_argument(
            "--drill-leak", metavar="RATE",
            help="a leak drill: the engines grow memory at RATE (200MiB/min, 25MB/s) on purpose, GPU "
            "memory for SGLang engines and host memory for the CPU engine, "
            "so the forecast and up's engine replacement can be watched working",
        )
    args = parser.parse_args(_joined_values(argv, "--drill-leak") if drill else argv)
    leak = None
    if getattr(args, "drill_leak", None) is not None:
        from embedserve.engines.drill import parse_rate
        from embedserve.settings_errors import ConfigError

        try:
            leak = parse_rate(args.drill_leak)
        except ValueError as exc:
            raise ConfigError(f"--drill-leak must be a rate above zero: {exc}") from exc
    import logging
    import os

    from embedserve.config import load_settings, tolerated_variables
    from embedserve.logs import setup_logging
    from embedserve.runtime.stack import run_stack

    settings = load_settings(_overrides(args), FLAG_OF)
    if default_kind and settings.engine.kind == "auto":
        settings = settings.with_engine(kind=default_kind)
    setup_logging(settings.log_level, settings.log_format)
    for note in tolerated_variables(os.environ):
        logging.getLogger("embedserve.config").warning(note)
    if leak is not None and (settings.engine.kind == "external" or settings.engine.urls):
        from embedserve.settings_errors import ConfigError

        raise ConfigError(
            "--drill-leak needs engines that up starts, not --engine-url or engine kind 'external'"
        )
    from embedserve.runtime.event_loop import run_on
    from embedserve.runtime.identify import identify_engines
    from embedserve.runtime.supervisor import EngineStartError

    async def serve() -> int:
        try:  # engines elsewhere say what they are before the gateway derives its limits
            told = await identify_engines(settings)
        except EngineStartError as exc:
            print(f"embedserve: {exc}", file=sys.stderr, flush=True)
            return 1
        return await run_stack(told, drill_leak=leak)

    return run_on(settings.gateway.event_loop, serve())


def _up(argv: list[str]) -> int:
    return _run_stack(argv, "embedserve up", "Start the engine and the gateway.", None, drill=True)


def _gateway(argv: list[str]) -> int:
    return _run_stack(argv, "embedserve gateway", "Run the gateway only (engines elsewhere).", "external")


def _config(argv: list[str]) -> int:
    args = _stack_parser("embedserve config", "Print the effective configuration.").parse_args(argv)
    from embedserve.config import load_settings
    from embedserve.runtime.effective import config_report

    overrides = _overrides(args)
    settings, unresolved = _identified(load_settings(overrides, FLAG_OF))
    print(config_report(settings, overrides, FLAG_OF, unresolved=unresolved).model_dump_json(indent=2))
    return 0


def _identified(settings: Any) -> tuple[Any, str | None]:
    """The settings once engines elsewhere said what they are (asked once, not waited for), and
    why not where they did not answer."""
    import asyncio

    from embedserve.runtime.identify import identify_engines
    from embedserve.runtime.supervisor import EngineStartError

    try:
        return asyncio.run(identify_engines(settings, wait_s=0)), None
    except EngineStartError as exc:
        return settings, f"{exc}; until they answer, the defaults below are SGLang's"


# Commands run here: name -> (function, one-line help).
_LOCAL = {
    "up": (_up, "start the engine (SGLang on a GPU, else the CPU engine) and the gateway"),
    "gateway": (_gateway, "run only the gateway in front of --engine-url engines"),
    "config": (_config, "print the configuration the stack will use, derived values included, and where "
               "each value came from (secrets hidden)"),
}


def usage() -> str:
    """The top-level help, built from the command tables."""
    helps = {name: text for name, (_, text) in (_LOCAL | _DELEGATED).items()}
    width = max(map(len, helps)) + 2
    lines = [f"  {name:<{width}}{text}" for name, text in helps.items()]
    return (
        "usage: embedserve {" + ",".join(sorted(helps)) + "} [options]\n"
        "       embedserve --version\n\n" + "\n".join(lines)
    )


def main(argv: list[str] | None = None) -> int:
    """Every command; a configuration mistake anywhere is one sentence on stderr, exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before the servers took over the signal
        return 130
    except Exception as exc:
        from embedserve.settings_errors import ConfigError

        if not isinstance(exc, ConfigError):
            raise
        print(f"embedserve: {exc}", file=sys.stderr, flush=True)
        return 2


def _main(argv: list[str]) -> int:
    commands = sorted([*_LOCAL, *_DELEGATED])
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from embedserve import __version__

        print(f"embedserve {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in _LOCAL:
        return _LOCAL[cmd][0](rest)
    if cmd in _DELEGATED:
        try:
            import importlib

            module = importlib.import_module(_DELEGATED[cmd][0])
        except ModuleNotFoundError as exc:
            extra = _EXTRAS.get(cmd)
            if extra is None or exc.name is None or exc.name.startswith("embedserve"):
                raise
            print(
                f"embedserve {cmd} needs the '{extra}' extra ({exc.name} is not installed): "
                f"pip install 'embedserve[{extra}]' (from a checkout: pip install -e '.[{extra}]')",
                file=sys.stderr,
            )
            return 2
        return int(module.main(rest) or 0)
    print(f"embedserve: unknown command '{cmd}' (one of {', '.join(commands)})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
