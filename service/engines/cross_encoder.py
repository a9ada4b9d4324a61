"""The XLM-R cross-encoder's per-sequence loops done once per batch (``engine.vectorised_cross_encoder``).

SGLang 0.5.17 serves bge-reranker-style checkpoints as ``XLMRobertaForSequenceClassification``
(``srt/models/roberta.py``), which runs two Python loops over a batch's sequences:

* ``RobertaEmbedding.forward`` slices each sequence by a length read from a GPU tensor, checks that
  its positions count from 0 (``torch.equal``) and builds its position ids
  (``create_position_ids_from_input_ids``: the running count of non-padding tokens, times the
  not-padding mask, plus ``padding_idx``): several waits on the GPU per sequence.
  :func:`batch_position_ids` computes the same ids for the batch at once, the running count restarting
  where each sequence starts. The check is not repeated: it would be a wait of its own.
* ``CrossEncodingPooler.forward`` (``srt/layers/pooler.py``) runs ``RobertaClassificationHead`` on
  each sequence's slice (it reads the slice's first row) and stacks the logits. :func:`pooler_forward`
  gathers every sequence's first row and runs the head's two linear layers once.

The plugin's AFTER hook on the model class's ``__init__`` swaps both modules' ``forward`` on the built
model (as the pooled last layer does); a model laid out otherwise is left as it is.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

log = logging.getLogger("embedserve.cross_encoder")

MODEL_CLASS = "sglang.srt.models.roberta.XLMRobertaForSequenceClassification"


def batch_position_ids(input_ids: torch.Tensor, seq_lens: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """``create_position_ids_from_input_ids`` of each packed sequence, for all of them at once: no
    host sync (``seq_lens`` stays on its device)."""
    total = input_ids.shape[0]
    counts = input_ids.ne(padding_idx).long()
    running = torch.cumsum(counts, 0)
    lens = seq_lens.to(device=input_ids.device, dtype=torch.long)
    starts = torch.cumsum(lens, 0) - lens
    start_mask = torch.zeros(total, dtype=torch.long, device=input_ids.device)
    start_mask.index_add_(0, starts, torch.ones_like(starts))
    sequence = torch.cumsum(start_mask, 0) - 1  # each token's sequence
    before = (running - counts)[starts]  # non-padding tokens ahead of each sequence
    return (running - before[sequence]) * counts + padding_idx


def embedding_forward(embedding: Any, input_ids: torch.Tensor, seq_lens: torch.Tensor,
                      position_ids: torch.Tensor, forward_batch: Any) -> torch.Tensor:
    """``RobertaEmbedding.forward`` of SGLang 0.5.17 (called with keywords: the same names) with
    :func:`batch_position_ids`; ``position_ids`` (0 .. n-1 per sequence) only served its check."""
    inputs_embeds = embedding.word_embeddings(input_ids)
    positions = batch_position_ids(input_ids, seq_lens, embedding.padding_idx)
    token_type_ids = forward_batch.token_type_ids
    if token_type_ids is None:
        token_type_ids = torch.zeros(input_ids.size(), dtype=torch.long, device=inputs_embeds.device)
    embeddings = (inputs_embeds + embedding.token_type_embeddings(token_type_ids)
                  + embedding.position_embeddings(positions))
    return embedding.LayerNorm(embeddings)


def pooler_forward(pooler: Any, output: Any, hidden_states: torch.Tensor, forward_batch: Any) -> Any:
    """``CrossEncodingPooler.forward`` of SGLang 0.5.17 without a pooler (XLM-R's): the classifier
    head (dense, tanh, out_proj) on every sequence's first row at once; ``output`` is SGLang's
    ``EmbeddingPoolerOutput``."""
    lens = forward_batch.extend_seq_lens
    first = torch.cumsum(lens, 0) - lens
    head = pooler.classifier
    logits = head.out_proj(torch.tanh(head.dense(hidden_states.index_select(0, first))))
    return output(embeddings=pooler.default_activation_function(logits).squeeze(-1))


def install(model: Any, output: Any) -> bool:
    """Swap the embeddings' and the pooler's ``forward`` on ``model``; False where it is not laid out
    as SGLang 0.5.17's ``XLMRobertaForSequenceClassification`` (no pooler before the head)."""
    embedding = getattr(getattr(model, "roberta", None), "embeddings", None)
    pooler, head = getattr(model, "pooler", None), getattr(model, "classifier", None)
    if (embedding is None or not hasattr(embedding, "padding_idx") or pooler is None
            or getattr(pooler, "pooler", True) is not None or not hasattr(head, "dense")):
        log.warning("vectorised cross-encoder: %s is not laid out as expected; left as it is",
                    type(model).__name__)
        return False
    embedding.forward = functools.partial(embedding_forward, embedding)
    pooler.forward = functools.partial(pooler_forward, pooler, output)
    log.info("vectorised cross-encoder: position ids and the classifier head once per batch")
    return True


def after_init(_result: Any, model: Any, *_args: Any, **_kwargs: Any) -> None:
    """AFTER hook on the model's ``__init__``; a model it cannot change runs SGLang's loops."""
    try:
        from sglang.srt.layers.pooler import EmbeddingPoolerOutput

        install(model, EmbeddingPoolerOutput)
    except Exception:
        log.exception("vectorised cross-encoder: not installed; SGLang's per-sequence loops run")


def register(registry: Any, hook_type: Any) -> None:
    registry.register(f"{MODEL_CLASS}.__init__", after_init, hook_type.AFTER)
