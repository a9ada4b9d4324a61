"""Qwen3-Reranker's score on SGLang's embedding path.

Qwen3-Reranker scores a pair by the logit of "yes" over "no" after its prompt: two rows of the LM
head against the last token's hidden state. SGLang 0.5.17 serves it only in generation mode
(``/v1/score``): a paged KV pool, a vocabulary-wide logit per request and the decode machinery, for
one number. Here the same checkpoint runs as an embedding model (``--is-embedding``), so it gets
the embedding-only forward (no KV pool, the overlap scheduler, the pooled last layer), and the
plugin swaps the model's pooler (LAST, L2-normalised) for :class:`LabelLogitPooler`: the last
token's hidden state (after the final norm) against the "yes" and "no" rows, in fp32, giving
``logit(yes) - logit(no)`` as a one-value vector that ``/encode`` returns like a cross-encoder's
logit (what the CPU and torch engines give for this model; the gateway applies the sigmoid).

The head's rows are read from the model's LM head at each forward (the weights are loaded after
the model is built; two rows cost nothing). A model this cannot score refuses to start: its
embedding pooler would answer with a normalised hidden state, which is not a score.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

log = logging.getLogger("embedserve.label_head")

#: the model class SGLang 0.5.17 builds for Qwen3-Reranker (a ``Qwen3ForCausalLM`` checkpoint)
MODEL_CLASS = "sglang.srt.models.qwen3.Qwen3ForCausalLM"


def label_logit(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``logit(yes) - logit(no)`` per row of ``hidden`` (rows, width), as (rows, 1) fp32;
    ``labels``: the ids of "yes" and "no", on ``weight``'s device."""
    logits = hidden.float() @ weight.index_select(0, labels).float().T
    return (logits[:, :1] - logits[:, 1:]).contiguous()


def last_rows(hidden_states: torch.Tensor, extend_seq_lens: torch.Tensor) -> torch.Tensor:
    """Each packed sequence's last row (SGLang's LAST pooling)."""
    return hidden_states[torch.cumsum(extend_seq_lens, 0) - 1]


def pooler_output(embeddings: torch.Tensor) -> Any:
    from sglang.srt.layers.pooler import EmbeddingPoolerOutput

    return EmbeddingPoolerOutput(embeddings=embeddings)


class LabelLogitPooler(torch.nn.Module):
    """Takes the place of ``Qwen3ForCausalLM.pooler``: the label logit instead of the vector."""

    def __init__(self, model: Any, yes_id: int, no_id: int) -> None:
        super().__init__()
        self.owner = [model]  # not a submodule: the LM head stays the model's own parameter
        # on the head's device once, not copied from the host (a wait on the GPU) every batch
        self.labels = torch.tensor([yes_id, no_id], device=model.lm_head.weight.device)

    def forward(self, hidden_states: torch.Tensor, forward_batch: Any) -> Any:
        pooled = last_rows(hidden_states, forward_batch.extend_seq_lens)
        return pooler_output(label_logit(pooled, self.owner[0].lm_head.weight, self.labels))


def install(model: Any, yes_id: int, no_id: int) -> None:
    """Swap ``model``'s pooler; ``RuntimeError`` where the LM head is not whole on this GPU."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if weight is None or getattr(head, "tp_size", 1) != 1 or weight.shape[0] <= max(yes_id, no_id):
        raise RuntimeError(f"Qwen3-Reranker's label head: {type(model).__name__} has no whole LM head on "
                           "this GPU (tensor parallelism is not supported); the engine cannot score")
    model.pooler = LabelLogitPooler(model, yes_id, no_id)
    log.info("label head: scores are logit(yes=%d) - logit(no=%d) of the last token", yes_id, no_id)


def after_init(_result: Any, model: Any, *_args: Any, yes_id: int, no_id: int, **_kwargs: Any) -> None:
    """AFTER hook on the model's ``__init__``; an error stops the engine rather than serve vectors."""
    install(model, yes_id, no_id)


def register(registry: Any, hook_type: Any, yes_id: int, no_id: int) -> None:
    registry.register(f"{MODEL_CLASS}.__init__", functools.partial(after_init, yes_id=yes_id, no_id=no_id),
                      hook_type.AFTER)
