"""How the CPU engine's ONNX graph is made, measured on the bundled model in one run:
torch.onnx's tracer against its dynamo exporter (export time, vectors against torch, speed),
and ONNX Runtime's dynamic int8 variants (vectors against fp32 on real text, speed).
A benchmark that prints numbers, not a test.

    python -m bench.cpu.onnx_variants --out results/cpu-onnx-variants

Real text: the paragraphs of this repository's README and docs. Speed: one input of 30
tokens and 32 inputs of 85, random ids, the engine's session options, the variants
alternating over three rounds (medians); the machine is shared, so compare within a run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from embedserve.config import Settings
from embedserve.engines.cores import usable_cores
from embedserve.engines.cpu_backends import session_options
from embedserve.engines.onnx_export import Exporter, pooled, quantize_int8
from embedserve.loadtest.textbuild import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def dynamo_export(exporter: Exporter, out: Path) -> None:
    import torch

    ids = torch.randint(1000, 30000, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence", max=512)
    shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(pooled(exporter.model), (ids, mask), None, dynamo=True,
                                    input_names=["input_ids", "attention_mask"], output_names=["embedding"],
                                    dynamic_shapes=shapes)
        assert program is not None
        program.optimize()
        program.save(str(out))


def int8_variant(fp32: Path, out: Path, name: str) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    if name == "uint8 per channel (the engine's)":
        quantize_int8(fp32, out)
    elif name == "int8 per tensor (ONNX Runtime's default)":
        quantize_dynamic(fp32, out, weight_type=QuantType.QInt8)
    else:  # "int8 per channel, 7-bit range"
        quantize_dynamic(fp32, out, weight_type=QuantType.QInt8, per_channel=True, reduce_range=True)


def real_text_ids(limit: int = 96) -> list[list[int]]:
    text = "\n\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if len(p.strip()) > 40][:limit]
    tok = load_tokenizer(str(Exporter(Settings(_env_file=None)).info.path))
    tok.enable_truncation(256)
    return [e.ids for e in tok.encode_batch(paragraphs)]


def padded(batch: list[list[int]]) -> dict[str, np.ndarray]:
    ids = np.zeros((len(batch), max(map(len, batch))), dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, x in enumerate(batch):
        ids[row, : len(x)] = x
        mask[row, : len(x)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def vectors(session: Any, batch: list[list[int]]) -> np.ndarray:
    return np.concatenate([session.run(None, padded(batch[i : i + 8]))[0] for i in range(0, len(batch), 8)])


def speed(sessions: dict[str, Any], rounds: int = 3, seconds: float = 3.0) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(0)
    shapes = {"1 x 30 tokens": (1, 30), "32 x 85 tokens": (32, 85)}
    feeds = {k: padded(rng.integers(1000, 30000, s).tolist()) for k, s in shapes.items()}
    seen: dict[str, dict[str, list[float]]] = {n: {k: [] for k in feeds} for n in sessions}
    for _ in range(rounds):
        for name, session in sessions.items():
            for k, feed in feeds.items():
                session.run(None, feed)
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < seconds:
                    session.run(None, feed)
                    n += 1
                seen[name][k].append(n * len(feed["input_ids"]) / (time.perf_counter() - t0))
    return {n: {k: round(statistics.median(v), 1) for k, v in d.items()} for n, d in seen.items()}


def main(argv: list[str] | None = None) -> int:
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/cpu-onnx-variants")
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    exporter = Exporter(Settings(_env_file=None))
    work = Path(tempfile.mkdtemp())
    doc: dict[str, Any] = {"load_average_before": os.getloadavg(), "exporters": {}, "int8": {}}
    graphs = {"torchscript tracer (the engine's)": work / "ts.onnx", "dynamo": work / "dynamo.onnx"}
    for name, path in graphs.items():
        t0 = time.monotonic()
        exporter.trace(path) if name.startswith("torchscript") else dynamo_export(exporter, path)
        doc["exporters"][name] = {"export_s": round(time.monotonic() - t0, 1),
                                  "min_cosine_vs_torch": round(exporter.min_cosine(path), 7)}
    fp32 = graphs["torchscript tracer (the engine's)"]
    names = ["uint8 per channel (the engine's)", "int8 per tensor (ONNX Runtime's default)",
             "int8 per channel, 7-bit range"]
    for name in names:
        int8_variant(fp32, work / f"{len(doc['int8'])}.onnx", name)
        doc["int8"][name] = {"path": work / f"{len(doc['int8'])}.onnx"}
    threads = usable_cores()

    def session(p: Path) -> Any:
        return ort.InferenceSession(str(p), session_options(threads), providers=["CPUExecutionProvider"])

    texts = real_text_ids()
    reference = vectors(session(fp32), texts)
    for d in doc["int8"].values():
        cos = (vectors(session(d["path"]), texts) * reference).sum(1)
        d.update(median_cosine_vs_fp32=round(float(np.median(cos)), 4),
                 p1_cosine_vs_fp32=round(float(np.percentile(cos, 1)), 4),
                 min_cosine_vs_fp32=round(float(cos.min()), 4))
    sessions = {f"fp32, {n}": session(p) for n, p in graphs.items()}
    sessions |= {f"int8: {n}": session(d.pop("path")) for n, d in doc["int8"].items()}
    doc["texts_per_s"] = speed(sessions)
    doc.update(load_average_after=os.getloadavg(), threads=threads, real_texts=len(texts))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
