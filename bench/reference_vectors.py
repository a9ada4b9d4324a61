"""Reference embeddings from a plain transformers forward pass, for comparing servers' vectors:
the checkpoint's base model, last-token pooling, L2 norm (what Qwen3-Embedding's
sentence-transformers files say). Prints one JSON object: the vectors and each text's token
count.

    python3 bench/reference_vectors.py MODEL_DIR TEXTS_JSON [--device cuda]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


class Reference:
    """The model loaded once; ``embed`` gives one vector (and its token count) per text."""

    def __init__(self, model_dir: str, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.torch, self.device = torch, device
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        self.model = AutoModel.from_pretrained(model_dir, dtype=dtype).to(device).eval()

    def embed(self, texts: list[str]) -> tuple[list[list[float]], list[int]]:
        vectors, tokens = [], []
        with self.torch.inference_mode():
            for text in texts:  # one at a time: no padding to get wrong
                ids = self.tokenizer(text, return_tensors="pt")["input_ids"].to(self.device)
                hidden = self.model(input_ids=ids).last_hidden_state[0, -1].float()
                vectors.append(self.torch.nn.functional.normalize(hidden, dim=0).tolist())
                tokens.append(int(ids.shape[1]))
        return vectors, tokens


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("texts", type=Path, help="a JSON list of strings")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    vectors, tokens = Reference(a.model_dir, a.device).embed(json.loads(a.texts.read_text()))
    return {"vectors": vectors, "tokens": tokens}


if __name__ == "__main__":
    print(json.dumps(main()))
