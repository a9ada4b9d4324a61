"""The pooled last layer (``engine.pooled_last_layer``) against transformers' own forward of a tiny
Qwen3. SGLang does not run without a GPU, so its decoder layer's interface (``prepare_attn``, the
norms' fused residual add, ``forward_prepare_native``, ``attn`` over a packed batch, ``o_proj``) is
played here by transformers' modules, laid out as SGLang 0.5.17 lays them out (the arguments are
checked against its wheel in tests/test_sglang_plugin.py)."""

from __future__ import annotations

import inspect
import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3Model
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from embedserve.engines import pooled_layer
from embedserve.engines.pooled_layer import PooledRows

FIXTURES = Path(__file__).resolve().parent / "fixtures"


class Norm:
    """SGLang's RMSNorm: given a residual, the add first, and both back."""

    def __init__(self, norm: Any) -> None:
        self.norm = norm

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if residual is None:
            return self.norm(x)
        total = x + residual
        return self.norm(total), total


class Communicator:
    def __init__(self, norm: Any) -> None:
        self.norm = Norm(norm)

    def prepare_attn(self, hidden: torch.Tensor, residual: torch.Tensor | None, forward_batch: Any,
                     post_residual_addition: Any = None) -> Any:
        return (self.norm(hidden), hidden) if residual is None else self.norm(hidden, residual)


class Attention(torch.nn.Module):
    """Q/K/V with their norms and RoPE, and causal attention within each packed sequence."""

    def __init__(self, hf: Any, rotary: Any) -> None:
        super().__init__()
        self.hf, self.rotary = hf, rotary
        self.heads, self.kv_heads = hf.config.num_attention_heads, hf.config.num_key_value_heads

    def forward_prepare_native(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> Any:
        a: Any = self.hf
        n, d = hidden_states.shape[0], a.head_dim
        q = a.q_norm(a.q_proj(hidden_states).view(n, -1, d)).transpose(0, 1)[None]
        k = a.k_norm(a.k_proj(hidden_states).view(n, -1, d)).transpose(0, 1)[None]
        cos, sin = self.rotary(hidden_states[None], positions[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        q, k = (t[0].transpose(0, 1).reshape(n, -1) for t in (q, k))
        return q, k, a.v_proj(hidden_states)

    def attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        d: int = self.hf.head_dim
        out, start, group = [], 0, self.heads // self.kv_heads
        for n in forward_batch.extend_seq_lens.tolist():
            qs, ks, vs = (t[start:start + n].view(n, -1, d).transpose(0, 1) for t in (q, k, v))
            ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
            context = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            out.append(context.transpose(0, 1).reshape(n, -1))
            start += n
        return torch.cat(out)

    def o_proj(self, x: torch.Tensor) -> Any:
        return self.hf.o_proj(x), None


class Layer(torch.nn.Module):
    def __init__(self, hf: Any, rotary: Any) -> None:
        super().__init__()
        self.layer_communicator = Communicator(hf.input_layernorm)
        self.self_attn = Attention(hf.self_attn, rotary)
        self.post_attention_layernorm = Norm(hf.post_attention_layernorm)
        self.mlp = hf.mlp

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: Any,
                residual: torch.Tensor | None) -> Any:
        """Every row, in SGLang's order."""
        hidden_states, residual = self.layer_communicator.prepare_attn(hidden_states, residual, forward_batch)
        a: Any = self.self_attn
        out, _ = a.o_proj(a.attn(*a.forward_prepare_native(positions, hidden_states), forward_batch))
        out, residual = self.post_attention_layernorm(out, residual)
        return self.mlp(out), residual


class Model(torch.nn.Module):
    """Qwen3ForCausalLM's embedding forward: the body, the final norm, LAST pooling, L2 norm."""

    def __init__(self, hf: Any) -> None:
        super().__init__()
        self.hf, self.model = hf, torch.nn.Module()
        self.layers: Any = torch.nn.ModuleList(Layer(layer, hf.rotary_emb) for layer in hf.layers)
        self.model.layers = self.layers  # where SGLang's model keeps them

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        hidden, residual = self.hf.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, forward_batch, residual)
        hidden, _ = Norm(self.hf.norm)(hidden, residual)
        return F.normalize(hidden[torch.cumsum(forward_batch.extend_seq_lens, 0) - 1], dim=-1)


@pytest.fixture(scope="module")
def tiny() -> Qwen3Model:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6)
    return Qwen3Model(config).eval()


@torch.no_grad()
def test_the_pooled_last_layer_gives_transformers_vectors(tiny: Qwen3Model) -> None:
    lens = [5, 1, 17, 9]
    seqs = [torch.randint(0, 300, (n,)) for n in lens]
    reference = torch.stack([F.normalize(tiny(input_ids=s[None]).last_hidden_state[0, -1], dim=-1)
                             for s in seqs])
    model, batch = Model(tiny), types.SimpleNamespace(extend_seq_lens=torch.tensor(lens))
    ids, positions = torch.cat(seqs), torch.cat([torch.arange(n) for n in lens])
    every_row = model(ids, positions, batch)
    assert F.cosine_similarity(every_row, reference).min() > 0.99999  # the stand-in is SGLang's layout
    mlp_rows: list[int] = []
    for layer in (model.layers[-1], model.layers[0]):
        layer.mlp.register_forward_hook(lambda m, i, o: mlp_rows.append(i[0].shape[0]))
    assert pooled_layer.install(model, slots=8)
    pooled = pooled_layer.around_forward(Model.forward, model, ids, positions, batch)
    assert F.cosine_similarity(pooled, reference).min() > 0.99999
    assert torch.allclose(pooled, every_row, atol=1e-6)
    assert mlp_rows == [sum(lens), 8]  # the first layer every row, the last one its slots
    assert getattr(model, pooled_layer.ROWS_ATTR).index.tolist() == [4, 5, 22, 31, 31, 31, 31, 31]


def test_the_row_index_pads_with_the_last_row_and_refuses_a_batch_over_its_slots() -> None:
    rows = PooledRows(4)
    rows.fill(torch.tensor([3, 2]))
    assert rows.index.tolist() == [2, 4, 4, 4]
    rows.fill(torch.tensor([], dtype=torch.long))  # a dummy pass: left as it was
    assert rows.index.tolist() == [2, 4, 4, 4]
    with pytest.raises(ValueError, match="5 sequences, more than the 4"):
        rows.fill(torch.ones(5, dtype=torch.long))


def test_a_model_it_cannot_change_is_left_whole() -> None:
    split = types.SimpleNamespace(model=types.SimpleNamespace(layers=[types.SimpleNamespace(
        self_attn=types.SimpleNamespace(tp_size=2))]))
    assert not pooled_layer.install(split, 8) and not hasattr(split, pooled_layer.ROWS_ATTR)
    pooled_layer.after_init(None, object(), slots=8)  # logged, not raised: SGLang builds it unchanged


def test_the_hooks_and_the_replaced_layer_match_sglang_0_5_17() -> None:
    """Each model class's ``__init__`` (AFTER) and ``forward`` (AROUND), and the decoder layer's
    and attention's methods that ``last_layer_forward`` takes the place of or calls."""
    registered: list[tuple[str, Any, str]] = []
    registry = types.SimpleNamespace(register=lambda *hook: registered.append(hook))
    pooled_layer.register(registry, types.SimpleNamespace(AFTER="after", AROUND="around"), 16)
    methods = json.loads((FIXTURES / "sglang_0.5.17_hooks.json").read_text())["methods"]
    assert {t for t, _, _ in registered} <= methods.keys()
    kinds = [(t.rsplit(".", 1)[1], k) for t, _, k in registered]
    assert kinds == [("__init__", "after"), ("forward", "around")] * 2
    for cls in pooled_layer.MODEL_CLASSES:
        assert methods[f"{cls}.forward"]["args"][:4] == ["self", "input_ids", "positions", "forward_batch"]
    layer = methods["sglang.srt.models.qwen3.Qwen3DecoderLayer.forward"]["args"]
    assert list(inspect.signature(pooled_layer.last_layer_forward).parameters)[2:] == layer[1:]
    assert methods["sglang.srt.models.qwen3.Qwen3Attention.forward_prepare_native"]["args"] == [
        "self", "positions", "hidden_states"]
