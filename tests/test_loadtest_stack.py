"""A short real load against the stack started by the tests: the report's request and
token counts must equal what the gateway counted in its own /metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

pytest.importorskip("aiohttp", reason="loadtest needs aiohttp (the loadtest extra)")

from embedserve.loadtest.cli import main
from tests.conftest import TINY_QWEN_MAX_SEQ, RunningStack


def _metric(text: str, name: str, labels: str = "") -> float:
    pat = re.compile(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$", re.MULTILINE)
    m = pat.search(text)
    return float(m.group(1)) if m else 0.0


def _counts(url: str) -> tuple[float, float, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return (_metric(text, "embedserve_requests_total", '{status="200"}'),
            _metric(text, "embedserve_tokens_total"),
            _metric(text, "embedserve_inputs_total"))


@pytest.mark.slow
def test_report_matches_what_the_gateway_counted(qwen_stack: RunningStack, tiny_qwen_dir: Path,
                                                 tmp_path: Path) -> None:
    before = _counts(qwen_stack.url)
    rc = main([qwen_stack.url, "--tokenizer", str(tiny_qwen_dir), "--concurrency", "4",
               "--requests", "60", "--warmup-requests", "5", "--inputs", "1-3",
               "--mix", f"uniform:2-{TINY_QWEN_MAX_SEQ}", "--sample-interval", "0.5",
               "--no-progress", "--out", str(tmp_path), "--max-error-rate", "0"])
    after = _counts(qwen_stack.url)
    res = json.loads((tmp_path / "results.json").read_text())
    tot = res["totals"]
    assert rc == 0, res["error_samples"]
    assert tot["attempts"] == tot["ok"] == 65
    assert after[0] - before[0] == tot["ok"]
    # every input fits the cap, so nothing is truncated: what we built is what was embedded
    assert after[1] - before[1] == tot["tokens_sent"] == tot["usage_prompt_tokens"]
    assert after[2] - before[2] == tot["inputs_ok"]
    assert res["meta"]["model"] == qwen_stack.model_name
    mem = res["memory"]["health_memory"]
    assert mem["status"] == "sampled" and mem["samples"]
    assert mem["fields"]["host_bytes"] == "resources.host.used_bytes"
    assert any(s.get("engine_rss_bytes") for s in mem["samples"])
