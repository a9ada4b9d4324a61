"""``python -m tests``: the whole check, as CI runs it: ruff, mypy, then pytest.

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


def main() -> int:
    steps = [
        ["ruff", "check", "."],
        ["mypy", str(link_tree()), "tests", "bench", *map(str, sorted(ROOT.glob("deploy/*/*.py")))],
        ["pytest", "-q", "-p", "no:cacheprovider", *sys.argv[1:]],
    ]
    env = {**os.environ, "MYPYPATH": str(TYPECHECK)}
    for step in steps:
        print("==>", " ".join(step), flush=True)
        code = subprocess.call([sys.executable, "-m", *step], cwd=ROOT, env=env)
        if code:
            print(f"FAILED: {' '.join(step)} (exit {code})", flush=True)
            return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
