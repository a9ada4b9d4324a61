"""Rerankers as torch modules from (token ids, attention mask) to one raw score per input: what
the torch backend runs and what the ONNX export traces (torch is imported here, so only the
export's child process and the torch backend import this module).

- a cross-encoder: its ``*ForSequenceClassification`` logit. A BERT pair reads its segments
  from the ids: type 1 after the first ``[SEP]`` (the gateway tokenises text with its special
  tokens as plain text, so the first ``[SEP]`` is always the frame's);
- Qwen3-Reranker: the causal LM's hidden state at the last token against the ``yes`` and ``no``
  rows of its output layer, ``logit(yes) - logit(no)``: the two logits the model card compares,
  without the other 151,667 (what vLLM's ``classifier_from_token: ["no", "yes"]`` computes).

Inputs are right-padded, as the CPU engine pads.
"""

from __future__ import annotations

from typing import Any

import torch

from embedserve.core.pairs import label_ids
from embedserve.model_info import ModelInfo


class CrossEncoderScore(torch.nn.Module):
    def __init__(self, model: Any, sep_id: int | None) -> None:
        super().__init__()
        self.model = model
        self.sep_id = sep_id  # None: the model has one segment type (XLM-R)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        kwargs = {}
        if self.sep_id is not None:
            sep = (input_ids == self.sep_id).long()
            after_first = (torch.cumsum(sep, dim=1) - sep) > 0
            kwargs["token_type_ids"] = after_first.long() * attention_mask
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits
        return logits[:, :1].float()


class YesNoScore(torch.nn.Module):
    def __init__(self, model: Any, no_id: int, yes_id: int) -> None:
        super().__init__()
        self.body = model.model
        weight = model.lm_head.weight.detach()
        self.register_buffer("direction", (weight[yes_id] - weight[no_id]).float().clone())

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        last = (attention_mask.sum(dim=1) - 1).view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])
        final = hidden.gather(1, last).squeeze(1).float()
        return (final @ self.direction).unsqueeze(1)


def sep_id_of(model: Any, info: ModelInfo) -> int | None:
    """The ``[SEP]`` id when the model reads segment types, else None."""
    if int(getattr(model.config, "type_vocab_size", 1) or 1) < 2:
        return None
    from embedserve.core.pairs import CrossEncoderPairs

    middle = CrossEncoderPairs(info.path, info.max_seq_len).middle
    return middle[0] if middle else None


def load_score_module(
    info: ModelInfo, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> torch.nn.Module:
    """The model folder's reranker as a module in eval mode (fp32 on the CPU unless asked),
    attention by PyTorch's SDPA."""
    options: dict[str, Any] = {"local_files_only": True, "dtype": dtype, "attn_implementation": "sdpa"}
    if info.scoring == "cross-encoder":
        from transformers import AutoModelForSequenceClassification

        model = AutoModelForSequenceClassification.from_pretrained(str(info.path), **options)
        return CrossEncoderScore(model, sep_id_of(model, info)).to(device).eval()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(info.path), **options)
    no_id, yes_id = label_ids(info.path)
    return YesNoScore(model, no_id, yes_id).to(device).eval()


def vocab_size(module: torch.nn.Module) -> int:
    inner: Any = module.model if isinstance(module, CrossEncoderScore) else module.body
    return int(inner.get_input_embeddings().num_embeddings)
