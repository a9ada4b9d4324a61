"""Write the build context of one Dockerfile to stdout as a tar: the checkout's files (git's
view: tracked, plus untracked ones .gitignore does not exclude), less what the Dockerfile's
``<Dockerfile>.dockerignore`` excludes.

BuildKit reads ``<Dockerfile>.dockerignore`` itself, but the classic builder (Docker without
the buildx component) reads only a ``.dockerignore`` at the context's root and would send
``.venv`` and ``.git`` too. Piped to ``docker build -f <Dockerfile> -``, this tar gives both
builders the same context:

    python3 deploy/docker/context.py deploy/docker/Dockerfile.gateway \\
      | docker build -f deploy/docker/Dockerfile.gateway -t embedserve/gateway:0.2.0 -

Patterns follow Docker's rules: relative to the context root, ``*`` and ``?`` stay within one
path element, ``**`` spans any number of them, a match on a folder excludes what is under it,
``!`` includes again, and the last pattern that matches decides.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import BinaryIO

ROOT = Path(__file__).resolve().parents[2]


def _regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def read_patterns(ignore_file: Path) -> list[tuple[bool, re.Pattern[str]]]:
    """(excludes, regex) per pattern line; ``excludes`` is False for a ``!`` line."""
    rules = []
    for line in ignore_file.read_text().splitlines() if ignore_file.exists() else []:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        rules.append((not include, _regex(pattern)))
    return rules


def excluded(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    verdict = False
    for excludes, rx in rules:
        if any(rx.match(p) for p in prefixes):
            verdict = excludes
    return verdict


def checkout_files(root: Path) -> list[str]:
    """Tracked and untracked-not-ignored files (git's view), or every file without git."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            check=True,
        ).stdout.decode()
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = [str(Path(d, f).relative_to(root)) for d, _, files in os.walk(root) for f in files]
    return sorted({n for n in names if os.path.lexists(root / n)})


def context_files(dockerfile: Path, root: Path = ROOT) -> list[str]:
    rules = read_patterns(dockerfile.with_name(dockerfile.name + ".dockerignore"))
    return [n for n in checkout_files(root) if not excluded(n, rules)]


def write_tar(out: BinaryIO, names: list[str], root: Path = ROOT) -> None:
    sent = False
    try:
        # GNU format: no pax header blocks, which docker's check that stdin is a tar rejects
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.GNU_FORMAT) as tar:
            for name in names:
                info = tar.gettarinfo(str(root / name), arcname=name)
                info.mtime = int(info.mtime)
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                if info.isreg():
                    with (root / name).open("rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
            sent = True
    except BrokenPipeError:
        if not sent:
            raise
        # docker stops reading at the end-of-archive blocks and may close the pipe before
        # the record's zero padding: every member was sent, so this is no failure
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    write_tar(sys.stdout.buffer, context_files(Path(argv[1]).resolve()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
