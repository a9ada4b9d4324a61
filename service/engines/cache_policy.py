"""When to empty the CUDA caching allocator inside an engine process: pure logic, no torch.

The SGLang plugin (``service/sglang_plugin.py``) asks :meth:`CachePolicy.decide` after every
batch and calls ``torch.cuda.empty_cache()`` when it says so. The rules are OR-ed
(``CacheClearSettings`` in ``service/config/engine.py``):

* ``every_n_batches``: after every N-th batch (1 = every batch, 0 = never). Unthrottled:
  the operator asked for exactly this rhythm.
* ``fragmentation_ratio``: inactive-split / reserved above the ratio.
* ``unused_reserve_bytes``: reserved memory that no tensor uses and that ``empty_cache()``
  can actually hand back, above the limit.

The two threshold rules are throttled by ``min_interval_s``. ``empty_cache()`` frees only
whole unused segments; split blocks (``inactive_split``) stay. A threshold that a clear
cannot bring down would otherwise fire on every batch, each time synchronising the GPU,
so a threshold clear that frees (almost) nothing doubles the throttle interval (up to
``max_backoff``) and one that frees memory resets it.
"""

from __future__ import annotations

from dataclasses import dataclass

#: A clear that freed less than this counts as ineffective (throttle backs off).
INEFFECTIVE_FREED_BYTES = 1 << 20


@dataclass(frozen=True)
class AllocatorSnapshot:
    """The three allocator figures the rules read (``torch.cuda.memory_stats()``)."""

    allocated: int
    reserved: int
    inactive_split: int

    @property
    def unused(self) -> int:
        """Reserved but holding no tensor."""
        return max(0, self.reserved - self.allocated)

    @property
    def reclaimable(self) -> int:
        """What ``empty_cache()`` could return: unused memory not inside split segments."""
        return max(0, self.reserved - self.allocated - self.inactive_split)

    @property
    def fragmentation(self) -> float:
        return self.inactive_split / self.reserved if self.reserved > 0 else 0.0


@dataclass
class CachePolicy:
    every_n_batches: int = 64
    fragmentation_ratio: float | None = 0.25
    unused_reserve_bytes: int | None = 4 << 30
    min_interval_s: float = 1.0
    max_backoff: int = 64
    # state
    last_clear_time: float | None = None
    backoff: int = 1

    @classmethod
    def from_settings(cls, cs: object) -> CachePolicy:
        """From a ``CacheClearSettings`` (duck-typed, so this module stays import-light)."""
        return cls(
            every_n_batches=int(getattr(cs, "every_n_batches", 64)),
            fragmentation_ratio=getattr(cs, "fragmentation_ratio", 0.25),
            unused_reserve_bytes=getattr(cs, "unused_reserve_bytes", 4 << 30),
            min_interval_s=float(getattr(cs, "min_interval_s", 1.0)),
        )

    @property
    def enabled(self) -> bool:
        return (
            self.every_n_batches > 0
            or self.fragmentation_ratio is not None
            or self.unused_reserve_bytes is not None
        )

    @property
    def needs_snapshot(self) -> bool:
        """Whether :meth:`decide` reads allocator figures (else pass ``None``)."""
        return self.fragmentation_ratio is not None or self.unused_reserve_bytes is not None

    def threshold_interval_s(self) -> float:
        return self.min_interval_s * self.backoff

    def thresholds_due(self, now: float) -> bool:
        """Whether the throttle lets a threshold rule fire now (read stats only then)."""
        if not self.needs_snapshot:
            return False
        return self.last_clear_time is None or now - self.last_clear_time >= (
            self.threshold_interval_s()
        )

    def decide(self, batches: int, now: float, snap: AllocatorSnapshot | None) -> str | None:
        """The reason to clear after batch number ``batches`` (1-based), or ``None``."""
        if self.every_n_batches > 0 and batches > 0 and batches % self.every_n_batches == 0:
            return "every_n_batches"
        if snap is None or not self.thresholds_due(now):
            return None
        if self.fragmentation_ratio is not None and snap.fragmentation > self.fragmentation_ratio:
            return "fragmentation"
        if self.unused_reserve_bytes is not None and snap.reclaimable > self.unused_reserve_bytes:
            return "unused_reserve"
        return None

    def record_clear(self, now: float, reason: str, freed_bytes: int) -> None:
        self.last_clear_time = now
        if reason == "every_n_batches":
            return
        if freed_bytes < INEFFECTIVE_FREED_BYTES:
            self.backoff = min(self.backoff * 2, self.max_backoff)
        else:
            self.backoff = 1
