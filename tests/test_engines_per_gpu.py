"""Several SGLang engines on one GPU: the memory arithmetic, the launcher's command lines,
routing across them, and replacement when they share a GPU. No GPU needed: the GPU's size is
passed in, and engines are fakes."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from embedserve.config import Settings
from embedserve.contracts.memory import GpuDevice, MemoryReport, ProcessMemory
from embedserve.engines import sglang as sglang_launch
from embedserve.engines.launch import engine_launch
from embedserve.engines.sizing import ModelShape, SizingError, engine_memory, plan_engines_per_gpu
from embedserve.health.sources.nvml import GpuReading
from embedserve.model_info import ModelInfo
from embedserve.runtime import replace
from embedserve.runtime.model_plan import resolve_engines_per_gpu
from embedserve.upstream.pool import EnginePool

# The published Qwen3-Embedding configs (config.json), the fields that decide memory.
QWEN3_4B = {"model_type": "qwen3", "hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9728, "vocab_size": 151665,
            "max_position_embeddings": 40960}
QWEN3_06B = {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151669,
             "max_position_embeddings": 32768}
H200 = 150_754_820_096  # NVML's total for one H200
CARD_24GB = 25_757_220_864  # an RTX 4090's


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for k in list(os.environ):
        if k.startswith("EMBEDSERVE_") or k == "CUDA_VISIBLE_DEVICES":
            monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)


def checkpoint(tmp_path: Path, config: dict[str, object], name: str = "m") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8192}))
    return d


def plan(config: dict[str, object], requested: int | None, gpu: int | None, quantization: str = "none"):
    return plan_engines_per_gpu(requested, ModelShape.from_config(config), kv_pool_tokens=16384,
                                batch_tokens=16384, quantization=quantization, gpu_total_bytes=gpu,
                                mem_fraction_static=0.85)


# -- the arithmetic --------------------------------------------------------------------------


def test_parameter_counts_match_the_published_models() -> None:
    assert ModelShape.from_config(QWEN3_4B).linear_params == pytest.approx(3.63e9, rel=0.01)
    assert ModelShape.from_config(QWEN3_06B).linear_params == pytest.approx(0.44e9, rel=0.01)
    assert ModelShape.from_config(QWEN3_4B).kv_bytes_per_token == 36 * 8 * 128 * 2 * 2


@pytest.mark.parametrize(("config", "quantization", "tokens", "measured_gb"), [
    (QWEN3_4B, "none", 16384, 14.48), (QWEN3_4B, "fp8", 16384, 10.98), (QWEN3_06B, "none", 16384, 5.81),
    (QWEN3_06B, "none", 32768, 8.71)])
def test_engine_memory_covers_what_one_h200_measured_and_little_more(
    config: dict[str, object], quantization: str, tokens: int, measured_gb: float
) -> None:
    """NVML per engine, results/gpu-engines-per-gpu/: never under, at most 8% over."""
    need = engine_memory(ModelShape.from_config(config), tokens, tokens, quantization)
    assert measured_gb <= need.total / 1e9 <= 1.08 * measured_gb


def test_fp8_halves_only_the_linear_layers() -> None:
    shape = ModelShape.from_config(QWEN3_4B)
    assert shape.weight_bytes("none") - shape.weight_bytes("fp8") == shape.linear_params


# -- how many engines -------------------------------------------------------------------------


def test_auto_gives_small_models_more_engines_than_large_ones() -> None:
    assert plan(QWEN3_06B, None, H200).per_gpu == 2
    assert plan(QWEN3_4B, None, H200).per_gpu == 1


def test_auto_lowers_to_what_fits_and_says_why() -> None:
    small_gpu = 8_000_000_000  # 6.8 GB usable: one 0.6B engine (5.5 GB), not two
    p = plan(QWEN3_06B, None, small_gpu)
    assert p.per_gpu == 1
    assert len(p.notes) == 1 and "engines_per_gpu: 1, not 2" in p.notes[0] and "GB" in p.notes[0]


def test_explicit_number_that_fits_is_kept() -> None:
    p = plan(QWEN3_4B, 4, H200)
    assert p.per_gpu == 4 and not p.notes
    assert p.usable_bytes is not None and p.engine is not None and 4 * p.engine.total <= p.usable_bytes


def test_explicit_number_that_does_not_fit_is_a_config_error() -> None:
    with pytest.raises(SizingError) as err:
        plan(QWEN3_4B, 2, CARD_24GB)  # 2 x 13.9 GB > 0.85 x 25.8 GB
    message = str(err.value)
    assert "EMBEDSERVE_ENGINE__ENGINES_PER_GPU=2" in message and "set it to 1" in message


def test_the_4b_default_fits_a_24gb_card() -> None:
    p = plan(QWEN3_4B, None, CARD_24GB)
    assert p.per_gpu == 1 and p.engine is not None and p.engine.total < 0.85 * CARD_24GB


def test_one_engine_as_asked_is_left_to_sglang() -> None:
    assert plan(QWEN3_4B, 1, 8_000_000_000).per_gpu == 1  # too small by our sums: SGLang decides


def test_no_gpu_or_no_shape_checks_nothing() -> None:
    assert plan(QWEN3_4B, 3, None).per_gpu == 3
    assert plan_engines_per_gpu(None, None, kv_pool_tokens=1, batch_tokens=1, quantization="none",
                                gpu_total_bytes=H200, mem_fraction_static=0.85).per_gpu == 1


@pytest.mark.parametrize("bad", [0, -1, "two", 1.5])
def test_bad_values_are_refused_by_the_settings(bad: object) -> None:
    with pytest.raises(ValidationError):
        Settings(engine={"engines_per_gpu": bad})


def test_env_takes_a_number_or_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBEDSERVE_ENGINE__ENGINES_PER_GPU", "3")
    assert Settings().engine.engines_per_gpu == 3
    monkeypatch.setenv("EMBEDSERVE_ENGINE__ENGINES_PER_GPU", "auto")
    assert Settings().engine.engines_per_gpu == "auto"


def test_stack_resolves_the_number_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = checkpoint(tmp_path, QWEN3_06B)
    settings = Settings(model={"path": str(folder)})
    info = ModelInfo.load(settings.model)
    monkeypatch.setattr(sglang_launch, "gpu_total_bytes", lambda index=None: H200)
    assert resolve_engines_per_gpu(settings, info, "sglang").engine.engines_per_gpu == 2
    assert resolve_engines_per_gpu(settings, info, "cpu").engine.engines_per_gpu == 1
    too_many = settings.with_engine(engines_per_gpu=40)
    with pytest.raises(sglang_launch.LaunchConfigError, match="ENGINES_PER_GPU=40"):
        resolve_engines_per_gpu(too_many, info, "sglang")


# -- command lines ----------------------------------------------------------------------------


def test_n_engines_per_gpu_get_their_own_ports_and_share_a_gpu(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path, QWEN3_06B)
    settings = Settings(model={"path": str(folder)}, engine={"replicas": 2, "engines_per_gpu": 2})
    assert settings.engine_urls() == [f"http://127.0.0.1:{30000 + i}" for i in range(4)]
    assert settings.engine_gpus() == [0, 0, 1, 1]
    specs = [engine_launch(settings, "sglang", i) for i in range(4)]
    ports = [s.argv[s.argv.index("--port") + 1] for s in specs]
    assert ports == ["30000", "30001", "30002", "30003"]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "0", "1", "1"]
    # each engine is a single engine to itself: its own settings say one
    child = Settings.model_validate_json(specs[3].env["EMBEDSERVE_SETTINGS_JSON"])
    assert child.engine.port == 30003 and child.local_engine_count() == 1


def test_visible_devices_of_the_parent_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    folder = checkpoint(tmp_path, QWEN3_06B)
    settings = Settings(model={"path": str(folder)}, engine={"replicas": 2, "engines_per_gpu": 3})
    assert [engine_launch(settings, "sglang", i).env["CUDA_VISIBLE_DEVICES"] for i in range(6)] == \
        ["4", "4", "4", "6", "6", "6"]


def test_one_gpu_leaves_cuda_visible_devices_alone(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path, QWEN3_06B)
    settings = Settings(model={"path": str(folder)}, engine={"engines_per_gpu": 2})
    assert all("CUDA_VISIBLE_DEVICES" not in engine_launch(settings, "sglang", i).env for i in range(2))


# -- routing ------------------------------------------------------------------------------------


class SlowEngines:
    """Engines that take a while to answer, so calls overlap; records where each call went."""

    def __init__(self) -> None:
        self.posted_urls: list[str] = []

    async def post_json(self, url: str, body: bytes) -> tuple[int, bytes]:
        self.posted_urls.append(url)
        n = len(json.loads(body)["input"])
        await asyncio.sleep(0.05)
        data = [{"object": "embedding", "index": i, "embedding": [1.0, 0.0]} for i in range(n)]
        return 200, json.dumps({"object": "list", "data": data, "model": "m"}).encode()

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        return 200, b""

    async def aclose(self) -> None:
        return None


def test_pool_spreads_calls_over_engines_sharing_a_gpu_and_reports_each_gpu() -> None:
    async def go() -> tuple[list[str], list[int | None]]:
        client = SlowEngines()
        urls = [f"http://e{i}" for i in range(4)]
        pool = EnginePool(urls, "m", request_timeout_s=5, client=client, gpus=[0, 0, 1, 1],
                          base64_vectors=False)
        for e in pool.engines:
            e.ready = True
        await asyncio.gather(*(pool.embed([[1] * 10]) for _ in range(8)))
        return client.posted_urls, [s.gpu for s in pool.statuses()]

    posted, gpus = asyncio.run(go())
    assert sorted({u.split("/v1")[0] for u in posted}) == [f"http://e{i}" for i in range(4)]
    assert all(posted.count(f"http://e{i}/v1/embeddings") == 2 for i in range(4))
    assert gpus == [0, 0, 1, 1]


# -- replacement on a shared GPU -------------------------------------------------------------------


def report_binding(resource: str) -> MemoryReport:
    return MemoryReport(status="warning", recommends_restart=True, binding_resource=resource,
                        estimated_hours_until_oom=0.5, hours_lower=None, hours_upper=None, reason="test")


def test_replacement_picks_the_engine_holding_most_of_the_gpu_that_runs_out(tmp_path: Path) -> None:
    settings = Settings(engine={"replicas": 2, "engines_per_gpu": 2},
                        health={"replace_min_age_s": 0, "replace_cooldown_s": 0})
    rss = [1, 1, 1, 1]
    ages = [1000.0] * 4
    held = [9, 20, 30, 5]  # GPU 1 holds engines 2 and 3
    d = replace.due(report_binding("gpu:1"), settings, rss, ages, 1e9, held)
    assert d is not None and d.index == 2
    d = replace.due(report_binding("gpu:0"), settings, rss, ages, 1e9, held)
    assert d is not None and d.index == 1


def test_replacement_port_comes_after_every_local_engine() -> None:
    settings = Settings(engine={"replicas": 1, "engines_per_gpu": 3})
    assert settings.local_engine_count() == 3
    replacer = replace.EngineReplacer(settings, EnginePool([], "m", request_timeout_s=1), [],
                                      lambda i, p: None, None, None, None, None)  # type: ignore[arg-type, return-value]
    replacer.count = 1
    assert replacer._spare_port() == 30004


def test_the_replacers_readings_run_in_a_thread_not_on_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The /proc walk and NVML block: the replacer reads them off the gateway's loop."""
    read_on: list[threading.Thread] = []

    def processes(named: dict[str, int]) -> tuple[dict[str, ProcessMemory], dict[str, str]]:
        read_on.append(threading.current_thread())
        return {n: ProcessMemory(name=n, pid=p, rss_bytes=1, own_rss_bytes=1, pids=[p])
                for n, p in named.items()}, {}

    class Nvml:
        def read(self) -> GpuReading:
            read_on.append(threading.current_thread())
            return GpuReading(True, devices=[GpuDevice(index=0, name="gpu", total_bytes=100, used_bytes=50,
                                                       free_bytes=50, processes={11: 10, 12: 30})])

    monkeypatch.setattr(replace, "read_processes", processes)
    monkeypatch.setattr(replace, "NvmlSource", Nvml)
    settings = Settings(engine={"replicas": 1, "engines_per_gpu": 2},
                        health={"replace_min_age_s": 0, "replace_cooldown_s": 0})
    supervisors: list[Any] = [SimpleNamespace(name=f"sglang-{i}", pid=11 + i) for i in range(2)]
    replacer = replace.EngineReplacer(settings, EnginePool([], "m", request_timeout_s=1), supervisors,
                                      lambda i, p: None, None, None, None, None)  # type: ignore[arg-type, return-value]

    async def check() -> tuple[replace.Due | None, threading.Thread]:
        found: Any = replacer.check(report_binding("gpu:0"))
        return (await found) if inspect.isawaitable(found) else found, threading.current_thread()

    d, loop_thread = asyncio.run(check())
    assert d is not None and d.index == 1  # the engine holding most of GPU 0
    assert read_on and loop_thread not in read_on


# -- embedserve's own engine on a GPU (engine.kind torch) -----------------------------------------


def test_torch_engines_run_the_own_engine_each_on_its_gpu(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path, QWEN3_06B)
    settings = Settings(model={"path": str(folder)}, engine={"replicas": 2, "engines_per_gpu": 2})
    specs = [engine_launch(settings, "torch", i) for i in range(4)]
    assert all(s.argv[1:3] == ["-m", "embedserve.engines.cpu"] for s in specs)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "0", "1", "1"]
    child = Settings.model_validate_json(specs[3].env["EMBEDSERVE_SETTINGS_JSON"])
    assert child.engine.kind == "torch" and child.engine.port == 30003
    # the CPU engine is told nothing about GPUs
    assert "CUDA_VISIBLE_DEVICES" not in engine_launch(settings, "cpu", 3).env


def test_torch_engines_per_gpu_are_as_asked_and_auto_is_two(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path, QWEN3_06B)
    settings = Settings(model={"path": str(folder)})
    info = ModelInfo.load(settings.model)
    assert resolve_engines_per_gpu(settings, info, "torch").engine.engines_per_gpu == 2
    one = settings.with_engine(engines_per_gpu=1)
    assert resolve_engines_per_gpu(one, info, "torch").engine.engines_per_gpu == 1
    three = settings.with_engine(engines_per_gpu=3)
    assert resolve_engines_per_gpu(three, info, "torch").engine.engines_per_gpu == 3
    assert resolve_engines_per_gpu(three, info, "cpu").engine.engines_per_gpu == 1


def test_the_torch_engine_runs_on_the_gpu_in_bfloat16_unless_told() -> None:
    import torch

    from embedserve.engines.cpu_backends import torch_device

    assert torch_device(Settings(engine={"kind": "torch"})) == ("cuda", torch.bfloat16)
    assert torch_device(Settings(engine={"kind": "torch", "dtype": "float32"})) == ("cuda", torch.float32)
    assert torch_device(Settings(engine={"kind": "cpu"})) == ("cpu", torch.float32)


def test_the_torch_engine_on_a_gpu_attends_without_cudnn_plans_per_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from embedserve.engines.cpu_backends import torch_device

    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", lambda on: calls.append(on))
    calls: list[bool] = []
    torch_device(Settings(engine={"kind": "cpu"}))
    assert calls == []  # the CPU's attention has no cuDNN backend to turn off
    torch_device(Settings(engine={"kind": "torch"}))
    assert calls == [False]


@pytest.mark.parametrize("kind", ["sglang", "torch"])
def test_a_gpu_engine_kind_without_a_gpu_is_one_sentence(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from embedserve.runtime import preflight
    from embedserve.settings_errors import ConfigError

    monkeypatch.setattr(preflight, "gpu_count", lambda: 0)
    monkeypatch.setattr(preflight.importlib.util, "find_spec", lambda name: object())
    with pytest.raises(ConfigError, match=f"is '{kind}', but no NVIDIA GPU is visible"):
        preflight.check_engine_kind(Settings(engine={"kind": kind}), kind)


def test_auto_serves_a_cross_encoder_on_a_gpu_with_the_torch_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from embedserve.runtime import model_plan

    embedder = ModelInfo.load(Settings(model={"path": str(checkpoint(tmp_path, QWEN3_06B))}).model)
    reranker = embedder.__class__(**{**embedder.__dict__, "scoring": "cross-encoder"})
    monkeypatch.setattr(model_plan.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(model_plan, "gpu_count", lambda: 1)
    auto = Settings()
    assert model_plan.resolve_engine_kind(auto, reranker) == "torch"
    qwen3 = embedder.__class__(**{**embedder.__dict__, "scoring": "qwen3-reranker"})
    assert model_plan.resolve_engine_kind(auto, qwen3) == "sglang"
    assert model_plan.resolve_engine_kind(auto, embedder) == "sglang"
    assert model_plan.resolve_engine_kind(auto) == "sglang"
    assert model_plan.resolve_engine_kind(Settings(engine={"kind": "sglang"}), reranker) == "sglang"
    monkeypatch.setattr(model_plan, "gpu_count", lambda: 0)
    assert model_plan.resolve_engine_kind(auto, reranker) == "cpu"
