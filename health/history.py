"""Bounded sample history: full resolution for recent samples, thinned for old ones.

When the buffer is full, every other sample of its older half is dropped, so a week of
5-second samples fits in ``max_samples`` with the fitting window (hours) at full
resolution and older days coarser. Events (restarts, cache clears) are kept apart, so
thinning never loses a reset. Optional JSON persistence keeps the window across a
restart of the probe (not of the engine: that resets the forecast anyway).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from embedserve.health.trend import FloatArray

MAX_EVENTS = 1000


@dataclass(frozen=True)
class Sample:
    time: float
    used: dict[str, float]  # resource -> bytes


@dataclass(frozen=True)
class Event:
    time: float
    kind: str  # "restart" | "cache_clear" | "probe_start"
    detail: str = ""


class History:
    def __init__(self, max_samples: int) -> None:
        if max_samples < 10:
            raise ValueError("max_samples must be at least 10")
        self.max_samples = max_samples
        self._samples: list[Sample] = []
        self.events: deque[Event] = deque(maxlen=MAX_EVENTS)

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def samples(self) -> list[Sample]:
        return list(self._samples)

    def append(self, sample: Sample) -> None:
        if self._samples and sample.time < self._samples[-1].time:
            return  # clock went back: keep the series monotonic
        self._samples.append(sample)
        if len(self._samples) > self.max_samples:
            self._thin()

    def _thin(self) -> None:
        half = len(self._samples) // 2
        old, recent = self._samples[:half], self._samples[half:]
        self._samples = old[::2] + recent

    def add_event(self, event: Event) -> None:
        self.events.append(event)

    def last_event(self, *kinds: str) -> Event | None:
        for event in reversed(self.events):
            if event.kind in kinds:
                return event
        return None

    def series(self, resource: str) -> tuple[FloatArray, FloatArray]:
        pts = [(s.time, s.used[resource]) for s in self._samples if resource in s.used]
        if not pts:
            return np.empty(0), np.empty(0)
        arr = np.asarray(pts, dtype=np.float64)
        return arr[:, 0], arr[:, 1]

    # persistence -------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "version": 1,
            "samples": [[s.time, s.used] for s in self._samples],
            "events": [[e.time, e.kind, e.detail] for e in self.events],
        }

    def save(self, path: str | Path) -> None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".health-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(self.to_json(), fh)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | Path, max_samples: int) -> History:
        """A history from ``path``; an absent or unreadable file gives an empty one."""
        history = cls(max_samples)
        try:
            raw = json.loads(Path(path).read_text())
            for t, used in raw.get("samples", []):
                history.append(Sample(float(t), {k: float(v) for k, v in used.items()}))
            for t, kind, detail in raw.get("events", []):
                history.add_event(Event(float(t), str(kind), str(detail)))
        except (OSError, ValueError, TypeError, AttributeError):
            return cls(max_samples)
        return history
