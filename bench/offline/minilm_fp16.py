"""The bundled all-MiniLM-L6-v2 with its weights in fp16, for a GPU host: SGLang's
``--dtype auto`` runs an fp32 checkpoint in fp16 anyway, and fp16 halves the transfer."""

import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

from embedserve.contracts.models import BUNDLED_MODEL, resolve_model_path


def main(dest: str) -> None:
    src, out = Path(resolve_model_path(BUNDLED_MODEL)), Path(dest)
    shutil.copytree(src, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("model.safetensors", "*.md"))
    weights = {k: v.half().contiguous() for k, v in load_file(src / "model.safetensors").items()}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    print(out, sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) // 2**20, "MiB")


if __name__ == "__main__":
    main(sys.argv[1])
