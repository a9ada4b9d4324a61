"""Memory-aware rolling restarts on Kubernetes: evict one pod at a time, through the
Eviction API (which respects the PodDisruptionBudget), when its hours to out-of-memory run
low; where the Deployment can run one more pod, surge a replacement first (surge.py). Why
probes alone are not enough, and how to run it: docs/DEPLOY.md.

This module is the command (``embedserve restart-controller``: its flags and the loop of
rounds). ``restart_decision.decide`` is the pure decision; ``restart_observe`` reads the pods;
``kube.KubeApi`` the API calls; ``restart_round.run_once`` wires them, one round at a time,
each step logged and counted (``ControllerMetrics``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import httpx
from prometheus_client import start_http_server

from embedserve.config import Settings, load_settings
from embedserve.controller.kube import KubeApi
from embedserve.controller.restart_decision import policy_from
from embedserve.controller.restart_observe import http_health_fetcher, http_load_fetcher, pod_client
from embedserve.controller.restart_round import ControllerMetrics, run_once
from embedserve.logs import setup_logging

log = logging.getLogger("embedserve.restart_controller")


async def _amain(settings: Settings, once: bool, interval_s: float) -> int:
    cfg = settings.controller
    policy = policy_from(settings)
    api = KubeApi.in_cluster(cfg)
    client = pod_client(cfg)
    fetch, load = http_health_fetcher(cfg, client), http_load_fetcher(cfg, client)
    metrics = ControllerMetrics()
    if cfg.metrics_port is not None:
        start_http_server(cfg.metrics_port, registry=metrics.registry)
    log.info(
        "restart controller: selector=%r threshold=%.2f h surge=%s dry_run=%s",
        cfg.label_selector,
        policy.threshold_hours,
        cfg.surge,
        cfg.dry_run,
    )
    try:
        while True:
            action = "none"
            try:
                action = (await run_once(api, fetch, cfg, policy, load, metrics)).action
            except httpx.HTTPError as exc:
                log.error("round failed: %s", exc)
                if once:
                    return 1
            if once:
                return 0
            # While a surge pod starts, look again soon: it evicts the old pod once ready.
            await asyncio.sleep(cfg.surge_poll_s if action == "surge" else interval_s)
    finally:
        await client.aclose()
        await api.aclose()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="embedserve restart-controller",
        description="Evict one embedserve pod at a time when its hours-to-OOM run low, "
        "surging a replacement first where the Deployment has room.",
    )
    p.add_argument("--once", action="store_true", help="one round, then exit (CronJob)")
    p.add_argument("--interval", type=float, default=60.0, help="seconds between rounds")
    args = p.parse_args(argv)
    settings = load_settings()  # a mistake: one sentence and exit 2, from embedserve's main
    setup_logging(settings.log_level, settings.log_format)
    return asyncio.run(_amain(settings, args.once, args.interval))


if __name__ == "__main__":
    raise SystemExit(main())
