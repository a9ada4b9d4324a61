"""SGLang plugin: CUDA cache clearing and allocator statistics inside each scheduler.

Entry point ``embedserve = embedserve.engines.sglang_plugin:register`` in group ``sglang.srt.plugins``
(pyproject.toml). SGLang 0.5.17 calls ``sglang.srt.plugins.load_plugins()`` in the server
process and again at the top of ``run_scheduler_process`` in every scheduler process; our
``register()`` adds AFTER hooks with ``HookRegistry``:

* ``Scheduler.process_batch_result``: runs once per forward batch, after its results
  (embeddings) have been handed on, in both the normal and the overlap event loop. We
  count the batch, ask :class:`embedserve.engines.cache_policy.CachePolicy` whether to empty the
  CUDA cache, do it (timed, synchronised), and publish statistics.
* ``Scheduler.on_idle``: the loop's idle branch, so statistics stay fresh when no traffic
  comes.

Where the engine serves Qwen3-Reranker, an AFTER hook on the model's ``__init__`` gives it a score
head in place of its embedding pooler (``label_head.py``).

A third hook, an AFTER hook of its own on ``Scheduler.process_batch_result``, mends
sglang#22518 for the overlap scheduler (``engine.overlap_schedule``): there the next batch is
built before the last one's results are processed, so the running batch still holds the last
batch's requests when it fills ``--max-running-requests`` and sets ``batch_is_full``; SGLang
0.5.17 clears that flag for a prefill-only running batch only once it is empty
(``managers/scheduler.py:3009``), and an engine that builds no batch meanwhile stops taking
work. Once a processed batch has finished requests in the running batch, the flag is cleared
(as upstream's fix does when the running batch shrinks): the next ``get_new_batch_prefill``
filters them out and counts the free room again.

In a leak drill (``embedserve up --drill-leak RATE`` sets ``EMBEDSERVE_DRILL_LEAK_BYTES_PER_S``
on the engines it starts) the two statistics hooks also grow GPU memory at that rate, held as tensors.

The model's memory lives in the scheduler process, so this is the only place where
``torch.cuda.memory_stats()`` sees it. Statistics may never break the scheduler: their hook
bodies are wrapped, log their first errors and carry on; without CUDA they do nothing. The
release is the opposite: without it the engine may stop taking work with nothing in its log, so
a failure there is logged and raised, SGLang's scheduler stops its server on it, and the engine
is restarted (by ``up``'s supervisor, or Kubernetes) with the traceback in its log.
The plugin is active only in engines launched by ``embedserve.engines.sglang`` (which sets
``EMBEDSERVE_ENGINE__KIND=sglang``), not in an unrelated SGLang that happens to share the
environment where embedserve is installed.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from embedserve.contracts.stats import EngineStats, write_stats
from embedserve.engines.cache_policy import AllocatorSnapshot, CachePolicy
from embedserve.engines.drill import LEAK_ENV, Leak

if TYPE_CHECKING:
    from embedserve.config import Settings

log = logging.getLogger("embedserve.sglang_plugin")

BATCH_HOOK_TARGET = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
IDLE_HOOK_TARGET = "sglang.srt.managers.scheduler.Scheduler.on_idle"
_MAX_LOGGED_ERRORS = 5


def _stat(stats: dict[str, Any], *path: str) -> int:
    """Read a counter from torch's nested memory-stats dict (or a flat one)."""
    flat = stats.get(".".join(path))
    if flat is not None:
        return int(flat)
    node: Any = stats
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return 0
        node = node[key]
    return int(node) if isinstance(node, int | float) else 0


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class CudaBackend:
    """The few torch.cuda calls the monitor needs (a fake replaces it in tests)."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self.device = int(torch.cuda.current_device())

    def memory_stats(self) -> dict[str, Any]:
        cuda = self._torch._C
        if hasattr(cuda, "_cuda_memoryStats"):  # nested dict, no Python flattening
            return dict(cuda._cuda_memoryStats(self.device))
        return dict(self._torch.cuda.memory_stats(self.device))

    def synchronize(self) -> None:
        self._torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        self._torch.cuda.empty_cache()

    def alloc(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8, device=self.device)


class Monitor:
    """Per-process state: batch count, policy, clear accounting, stats publishing."""

    def __init__(
        self,
        backend: Any,
        policy: CachePolicy,
        stats_dir: str | None,
        stats_interval_s: float,
        clock: Any = time.monotonic,
        wall: Any = time.time,
        leak_bytes_per_s: float | None = None,
    ) -> None:
        self.backend = backend
        self.leak = Leak(leak_bytes_per_s, backend.alloc, clock=clock) if leak_bytes_per_s else None
        self.policy = policy
        self.stats_dir = stats_dir
        self.stats_interval_s = stats_interval_s
        self.clock = clock
        self.wall = wall
        self.stats = EngineStats(source="torch.cuda", device=getattr(backend, "device", None))
        self._last_write = float("-inf")
        self.last_clear_reason: str | None = None

    # --- allocator figures -------------------------------------------------------------
    def snapshot(self, raw: dict[str, Any] | None = None) -> AllocatorSnapshot:
        raw = self.backend.memory_stats() if raw is None else raw
        return AllocatorSnapshot(
            allocated=_stat(raw, "allocated_bytes", "all", "current"),
            reserved=_stat(raw, "reserved_bytes", "all", "current"),
            inactive_split=_stat(raw, "inactive_split_bytes", "all", "current"),
        )

    def _fill_stats(self, raw: dict[str, Any]) -> None:
        s = self.stats
        snap = self.snapshot(raw)
        s.allocated_bytes = snap.allocated
        s.reserved_bytes = snap.reserved
        s.inactive_split_bytes = snap.inactive_split
        s.max_reserved_bytes = _stat(raw, "reserved_bytes", "all", "peak")
        s.num_alloc_retries = _stat(raw, "num_alloc_retries")
        s.num_ooms = _stat(raw, "num_ooms")
        s.rss_bytes = _rss_bytes()

    # --- hooks ---------------------------------------------------------------------------
    def on_batch(self) -> None:
        if self.leak is not None:
            self.leak.catch_up()
        self.stats.batches += 1
        now = self.clock()
        snap = self.snapshot() if self.policy.thresholds_due(now) else None
        reason = self.policy.decide(self.stats.batches, now, snap)
        if reason is not None:
            self.clear(reason)
        self.maybe_publish(force=reason is not None)

    def on_idle(self) -> None:
        if self.leak is not None:
            self.leak.catch_up()
        self.maybe_publish()

    def clear(self, reason: str) -> None:
        before = self.snapshot().reserved
        self.backend.synchronize()  # queued kernels are not the clear's cost
        t0 = time.perf_counter()
        self.backend.empty_cache()
        self.backend.synchronize()
        dt = time.perf_counter() - t0
        after = self.snapshot().reserved
        freed = max(0, before - after)
        s = self.stats
        s.cache_clears += 1
        s.cache_clear_seconds_total += dt
        s.last_clear_time = self.wall()
        s.last_clear_freed_bytes = freed
        self.last_clear_reason = reason
        self.policy.record_clear(self.clock(), reason, freed)

    def maybe_publish(self, force: bool = False) -> bool:
        now = self.clock()
        if self.stats_dir is None or (not force and now - self._last_write < self.stats_interval_s):
            return False
        self._last_write = now
        self._fill_stats(self.backend.memory_stats())
        write_stats(self.stats_dir, self.stats)
        return True


def engine_monitor(settings: Settings, leak_bytes_per_s: float | None = None) -> Monitor:
    """A GPU engine's allocator rules and statistics file (SGLang's scheduler, the torch engine)."""
    eng = settings.engine
    monitor = Monitor(CudaBackend(), CachePolicy.from_settings(eng.cache_clear), eng.stats_dir,
                      eng.stats_interval_s, leak_bytes_per_s=leak_bytes_per_s)
    monitor.stats.model = settings.model.served_name
    return monitor


_monitor: Monitor | None = None
_disabled = False
_errors = 0


def _get_monitor() -> Monitor | None:
    """Created lazily in the process that runs batches (the scheduler), never at import."""
    global _monitor, _disabled
    if _monitor is not None or _disabled:
        return _monitor
    try:
        import torch

        if not torch.cuda.is_available():
            _disabled = True
            log.info("embedserve plugin: no CUDA in this process, statistics disabled")
            return None
        from embedserve.config import load_settings

        settings = load_settings()
        eng = settings.engine
        leak = float(os.environ.get(LEAK_ENV) or 0) or None
        _monitor = engine_monitor(settings, leak)
        log.info(
            "embedserve plugin active in pid %d: cache clear %s, stats to %s every %.1fs",
            os.getpid(), eng.cache_clear.model_dump(), eng.stats_dir, eng.stats_interval_s,
        )
        if leak:
            log.warning("embedserve plugin: leak drill, GPU memory grows by %.0f bytes/s on purpose", leak)
    except Exception:
        _disabled = True
        log.exception("embedserve plugin: could not start; the engine runs without it")
    return _monitor


def _guarded(method: str) -> None:
    """The monitor's ``method``, errors logged (the first few) and swallowed: statistics never
    break the scheduler."""
    global _errors
    try:
        mon = _get_monitor()
        if mon is not None:
            getattr(mon, method)()
    except Exception:
        _errors += 1
        if _errors <= _MAX_LOGGED_ERRORS:
            log.exception("embedserve plugin: %s failed (error %d; engine continues)", method, _errors)


def release_full_running_batch(scheduler: Any) -> bool:
    """Clear ``batch_is_full`` on a prefill-only running batch that holds finished requests
    (sglang#22518, module docstring); True when it did."""
    batch: Any = getattr(scheduler, "running_batch", None)
    if not (getattr(batch, "is_prefill_only", False) and getattr(batch, "batch_is_full", False)):
        return False
    if not any(req.finished() for req in batch.reqs):
        return False
    batch.batch_is_full = False
    return True


def after_batch_release(_result: Any, *args: Any, **_kwargs: Any) -> None:
    """AFTER hook on ``Scheduler.process_batch_result`` (``args[0]`` is the scheduler): the full
    running batch released. A failure is logged, every time, and raised (module docstring)."""
    if not args:
        return
    try:
        release_full_running_batch(args[0])
    except Exception:
        log.critical(
            "embedserve plugin: releasing the full running batch (sglang#22518) failed; stopping "
            "the scheduler rather than leave an engine that may take no more work", exc_info=True,
        )
        raise


def after_batch(_result: Any, *_args: Any, **_kwargs: Any) -> None:
    """AFTER hook on ``Scheduler.process_batch_result``: statistics and cache clearing;
    returns None (result unchanged)."""
    _guarded("on_batch")


def after_idle(_result: Any, *_args: Any, **_kwargs: Any) -> None:
    """AFTER hook on ``Scheduler.on_idle``."""
    _guarded("on_idle")


def enabled_settings() -> Settings | None:
    """This engine's settings where embedserve launched it, else None (no hooks)."""
    try:
        from embedserve.config import load_settings

        settings = load_settings()
    except Exception:
        log.exception("embedserve plugin: settings unreadable; plugin off")
        return None
    return settings if settings.engine.kind == "sglang" else None


def register() -> None:
    """Entry point (group ``sglang.srt.plugins``): register the hooks; SGLang applies them."""
    settings = enabled_settings()
    if settings is None:
        log.info("embedserve plugin: not an embedserve-launched engine; no hooks")
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(BATCH_HOOK_TARGET, after_batch_release, HookType.AFTER)
    HookRegistry.register(BATCH_HOOK_TARGET, after_batch, HookType.AFTER)
    HookRegistry.register(IDLE_HOOK_TARGET, after_idle, HookType.AFTER)
    if slots := pooled_row_slots(settings):
        from embedserve.engines import pooled_layer

        pooled_layer.register(HookRegistry, HookType, slots)
    if settings.engine.strided_query is True:
        from embedserve.engines import strided_query

        strided_query.register(HookRegistry, HookType)
    if settings.engine.compiled_qk_norm_rope:
        from embedserve.engines import compiled_qk

        compiled_qk.register(HookRegistry, HookType)
    if settings.engine.vectorised_cross_encoder:
        from embedserve.engines import cross_encoder

        cross_encoder.register(HookRegistry, HookType)
    if labels := reranker_labels(settings):
        from embedserve.engines import label_head

        label_head.register(HookRegistry, HookType, yes_id=labels[1], no_id=labels[0])


def reranker_labels(settings: Settings) -> tuple[int, int] | None:
    """Qwen3-Reranker's "no" and "yes" token ids where this engine serves one (its score head,
    ``label_head.py``), else None."""
    from embedserve.model_info import ModelInfo

    info = ModelInfo.load(settings.model)
    if info.scoring != "qwen3-reranker":
        return None
    from embedserve.core.pairs import label_ids

    return label_ids(info.path)


def pooled_row_slots(settings: Settings) -> int:
    """The pooled last layer's row slots where ``engine.pooled_last_layer`` is on (the launcher has
    checked that the model is a Qwen3 embedding one), else 0: twice the sequences SGLang may batch."""
    from embedserve.engines.sglang import batches_in_engine

    eng = settings.engine
    return 2 * eng.max_running_requests * batches_in_engine(settings) if eng.pooled_last_layer is True else 0
