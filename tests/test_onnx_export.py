"""The ONNX export cache: made once, reused, keyed by what built it, never half-written, and
an export whose vectors are not torch's is refused. On the tiny Qwen3 model (last-token
pooling), which exports in seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from embedserve.config import Settings
from embedserve.contracts.onnx_export import (
    META_FILE,
    MODEL_FILE,
    TOKEN_STATES_OUTPUT,
    VECTORS_OUTPUT,
    OnnxExport,
)
from embedserve.engines import export_cache, onnx_export
from embedserve.engines.export_cache import publish
from embedserve.engines.onnx_export import Exporter, ExportMismatch, ensure_export, export_folder
from embedserve.engines.ort_session import open_session

from .conftest import wait_until

META = OnnxExport(key="abc", model_path="m", exporter="torchscript", quantization="none", opset=17,
                  versions={}, dimension=8, vocab_size=16, export_seconds=1.0, min_cosine_vs_torch=1.0)


def settings(model: Path, export_dir: Path, **engine: object) -> Settings:
    return Settings(_env_file=None, model={"path": str(model)},
                    engine={"cpu_export_dir": str(export_dir), **engine})


def test_exported_once_then_reused(
    tiny_qwen_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = settings(tiny_qwen_dir, tmp_path)
    folder, meta = ensure_export(s)  # in a child process, as the engine does it
    assert folder == export_folder(s) and folder.parent == tmp_path
    assert (folder / MODEL_FILE).stat().st_size > 0
    assert meta.quantization == "none" and (meta.min_cosine_vs_torch or 0) >= 0.9999
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no temporary folder left

    def no_export(*args: object, **kwargs: object) -> None:
        raise AssertionError("exported again")

    monkeypatch.setattr(subprocess, "run", no_export)
    assert ensure_export(s) == (folder, meta)


def test_the_key_follows_the_model_files_and_the_quantisation(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    s = settings(tiny_qwen_dir, tmp_path)
    first = export_folder(s)
    assert export_folder(s) == first
    int8 = export_folder(s, "int8")
    assert int8 != first and int8.name.startswith(first.name.rsplit("-", 1)[0] + "-int8-")
    config = tiny_qwen_dir / "config_sentence_transformers.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    try:
        assert export_folder(s) != first
    finally:
        os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_racing_start_keeps_the_first_export(tmp_path: Path) -> None:
    """Two starts export at once: the second rename finds the folder there and keeps it."""
    folder = tmp_path / "model-abc"
    for name in ("first", "second"):
        work = tmp_path / f".model-abc.{name}"
        work.mkdir()
        (work / MODEL_FILE).write_text(name)
        (work / META_FILE).write_text(META.model_dump_json())
        publish(work, folder)
    assert (folder / MODEL_FILE).read_text() == "first"
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "something").write_text("not an export")
    (tmp_path / ".junk.1").mkdir()
    with pytest.raises(OSError):  # a folder in the way that holds no export is not taken for one
        publish(tmp_path / ".junk.1", tmp_path / "junk")


def test_exports_of_models_that_are_gone_and_unused_for_a_week_are_removed(tmp_path: Path) -> None:
    """A new checkout exports the bundled model anew; the exports of deleted ones go, once unused for
    ORPHAN_AFTER_S, and one a start still uses (its meta file's time) stays."""
    now = 1_000_000_000.0
    week = export_cache.ORPHAN_AFTER_S

    def export(name: str, model: Path, used_ago: float) -> Path:
        folder = tmp_path / "cache" / name
        folder.mkdir(parents=True)
        (folder / META_FILE).write_text(META.model_copy(update={"model_path": str(model)}).model_dump_json())
        os.utime(folder / META_FILE, (now - used_ago, now - used_ago))
        return folder

    here = tmp_path / "model"
    here.mkdir()
    gone = export("gone", tmp_path / "deleted", week + 60)
    used = export("used", tmp_path / "deleted-too", 60)
    present = export("present", here, week + 60)
    (tmp_path / "cache" / "junk").mkdir()  # not an export: left alone
    export_cache.remove_orphans(tmp_path / "cache", now)
    assert not gone.exists() and used.exists() and present.exists() and (tmp_path / "cache" / "junk").exists()
    export_cache.mark_used(present)
    assert (present / META_FILE).stat().st_mtime > now


def test_an_export_unlike_torch_is_refused(
    tiny_qwen_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(onnx_export.Exporter, "min_cosine", lambda self, graph: 0.93)
    refused = r"min cosine 0\.930000 < 0\.9999.*EMBEDSERVE_ENGINE__CPU_BACKEND=torch"
    with pytest.raises(ExportMismatch, match=refused):
        Exporter(settings(tiny_qwen_dir, tmp_path)).build("none")
    assert list(tmp_path.iterdir()) == []  # nothing cached, no temporary folder left


def test_the_graph_gives_every_tokens_state_and_it_is_checked_against_torch(
    tiny_qwen_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Late chunking pools the graph's token states: they are an output, held to torch's too."""
    import torch

    folder, _ = Exporter(settings(tiny_qwen_dir, tmp_path / "good")).build("none")
    outputs = [o.name for o in open_session(folder / MODEL_FILE).get_outputs()]
    assert outputs == [VECTORS_OUTPUT, TOKEN_STATES_OUTPUT]
    right = onnx_export.pooled

    def wrong_states(st: Any) -> Any:
        """Torch's vectors, and token states that are not torch's."""
        good = right(st)

        class Wrong(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.good = good

            def forward(self, ids: Any, mask: Any) -> Any:
                vectors, states = self.good(ids, mask)
                return vectors, -states

        return Wrong().eval()

    monkeypatch.setattr(onnx_export, "pooled", wrong_states)
    with pytest.raises(ExportMismatch, match=r"min cosine -"):
        Exporter(settings(tiny_qwen_dir, tmp_path / "bad")).build("none")


#: The export child (``python -m embedserve.engines.onnx_export``) with a trace that stops
#: half-way: it writes the file named on its command line and waits to be stopped.
STALLED_EXPORT = """
import sys, time
from pathlib import Path
from embedserve.engines import export_cache, onnx_export

def stalled(self, out):
    Path(sys.argv[1]).write_text(str(out))
    time.sleep(120)

onnx_export.Exporter.trace = stalled
sys.exit(onnx_export.main())
"""


def stalled_export(s: Settings, marker: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", STALLED_EXPORT, str(marker)],
                            env={**os.environ, **s.child_env()})
    wait_until(lambda: marker.exists() or proc.poll() is not None, timeout=60)
    assert proc.poll() is None, "the export child ended before it was stopped"
    return proc


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_an_export_stopped_half_way_leaves_nothing(
    tiny_qwen_dir: Path, tmp_path: Path, stop: signal.Signals
) -> None:
    """``up`` stopping a starting engine sends its process group SIGTERM; a Ctrl-C on
    ``embedserve engine`` sends SIGINT. The export deletes its temporary folder and exits."""
    cache = tmp_path / "cache"
    proc = stalled_export(settings(tiny_qwen_dir, cache), tmp_path / "tracing")
    assert Path((tmp_path / "tracing").read_text()).parent.parent == cache  # it had begun writing
    proc.send_signal(stop)
    code = proc.wait(30)
    assert list(cache.iterdir()) == []
    assert code == 128 + stop  # an exit of its own, no KeyboardInterrupt traceback


def test_a_killed_exports_leftovers_are_removed_by_the_next(
    tiny_qwen_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL leaves the temporary folder; the next export (holding the cache's lock, so
    no other export can be running) deletes it, and touches nothing else in the folder."""
    cache = tmp_path / "cache"
    s = settings(tiny_qwen_dir, cache)
    proc = stalled_export(s, tmp_path / "tracing")
    proc.kill()
    proc.wait(30)
    left = [p.name for p in cache.iterdir()]
    assert len(left) == 1 and left[0].startswith(f".{export_folder(s).name}.")
    (cache / "notes.txt").write_text("the user's own file")
    monkeypatch.setattr(onnx_export.Exporter, "trace", lambda self, out: out.write_bytes(b"graph"))
    monkeypatch.setattr(onnx_export.Exporter, "min_cosine", lambda self, graph: 1.0)
    folder, _ = Exporter(s).build("none")
    assert sorted(p.name for p in cache.iterdir()) == sorted([folder.name, "notes.txt"])
