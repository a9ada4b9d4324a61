"""``embedserve``: one command, subcommands per job. Flags are a convenience over the
``EMBEDSERVE_*`` environment: they are written into it before ``Settings`` is read, so
engine processes started by ``up`` inherit exactly the same configuration."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys

# Commands served by another module's ``main(argv)``: name -> (module, one-line help).
_DELEGATED = {
    "engine": ("embedserve.engines.sglang", "the SGLang engine (--dry-run prints its command line)"),
    "cpu-engine": ("embedserve.engines.cpu", "the CPU engine alone"),
    "health": ("embedserve.health.cli", "print the memory forecast of a running gateway"),
    "loadtest": ("embedserve.loadtest.cli", "drive an embeddings endpoint and write a report"),
    "synth-model": (
        "embedserve.runtime.synth_model",
        "build a random-weight Qwen3-Embedding-shaped checkpoint",
    ),
    "restart-controller": (
        "embedserve.runtime.restart_controller",
        "evict one embedserve pod at a time when its hours-to-OOM run low",
    ),
}

_FLAGS = {  # flag -> environment variable
    "model": "EMBEDSERVE_MODEL__PATH",
    "model_name": "EMBEDSERVE_MODEL__NAME",
    "max_seq_len": "EMBEDSERVE_MODEL__MAX_SEQ_LEN",
    "engine_kind": "EMBEDSERVE_ENGINE__KIND",
    "host": "EMBEDSERVE_GATEWAY__HOST",
    "port": "EMBEDSERVE_GATEWAY__PORT",
    "engine_port": "EMBEDSERVE_ENGINE__PORT",
}


def _stack_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=doc)
    ap.add_argument("--model", help="model folder (default: the bundled all-MiniLM-L6-v2)")
    ap.add_argument("--model-name", help="model id clients send")
    ap.add_argument("--max-seq-len", type=int, help="the one sequence-length cap")
    ap.add_argument("--engine-kind", choices=["auto", "cpu", "sglang", "external"])
    ap.add_argument("--engine-url", action="append", help="use these engines (repeatable)")
    ap.add_argument("--host", help="gateway address (default 127.0.0.1)")
    ap.add_argument("--port", type=int, help="gateway port (default 8000)")
    ap.add_argument("--engine-port", type=int, help="engine port (default 30000)")
    return ap


def _apply_flags(args: argparse.Namespace) -> None:
    for flag, env in _FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            os.environ[env] = str(value)
    if getattr(args, "engine_url", None):
        os.environ["EMBEDSERVE_ENGINE__URLS"] = json.dumps(args.engine_url)
        os.environ.setdefault("EMBEDSERVE_ENGINE__KIND", "external")


def _run_stack(argv: list[str], prog: str, doc: str, default_kind: str | None) -> int:
    args = _stack_parser(prog, doc).parse_args(argv)
    _apply_flags(args)
    if default_kind:
        os.environ.setdefault("EMBEDSERVE_ENGINE__KIND", default_kind)
    from embedserve.config import Settings
    from embedserve.logs import setup_logging
    from embedserve.runtime.stack import run_stack

    settings = Settings()
    setup_logging(settings.log_level)
    return asyncio.run(run_stack(settings))


def _up(argv: list[str]) -> int:
    return _run_stack(argv, "embedserve up", "Start the engine and the gateway.", None)


def _gateway(argv: list[str]) -> int:
    return _run_stack(argv, "embedserve gateway", "Run the gateway only (engines elsewhere).", "external")


def _config(argv: list[str]) -> int:
    args = _stack_parser("embedserve config", "Print the effective configuration.").parse_args(argv)
    _apply_flags(args)
    from embedserve.config import Settings

    print(json.dumps(Settings().redacted(), indent=2))
    return 0


# Commands run here: name -> (function, one-line help).
_LOCAL = {
    "up": (_up, "start the engine (SGLang on a GPU, else the CPU engine) and the gateway"),
    "gateway": (_gateway, "run only the gateway in front of --engine-url engines"),
    "config": (_config, "print the effective configuration (secrets hidden)"),
}


def usage() -> str:
    """The top-level help, built from the command tables."""
    helps = {name: text for name, (_, text) in (_LOCAL | _DELEGATED).items()}
    width = max(map(len, helps)) + 2
    lines = [f"  {name:<{width}}{text}" for name, text in helps.items()]
    return "usage: embedserve {" + ",".join(sorted(helps)) + "} [options]\n\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = sorted([*_LOCAL, *_DELEGATED])
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd in _LOCAL:
        return _LOCAL[cmd][0](rest)
    if cmd in _DELEGATED:
        return int(importlib.import_module(_DELEGATED[cmd][0]).main(rest) or 0)
    print(f"embedserve: unknown command '{cmd}' (one of {', '.join(commands)})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
