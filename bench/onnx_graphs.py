"""The ONNX graphs the ``onnx-variants`` scenario compares (bench/cpu_scenarios.py), built from
the bundled model: torch.onnx's tracer (the engine's) and its dynamo exporter, and ONNX
Runtime's dynamic int8 variants of the tracer's graph. Each then runs in process
(bench/inprocess.py), its vectors against the tracer's fp32 graph and its speed side by side."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

from embedserve.config import Settings
from embedserve.engines.onnx_export import Exporter, pooled, quantize_int8

GRAPHS = {"fp32, tracer (the engine's)": "tracer.onnx", "fp32, dynamo": "dynamo.onnx",
          "int8, uint8 per channel (the engine's)": "uint8-channel.onnx",
          "int8, int8 per tensor (ONNX Runtime's default)": "int8-tensor.onnx",
          "int8, int8 per channel, 7-bit range": "int8-channel-7bit.onnx"}


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


def build(folder: Path) -> list[dict[str, Any]]:
    """Every graph into ``folder``: how long each took, and the fp32 ones' vectors against torch."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    folder.mkdir(parents=True, exist_ok=True)
    exporter = Exporter(Settings(_env_file=None))
    fp32 = folder / GRAPHS["fp32, tracer (the engine's)"]
    make = {"tracer.onnx": exporter.trace, "dynamo.onnx": lambda out: dynamo_export(exporter, out),
            "uint8-channel.onnx": lambda out: quantize_int8(fp32, out),
            "int8-tensor.onnx": lambda out: quantize_dynamic(fp32, out, weight_type=QuantType.QInt8),
            "int8-channel-7bit.onnx": lambda out: quantize_dynamic(fp32, out, weight_type=QuantType.QInt8,
                                                                   per_channel=True, reduce_range=True)}
    rows = []
    for name, file in GRAPHS.items():
        t0 = time.monotonic()
        make[file](folder / file)
        cosine = round(exporter.min_cosine(folder / file), 7) if "fp32" in name else None
        rows.append({"graph": name, "build_s": round(time.monotonic() - t0, 1),
                     "min_cosine_vs_torch": cosine})
    return rows
