"""``python -m tests``: the whole check, as CI runs it: ruff, mypy, then pytest."""

from __future__ import annotations

import subprocess
import sys

STEPS = [
    ["ruff", "check", "."],
    ["mypy", "service", "gateway", "health", "loadtest", "tests"],
    ["pytest", "-q", "-p", "no:cacheprovider", *sys.argv[1:]],
]


def main() -> int:
    for step in STEPS:
        print("==>", " ".join(step), flush=True)
        code = subprocess.call([sys.executable, "-m", *step])
        if code:
            print(f"FAILED: {' '.join(step)} (exit {code})", flush=True)
            return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
