"""Models with sparse or ColBERT outputs as torch modules from (token ids, attention mask) to
their graph's outputs (``contracts/onnx_export.graph_outputs``): what the ONNX export traces and
the torch backend runs (torch is imported here, so only those two import this module).

- BGE-M3, as FlagEmbedding's ``BGEM3FlagModel`` computes it: the dense module's unit vectors and
  token states (CLS pooling, normalised: the folder's sentence-transformers modules), then per
  token ``relu(sparse_linear(h))`` (its one weight; the engine keeps each id's largest and drops
  the special tokens, as ``_process_token_weights`` does) and ``colbert_linear(h[:, 1:])``, masked
  and normalised (``_colbert_embedding``: the first token dropped);
- SPLADE, as sentence-transformers' ``SpladePooling`` computes it: the masked LM's logits times the
  attention mask, ``log(1 + relu(.))`` (once more for ``log1p_relu``), then max (or sum) over
  positions: a weight per vocabulary id.

Inputs are right-padded, as the CPU engine pads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from embedserve.model_info import M3_HEAD_FILES, ModelInfo


def _linear(path: Path) -> torch.nn.Linear:
    """A ``torch.nn.Linear`` from its state dict, as FlagEmbedding saves a head."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    rows, width = state["weight"].shape
    head = torch.nn.Linear(width, rows)
    head.load_state_dict(state)
    return head.eval()


class M3Heads(torch.nn.Module):
    def __init__(self, dense: torch.nn.Module, folder: Path) -> None:
        super().__init__()
        self.dense = dense
        self.sparse_linear, self.colbert_linear = (_linear(folder / name) for name in M3_HEAD_FILES)
        self.vocab_size = int(json.loads((folder / "config.json").read_text())["vocab_size"])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        vectors, states = self.dense(input_ids, attention_mask)
        weights = torch.relu(self.sparse_linear(states)).squeeze(-1)
        colbert = self.colbert_linear(states[:, 1:]) * attention_mask[:, 1:, None].to(states.dtype)
        return vectors, states, weights, torch.nn.functional.normalize(colbert, dim=-1)


class Splade(torch.nn.Module):
    def __init__(self, mlm: Any, pooling: str, activation: str) -> None:
        super().__init__()
        self.mlm, self.pooling, self.twice = mlm, pooling, activation == "log1p_relu"
        self.vocab_size = int(mlm.config.vocab_size)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        logits = self.mlm(input_ids=input_ids, attention_mask=attention_mask).logits.float()
        weights = torch.log1p(torch.relu(logits * attention_mask[:, :, None].to(logits.dtype)))
        if self.twice:
            weights = torch.log1p(weights)
        return weights.amax(dim=1) if self.pooling == "max" else weights.sum(dim=1)


def splade_pooling(folder: Path) -> tuple[str, str]:
    """The folder's ``SpladePooling`` settings (pooling strategy, activation); a bare masked LM
    gets sentence-transformers' defaults, max and relu."""
    listed = folder / "modules.json"
    modules = json.loads(listed.read_text()) if listed.exists() else []
    path = next((m["path"] for m in modules if str(m.get("type", "")).endswith("SpladePooling")), None)
    config_file = folder / path / "config.json" if path else None
    config = json.loads(config_file.read_text()) if config_file and config_file.exists() else {}
    return str(config.get("pooling_strategy", "max")), str(config.get("activation_function", "relu"))


def load_hybrid_module(info: ModelInfo, dense: Callable[[], torch.nn.Module]) -> M3Heads | Splade:
    """The model folder's module in eval mode (fp32, CPU); ``dense`` builds a BGE-M3's dense module
    (ids and mask to unit vectors and token states)."""
    if "colbert" in info.outputs:
        return M3Heads(dense(), info.path).eval()
    from transformers import AutoModelForMaskedLM

    mlm = AutoModelForMaskedLM.from_pretrained(str(info.path), local_files_only=True, dtype=torch.float32)
    return Splade(mlm.eval(), *splade_pooling(info.path)).eval()
