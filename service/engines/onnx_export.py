"""The ONNX export of a sentence-transformers model folder: made once, checked, cached.

The graph holds the whole model as sentence-transformers runs it (transformer, the folder's
pooling, normalisation): token ids and attention mask in, unit vectors out, and beside them the
transformer's last hidden state of every token (late chunking pools it); for a reranker, its
module from ``score_modules`` (ids and mask in, one raw score out); for a model with sparse or
ColBERT outputs, its module from ``hybrid_modules`` (BGE-M3: the heads' outputs beside the
vectors and token states, one forward for all; SPLADE: its vocabulary-wide weights). It is traced
by torch.onnx on a padded batch, then checked on padded batches of mixed lengths against torch run
on each input alone (vectors and token states against sentence-transformers, the heads against
their module); an fp32 graph whose answers are not torch's is refused (``export_check``), never
cached. int8 is ONNX Runtime's dynamic quantisation of the fp32 graph.

Each export lives in a folder of its own under ``engine.cpu_export_dir``, named by a key of
the model's files, the exporter, the quantisation and the library versions, and appears
there whole or not at all: it is written to a temporary folder and renamed into place, so a
start never finds a half-written model. One export at a time is made in a cache folder (a lock
on the folder, which the kernel drops when its holder dies), so the lock's holder may delete
any temporary folder it finds there: it was left by an export that was killed. One stopped by
SIGTERM or SIGINT (``up`` stopping a starting engine, a Ctrl-C) deletes its own first. Run as a
module, it makes the export for the settings it inherits (``Settings.child_env``); the engine
runs it in a child process so that torch never loads into the serving process.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

from embedserve.config import Settings, load_settings
from embedserve.contracts import onnx_export as export_contract
from embedserve.contracts.onnx_export import EMBEDDING_OUTPUTS, META_FILE, MODEL_FILE, OnnxExport
from embedserve.engines import export_check as agree
from embedserve.engines.export_cache import (
    exclusive,
    mark_used,
    publish,
    read_export,
    remove_leftovers,
    remove_orphans,
)
from embedserve.engines.export_check import ExportMismatch, padded_batch
from embedserve.logs import Progress
from embedserve.model_info import ModelInfo
from embedserve.settings_errors import ConfigError

log = logging.getLogger(__name__)

#: torch.onnx's tracer. On the bundled model its dynamo exporter gave the same vectors (min
#: cosine to torch 0.9999999 for both) but took about 7x as long to export on a 2-core VM
#: (bench/cpu/onnx_variants.py compares the two).
EXPORTER = "torchscript"
OPSET = 17
#: Bump when the graph's construction changes, so old exports are not reused (2: an embedding
#: model's graph gives its token states too; 3: BGE-M3's its sparse and ColBERT heads too).
FORMAT = 3
_VERSIONED = ("torch", "transformers", "sentence-transformers", "onnx", "onnxruntime", "embedserve")


def export_root(settings: Settings) -> Path:
    if settings.engine.cpu_export_dir:
        return Path(settings.engine.cpu_export_dir).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "embedserve" / "onnx"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def library_versions() -> dict[str, str]:
    return {p: _version(p) for p in _VERSIONED}


def export_key(model_dir: Path, quantization: str) -> str:
    """Changes with any file of the model (name, size, modification time), the exporter, the
    quantisation and the versions of the libraries that build and run the graph."""
    files = sorted(
        (str(p.relative_to(model_dir)), p.stat().st_size, p.stat().st_mtime_ns)
        for p in model_dir.rglob("*")
        if p.is_file()
    )
    ident = {"model": str(model_dir.resolve()), "files": files, "exporter": EXPORTER, "opset": OPSET,
             "quantization": quantization, "format": FORMAT, "versions": library_versions()}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]


def export_folder(settings: Settings, quantization: str | None = None) -> Path:
    """``<export dir>/<model name>[-int8]-<key>``."""
    quantization = quantization or settings.engine.cpu_quantization
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in settings.model.served_name)
    suffix = "" if quantization == "none" else f"-{quantization}"
    return export_root(settings) / f"{name}{suffix}-{export_key(settings.model.resolved_path, quantization)}"


def check_export_dir(settings: Settings) -> None:
    """Before a stack starts: the export these settings need is in the cache, or the cache's
    folder can be made and written. One that cannot is a configuration mistake (one sentence,
    exit 2), not an export that failed. A read-only cache that holds the export is fine."""
    if read_export(export_folder(settings)) is not None:
        return
    root = export_root(settings)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as exc:
        raise ConfigError(
            "EMBEDSERVE_ENGINE__CPU_EXPORT_DIR must be a folder this user can create and write "
            f"(the ONNX export is made there on a first start), but {root} cannot be: "
            f"{exc.strerror or exc}"
        ) from None


def ensure_export(
    settings: Settings, clock: Callable[[], float] = time.monotonic
) -> tuple[Path, OnnxExport]:
    """The cached export for these settings; made first, in a child process, when missing
    (a line every 10 s while it runs: seconds here, minutes on a busy machine)."""
    folder = export_folder(settings)
    found = read_export(folder)
    if found is not None:
        log.info("onnx export found", extra={"folder": str(folder)})
        mark_used(folder)
        return folder, found
    log.info("exporting the model to ONNX (once; later starts reuse it)", extra={"folder": str(folder)})
    child = subprocess.Popen(
        [sys.executable, "-m", "embedserve.engines.onnx_export"], env={**os.environ, **settings.child_env()}
    )
    progress = Progress(log, "still exporting the model to ONNX", clock=clock, folder=str(folder))
    try:
        while True:
            try:
                code = child.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                progress.tick()
    except BaseException:  # as subprocess.run: the child goes with us
        child.kill()
        raise
    found = read_export(folder)
    if code != 0 or found is None:
        raise RuntimeError(
            f"the ONNX export of {settings.model.resolved_path} failed (see the lines above); "
            "set engine.cpu_backend=torch (EMBEDSERVE_ENGINE__CPU_BACKEND=torch) to serve it on torch"
        )
    log.info("onnx export ready", extra={"folder": str(folder), "export_s": found.export_seconds,
                                          "min_cosine_vs_torch": found.min_cosine_vs_torch,
                                          "max_score_diff_vs_torch": found.max_score_diff_vs_torch})
    return folder, found


class Exporter:
    """Builds the exports of one model folder; torch and sentence-transformers load on first use."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.info = ModelInfo.load(settings.model)
        self.outputs = export_contract.graph_outputs(self.info.outputs, self.info.embeds)
        self._model: Any = None
        self._module: Any = None

    @property
    def model(self) -> Any:
        """An embedding model as sentence-transformers runs it."""
        if self._model is None:
            from sentence_transformers import SentenceTransformer

            self._model = SentenceTransformer(str(self.info.path), device="cpu", local_files_only=True).eval()
        return self._model

    @property
    def module(self) -> Any:
        """What the graph holds: (ids, mask) to unit vectors, or to a reranker's raw score."""
        if self._module is None:
            from embedserve.engines.score_modules import load_score_module

            if not self.info.embeds:
                self._module = load_score_module(self.info)
            elif self.info.outputs == ("dense",):
                self._module = pooled(self.model)
            else:
                from embedserve.engines.hybrid_modules import load_hybrid_module

                self._module = load_hybrid_module(self.info, lambda: pooled(self.model))
        return self._module

    def vocab_size(self) -> int:
        if self.info.outputs != ("dense",):  # a model with sparse or ColBERT outputs
            return int(self.module.vocab_size)
        if self.info.embeds:
            return int(self.model[0].auto_model.get_input_embeddings().num_embeddings)
        from embedserve.engines.score_modules import vocab_size

        return vocab_size(self.module)

    def sep_id(self) -> int | None:
        """A BERT cross-encoder's [SEP], which the check batches carry to exercise its segments."""
        return getattr(self.module, "sep_id", None)

    def check(self, onnx: Path) -> dict[str, float]:
        """How close the graph comes to torch (``OnnxExport``'s ``*_vs_torch`` fields): the lowest
        cosine of a vector or token state, the largest difference of a reranker's score or of a
        sparse weight."""
        if not self.info.embeds:
            return {"max_score_diff_vs_torch": self.max_score_diff(onnx)}
        dense = {"min_cosine_vs_torch": self.min_cosine(onnx)} if "dense" in self.info.outputs else {}
        if self.outputs == EMBEDDING_OUTPUTS:
            return dense
        heads = self.compare(onnx, tuple(n for n in self.outputs if n not in EMBEDDING_OUTPUTS))
        return {**heads, **{k: min(v, heads.get(k, v)) for k, v in dense.items()}}

    def compare(self, onnx: Path, checked: tuple[str, ...], shortest: int = 2) -> dict[str, float]:
        """The graph's ``checked`` outputs against the module's (``export_check.compare``)."""
        from embedserve.engines.ort_session import open_session

        cap = min(self.info.max_seq_len, 512)
        return agree.compare(open_session(onnx), self.module, self.outputs, checked, cap, self.vocab_size(),
                             self.sep_id(), shortest)

    def build(self, quantization: str) -> tuple[Path, OnnxExport]:
        """The export for ``quantization``, from the cache or made now (int8 from the fp32 one),
        holding the cache folder's lock; the leftovers of killed exports are deleted first."""
        folder = export_folder(self.settings, quantization)
        found = read_export(folder)
        if found is not None:
            return folder, found
        folder.parent.mkdir(parents=True, exist_ok=True)
        with exclusive(folder.parent):
            remove_leftovers(folder.parent)
            remove_orphans(folder.parent, time.time())
            return self._build(quantization)

    def _build(self, quantization: str) -> tuple[Path, OnnxExport]:
        folder = export_folder(self.settings, quantization)
        found = read_export(folder)  # made by the start that held the lock before us
        if found is not None:
            return folder, found
        t0 = time.monotonic()
        work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        try:
            if quantization == "int8":
                base, _ = self._build("none")
                quantize_int8(base / MODEL_FILE, work / MODEL_FILE)
            else:
                self.trace(work / MODEL_FILE)
            agreement = self.check(work / MODEL_FILE)
            if quantization == "none":
                agree.refuse_mismatch(**agreement)
            meta = OnnxExport(
                key=export_key(self.info.path, quantization), model_path=str(self.info.path),
                exporter=EXPORTER, quantization=quantization, opset=OPSET, versions=library_versions(),
                dimension=self.info.dimension, vocab_size=self.vocab_size(),
                export_seconds=round(time.monotonic() - t0, 2), **agree.rounded(agreement),
            )
            (work / META_FILE).write_text(meta.model_dump_json(indent=2))
            publish(work, folder)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return folder, read_export(folder) or meta

    def trace(self, out: Path) -> None:
        """torch.onnx's tracer on a padded batch, so the graph keeps the masked path."""
        import torch

        ids, mask = padded_batch([8, 5], self.vocab_size(), np.random.default_rng(0), self.sep_id())
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tracer's notes on Python branches it froze
            torch.onnx.export(
                self.module, (torch.from_numpy(ids), torch.from_numpy(mask)), str(out),
                input_names=["input_ids", "attention_mask"], output_names=list(self.outputs),
                dynamic_axes=export_contract.dynamic_axes(self.outputs), opset_version=OPSET, dynamo=False,
            )

    def min_cosine(self, onnx: Path) -> float:
        """The lowest cosine of the graph's vectors and token states to sentence-transformers'
        (``export_check.min_cosine``)."""
        from embedserve.engines.ort_session import open_session

        cap = min(self.info.max_seq_len, 512)  # enough to cross every length the graph handles alike
        return agree.min_cosine(open_session(onnx), self.model, cap, self.vocab_size())

    def max_score_diff(self, onnx: Path) -> float:
        """A reranker's graph on padded batches of mixed lengths (pairs of 4 tokens or more)
        against torch on each input alone."""
        return self.compare(onnx, self.outputs, shortest=4)["max_score_diff_vs_torch"]


def pooled(st: Any) -> Any:
    """A sentence-transformers model as a torch module from (ids, mask) to unit vectors and
    every token's last hidden state."""
    import torch

    class Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.st = st

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            features = self.st({"input_ids": input_ids, "attention_mask": attention_mask})
            vectors = torch.nn.functional.normalize(features["sentence_embedding"].float(), dim=-1)
            return vectors, features["token_embeddings"].float()

    return Pooled().eval()


def quantize_int8(fp32: Path, out: Path) -> None:
    """ONNX Runtime's dynamic quantisation: 8-bit weights, one scale per output channel,
    activations quantised per call. Unsigned weights: on CPUs without VNNI the signed kernel
    (u8 x s8) saturates; on the bundled model with real text (this repository's docs), per-tensor
    signed weights gave a median cosine to fp32 of 0.94, per-channel unsigned ones 0.993
    (bench/cpu/onnx_variants.py compares the variants)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(fp32, out, weight_type=QuantType.QUInt8, per_channel=True)


def _stop(signum: int, frame: FrameType | None) -> None:
    """SIGTERM or SIGINT: unwind, so the temporary folder is deleted, then exit 128 + signal."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    from embedserve.logs import setup_logging

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    settings = load_settings()
    setup_logging(settings.log_level, settings.log_format)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        folder, meta = Exporter(settings).build(settings.engine.cpu_quantization)
    except ExportMismatch as exc:
        log.error(str(exc))
        return 1
    log.info("onnx export written", extra={"folder": str(folder), "export_s": meta.export_seconds})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
