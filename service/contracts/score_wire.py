"""The engine wire format of rerankers, as SGLang 0.5.17 speaks it with ``--skip-tokenizer-init``;
the CPU engine speaks the same, so the gateway cannot tell the two apart (as for embeddings).

A reranker (a cross-encoder, or Qwen3-Reranker with its score head): ``POST /encode``
``{"input_ids": [[ids], ...]}`` (one input: a flat list) -> ``[{"embedding": score, "meta_info":
{...}}, ...]`` (one input: the object alone); the score is the classifier's logit (SGLang applies
``sbert_ce_default_activation_function`` when the checkpoint names one, else none), or
Qwen3-Reranker's ``logit(yes) - logit(no)``.
"""

from __future__ import annotations

import orjson
from pydantic import BaseModel, ConfigDict, StrictInt


class EncodeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_ids: list[list[StrictInt]] | list[StrictInt]

    def batch(self) -> list[list[int]]:
        flat = [x for x in self.input_ids if isinstance(x, int)]
        return [flat] if flat else [x for x in self.input_ids if isinstance(x, list)]

    @property
    def single(self) -> bool:
        return bool(self.input_ids) and isinstance(self.input_ids[0], int)


def encode_request(batch: list[list[int]]) -> bytes:
    # one input goes as a flat list: SGLang 0.5.17's own warm-up says a list of one fails
    return orjson.dumps({"input_ids": batch[0] if len(batch) == 1 else batch})


def encode_response(scores: list[float], tokens: list[int], single: bool) -> bytes:
    items = [{"embedding": s, "meta_info": {"prompt_tokens": n}} for s, n in zip(scores, tokens, strict=True)]
    return orjson.dumps(items[0] if single else items)
