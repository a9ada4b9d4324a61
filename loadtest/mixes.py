"""Length mixes: how many tokens each input of a request should have.

A mix is parsed from a short spec string (``--mix``):

* ``seed``: the production mix of the seed story: 92% of inputs 8-512 tokens,
  6% 513-1024, 2% 1025-32768 (uniform within each bucket).
* ``uniform:A-B``: every input uniform in [A, B] tokens.
* ``fixed:N``: every input exactly N tokens.
* ``buckets:W:A-B,W:A-B,...``: weighted buckets, uniform within each.
* ``file:PATH``: real texts, one per line (``.jsonl``: objects with a ``text`` field),
  drawn at random; their lengths are whatever the texts measure.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

SEED_BUCKETS: tuple[tuple[float, int, int], ...] = (
    (0.92, 8, 512),
    (0.06, 513, 1024),
    (0.02, 1025, 32768),
)


@dataclass(frozen=True)
class BucketMix:
    """Weighted length buckets; a length is uniform within its bucket."""

    buckets: tuple[tuple[float, int, int], ...]
    name: str = "buckets"

    def __post_init__(self) -> None:
        if not self.buckets:
            raise ValueError("a mix needs at least one bucket")
        for w, lo, hi in self.buckets:
            if w <= 0 or lo < 1 or hi < lo:
                raise ValueError(f"bad bucket {w}:{lo}-{hi}")

    def sample(self, rng: random.Random, cap: int | None = None) -> int:
        """One length in tokens, clamped to ``cap`` when given."""
        weights = [b[0] for b in self.buckets]
        _, lo, hi = rng.choices(self.buckets, weights=weights)[0]
        n = rng.randint(lo, hi)
        return min(n, cap) if cap else n

    @property
    def max_len(self) -> int:
        return max(b[2] for b in self.buckets)

    def describe(self) -> str:
        total = sum(b[0] for b in self.buckets)
        parts = [f"{100 * w / total:.4g}% {lo}-{hi}" for w, lo, hi in self.buckets]
        return f"{self.name} ({', '.join(parts)} tokens)"


@dataclass(frozen=True)
class FileMix:
    """Real texts from a file, drawn uniformly at random."""

    texts: tuple[str, ...]
    path: str

    def pick(self, rng: random.Random) -> str:
        return self.texts[self.pick_index(rng)]

    def pick_index(self, rng: random.Random) -> int:
        return rng.randrange(len(self.texts))

    def describe(self) -> str:
        return f"file {self.path} ({len(self.texts)} texts)"


Mix = BucketMix | FileMix


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    a, b = int(lo), int(hi or lo)
    if a < 1 or b < a:
        raise ValueError(f"bad range {text!r}: want A-B with 1 <= A <= B")
    return a, b


def load_texts(path: Path) -> tuple[str, ...]:
    """Texts from a file: one per line, or ``.jsonl`` objects with a ``text`` field."""
    texts: list[str] = []
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            line = line.rstrip("\n")
            if path.suffix == ".jsonl":
                if line.strip():
                    texts.append(str(json.loads(line)["text"]))
            elif line.strip():
                texts.append(line.replace("\\n", "\n"))
    if not texts:
        raise ValueError(f"no texts in {path}")
    return tuple(texts)


def parse_mix(spec: str) -> Mix:
    """Parse a ``--mix`` spec (see the module docstring)."""
    kind, _, rest = spec.partition(":")
    if kind == "seed" and not rest:
        return BucketMix(SEED_BUCKETS, "seed mix")
    if kind == "uniform":
        lo, hi = _range(rest)
        return BucketMix(((1.0, lo, hi),), "uniform")
    if kind == "fixed":
        n = int(rest)
        if n < 1:
            raise ValueError(f"bad mix {spec!r}: fixed:N wants N >= 1")
        return BucketMix(((1.0, n, n),), "fixed")
    if kind == "buckets":
        buckets = []
        for part in rest.split(","):
            w, _, r = part.partition(":")
            lo, hi = _range(r)
            buckets.append((float(w), lo, hi))
        return BucketMix(tuple(buckets))
    if kind == "file":
        return FileMix(load_texts(Path(rest)), rest)
    raise ValueError(
        f"unknown mix {spec!r}: use seed, uniform:A-B, fixed:N, buckets:W:A-B,... or file:PATH"
    )


def parse_count(spec: str) -> tuple[int, int]:
    """Inputs per request: ``N`` or ``A-B`` (uniform)."""
    try:
        return _range(spec)
    except ValueError:
        raise ValueError(f"bad --inputs {spec!r}: want N or A-B with 1 <= A <= B") from None
