"""The last decoder layer computed for the pooled rows only (``engine.pooled_last_layer``).

With last-token pooling only each sequence's last row of the last layer reaches its vector. That
layer's attention still reads every token's K and V, so it runs whole; its output projection,
post-attention norm and MLP are needed for the pooled rows alone: 84% of a layer's GEMM work on
Qwen3-Embedding-4B's shape (73% on the 0.6B's), so the forward's linear layers do 2.3% (0.6B: 2.6%)
less of it.

Inside SGLang 0.5.17 (the plugin registers the hooks): ``install`` swaps the model's last
``Qwen3DecoderLayer.forward`` for ``last_layer_forward`` when the model is built. It gathers a fixed
number of rows (:class:`PooledRows`: one slot per request an engine batch may hold), so its shapes
never change and SGLang's prefill CUDA graphs, which capture the transformer body at fixed token
counts, capture it too. ``fill`` writes the rows' indexes before each forward, outside the graphs
(``around_forward``): cumsum of the batch's extend lengths minus one, where SGLang's LAST pooler
reads, the spare slots repeating the last. The layer's other output rows keep their input values;
nothing reads them (the final norm runs on every row, the pooler reads the pooled ones).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

log = logging.getLogger("embedserve.pooled_layer")

#: The model classes SGLang 0.5.17 serves Qwen3-Embedding with (``Qwen3ForCausalLM`` checkpoints,
#: and bare ``Qwen3Model`` ones); each has ``.model.layers`` and ``forward(input_ids, positions,
#: forward_batch, ...)``.
MODEL_CLASSES = ("sglang.srt.models.qwen3.Qwen3ForCausalLM", "sglang.srt.models.qwen3_embedding.Qwen3Model")
ROWS_ATTR = "_embedserve_pooled_rows"


class PooledRows:
    """A fixed-size index of each sequence's last row in a packed batch."""

    def __init__(self, slots: int, device: Any = None) -> None:
        self.index = torch.zeros(slots, dtype=torch.long, device=device)

    def fill(self, extend_lens: torch.Tensor) -> None:
        """The last row of each of the batch's sequences; the spare slots repeat the last one (their
        rows are computed twice and written back with the same values). No host sync."""
        count, slots = int(extend_lens.shape[0]), int(self.index.shape[0])
        if count > slots:  # the engine was launched for fewer: refuse rather than pool wrong rows
            raise ValueError(f"a batch of {count} sequences, more than the {slots} pooled-row slots")
        if count:
            ends = torch.cumsum(extend_lens, 0) - 1
            self.index[:count].copy_(ends)
            self.index[count:].fill_(ends[-1])


LayerOutput = tuple[torch.Tensor, torch.Tensor]  # hidden states, residual


def last_layer_forward(layer: Any, rows: PooledRows, positions: torch.Tensor, hidden_states: torch.Tensor,
                       forward_batch: Any, residual: torch.Tensor | None,
                       post_residual_addition: torch.Tensor | None = None) -> LayerOutput:
    """``Qwen3DecoderLayer.forward`` of SGLang 0.5.17 on one GPU (no tensor parallelism, so the
    post-attention step is its norm alone), with attention over every row and the rest over
    ``rows``."""
    hidden_states, residual = layer.layer_communicator.prepare_attn(
        hidden_states, residual, forward_batch, post_residual_addition=post_residual_addition)
    if hidden_states.shape[0] == 0:
        return hidden_states, residual
    attention = layer.self_attn
    q, k, v = attention.forward_prepare_native(positions=positions, hidden_states=hidden_states)
    context = attention.attn(q, k, v, forward_batch)
    index = rows.index
    out, _ = attention.o_proj(context.index_select(0, index))
    out, pooled_residual = layer.post_attention_layernorm(out, residual.index_select(0, index))
    out = layer.mlp(out)
    return hidden_states.index_copy_(0, index, out), residual.index_copy_(0, index, pooled_residual)


def install(model: Any, slots: int) -> bool:
    """Swap ``model``'s last decoder layer for :func:`last_layer_forward` (index buffer on the
    device the model is built on); False where the model is not one this path knows."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    last = layers[len(layers) - 1] if layers is not None and len(layers) else None
    if last is None or getattr(getattr(last, "self_attn", None), "tp_size", 1) != 1:
        log.warning("pooled last layer: %s is split across GPUs or has no decoder layers here; left as it "
                    "is", type(model).__name__)
        return False
    rows = PooledRows(slots, device=next(last.parameters()).device)
    setattr(model, ROWS_ATTR, rows)
    last.forward = functools.partial(last_layer_forward, last, rows)
    log.info("pooled last layer: the last layer computes %d rows after its attention", slots)
    return True


def around_forward(original: Any, model: Any, input_ids: Any, positions: Any, forward_batch: Any,
                   *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on the model's ``forward``: the pooled rows' indexes first (a prefill batch has
    extend lengths; an embedding engine runs no other kind but SGLang's own dummy passes)."""
    rows, lens = getattr(model, ROWS_ATTR, None), getattr(forward_batch, "extend_seq_lens", None)
    if rows is not None and lens is not None:
        rows.fill(lens)
    return original(model, input_ids, positions, forward_batch, *args, **kwargs)


def after_init(_result: Any, model: Any, *_args: Any, slots: int, **_kwargs: Any) -> None:
    """AFTER hook on the model's ``__init__``; a model it cannot change runs every row, as before."""
    try:
        install(model, slots)
    except Exception:
        log.exception("pooled last layer: not installed; the last layer runs every row")


def register(registry: Any, hook_type: Any, slots: int) -> None:
    """The hooks, on each model class Qwen3-Embedding may load as."""
    for cls in MODEL_CLASSES:
        registry.register(f"{cls}.__init__", functools.partial(after_init, slots=slots), hook_type.AFTER)
        registry.register(f"{cls}.forward", around_forward, hook_type.AROUND)
