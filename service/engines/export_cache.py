"""The ONNX export cache's folder: its lock, publishing an export into it, and removing what a
killed export left or what no model needs any more. ``onnx_export`` builds what goes in it."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from pydantic import ValidationError

from embedserve.contracts.onnx_export import META_FILE, OnnxExport

log = logging.getLogger("embedserve.engines.onnx_export")

#: A temporary export folder: ``.<export folder's name>.<tempfile.mkdtemp's 8 characters>``.
_WORK_FOLDER = re.compile(r"\..+-[0-9a-f]{20}\.[a-z0-9_]{8}")


def read_export(folder: Path) -> OnnxExport | None:
    """The export in ``folder``, or None when there is none (or a foreign file is there)."""
    try:
        return OnnxExport.model_validate_json((folder / META_FILE).read_bytes())
    except (OSError, ValidationError):
        return None


@contextlib.contextmanager
def exclusive(root: Path) -> Iterator[None]:
    """An exclusive lock on the cache folder itself (no lock file to leave behind)."""
    fd = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def remove_leftovers(root: Path) -> None:
    """Temporary folders of exports that were killed; call only holding ``exclusive(root)``."""
    for path in root.iterdir():
        if _WORK_FOLDER.fullmatch(path.name) and path.is_dir():
            log.info("removing an interrupted onnx export", extra={"folder": str(path)})
            shutil.rmtree(path, ignore_errors=True)


#: An export whose model folder is gone and that no start has used for this long is deleted when
#: another is made: each new checkout or virtual environment exports the bundled model anew
#: (the key holds the folder's path), and a cache shared by pods keeps what any pod still uses.
ORPHAN_AFTER_S = 7 * 24 * 3600.0


def remove_orphans(root: Path, now: float, unused_s: float = ORPHAN_AFTER_S) -> None:
    """Exports of model folders that are gone, unused for ``unused_s`` (their meta file's time:
    ``mark_used``); call only holding ``exclusive(root)``."""
    for folder in root.iterdir():
        found = read_export(folder) if folder.is_dir() else None
        if found is None or Path(found.model_path).exists():
            continue
        with contextlib.suppress(OSError):
            if now - (folder / META_FILE).stat().st_mtime > unused_s:
                log.info("removing the onnx export of a model that is gone", extra={"folder": str(folder)})
                shutil.rmtree(folder, ignore_errors=True)


def mark_used(folder: Path) -> None:
    """A start uses this export (a read-only cache keeps its time)."""
    with contextlib.suppress(OSError):
        os.utime(folder / META_FILE)


def publish(work: Path, folder: Path) -> None:
    """Rename the finished folder into place; when another start got there first, keep its."""
    try:
        os.rename(work, folder)
    except OSError:
        if read_export(folder) is None:
            raise
