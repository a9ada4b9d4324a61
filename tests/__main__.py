"""``python -m tests``: the whole check, as CI runs it: ruff, mypy, then pytest twice: the tests
that time what they check (``SERIAL`` in tests/conftest.py) alone, one after another, then the
rest on two workers (pytest-xdist): most tests wait on a subprocess or a socket part of the time,
so a 2-core machine runs two of them in far less than twice the time of one. Arguments go to
both pytest runs; with ``-m`` or ``-n`` among them, pytest runs once, as told.

mypy maps module names to folders, and the repo keeps one folder per part of the
``embedserve`` namespace (pyproject's package-dir). So mypy reads the package through a
tree of links laid out as it is installed (``build/typecheck/embedserve``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TYPECHECK = ROOT / "build" / "typecheck"


def installed_layout() -> dict[str, Path]:
    """Package name -> source folder, from pyproject.toml."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in setup["package-dir"].items()}


def link_tree() -> Path:
    """``build/typecheck/embedserve``: the namespace as installed, its files hard links to
    the sources (mypy follows no symbolic links)."""
    shutil.rmtree(TYPECHECK, ignore_errors=True)
    for name, folder in installed_layout().items():
        target = TYPECHECK.joinpath(*name.split("."))
        for source in folder.rglob("*.py"):
            link = target / source.relative_to(folder)
            link.parent.mkdir(parents=True, exist_ok=True)
            os.link(source, link)
    return TYPECHECK / "embedserve"


PYTEST = ["pytest", "-q", "-p", "no:cacheprovider"]
NO_TESTS = 5  # pytest's exit status when nothing was selected


def names_tests(args: list[str]) -> bool:
    """Whether ``args`` name files or tests to run (else pytest collects the testpaths)."""
    return any(not a.startswith("-") and (ROOT / a.split("::")[0]).exists() for a in args)


def pytest_runs(args: list[str]) -> list[list[str]]:
    """The serial tests, then the rest on two workers. Unless ``args`` name tests, the first
    run collects only the files ``SERIAL`` names."""
    from tests.conftest import SERIAL

    if any(a.startswith(("-m", "-n", "--numprocesses")) for a in args):
        return [[*PYTEST, *args]]
    serial = args if names_tests(args) else [*args, *SERIAL]
    return [
        [*PYTEST, "-m", "serial", *serial],
        [*PYTEST, "-n", "2", "--dist", "loadfile", "-m", "not serial", *args],
    ]


def run(step: list[str], env: dict[str, str]) -> int:
    print("==>", " ".join(step), flush=True)
    return subprocess.call([sys.executable, "-m", *step], cwd=ROOT, env=env)


def main() -> int:
    env = {**os.environ, "MYPYPATH": str(TYPECHECK)}
    lint = [
        ["ruff", "check", "."],
        ["mypy", str(link_tree()), "tests", "bench", *map(str, sorted(ROOT.glob("deploy/*/*.py")))],
    ]
    for step in lint:
        if code := run(step, env):
            print(f"FAILED: {' '.join(step)} (exit {code})", flush=True)
            return code
    codes = []
    for step in pytest_runs(sys.argv[1:]):
        codes.append(run(step, env))
        if codes[-1] not in (0, NO_TESTS):
            print(f"FAILED: {' '.join(step)} (exit {codes[-1]})", flush=True)
            return codes[-1]
    return NO_TESTS if all(c == NO_TESTS for c in codes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
