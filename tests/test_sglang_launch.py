"""The launcher: one max-seq-len drives every SGLang size; every flag exists in 0.5.17."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest
from pydantic import ValidationError

from embedserve.config import CHILD_SETTINGS_ENV, Settings, load_settings
from embedserve.contracts.launch import LaunchSpec
from embedserve.engines import sglang as sglang_launch
from embedserve.engines.sglang import (
    LaunchConfigError,
    build_launch,
    default_kv_pool_tokens,
    fa3_installed,
    main,
)
from embedserve.model_info import ModelInfo
from embedserve.nvml import gpu_total_bytes

FLAGS_FIXTURE = Path(__file__).parent / "fixtures" / "sglang_0.5.17_flags.json"
SGLANG_FLAGS = set(json.loads(FLAGS_FIXTURE.read_text())["flags"])


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "m4"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(
        {"model_type": "qwen3", "max_position_embeddings": 32768, "hidden_size": 2560}))
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8192}))
    return d


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for k in list(os.environ):
        if k.startswith("EMBEDSERVE_"):
            monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)  # no stray .env


def make(model_dir: Path, **engine: object) -> Settings:
    model = engine.pop("model", {})
    assert isinstance(model, dict)
    return Settings(model={"path": str(model_dir), **model}, engine=engine)


def arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def flags_of(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("--")]


def test_every_flag_exists_in_pinned_sglang(model_dir: Path) -> None:
    s = make(model_dir, extra_args=[], quantization="fp8", model={"matryoshka_dimensions": [256, 1024]})
    argv = build_launch(s, python="python3").argv
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    unknown = [f for f in flags_of(argv) if f not in SGLANG_FLAGS]
    assert unknown == []
    assert json.loads(FLAGS_FIXTURE.read_text())["sglang"] == sglang_launch.SGLANG_VERSION


def test_fixture_knows_flags_that_do_not_exist() -> None:
    # the design notes: these were never real; the fixture must not contain them
    assert "--flashinfer-max-seq-len" not in SGLANG_FLAGS
    assert "--enable-flashinfer" not in SGLANG_FLAGS
    assert {"--is-embedding", "--skip-tokenizer-init", "--max-total-tokens"} <= SGLANG_FLAGS


def test_embedding_mode_and_attention(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sglang_launch, "gpu_compute_capability", lambda: None)  # no GPU
    argv = build_launch(make(model_dir)).argv
    for f in ("--is-embedding", "--skip-tokenizer-init", "--enable-metrics",
              "--disable-overlap-schedule"):
        assert f in argv
    assert arg(argv, "--attention-backend") == "flashinfer"
    assert arg(argv, "--model-path") == str(model_dir)
    assert arg(argv, "--served-model-name") == "m4"
    assert arg(argv, "--port") == "30000"


@pytest.mark.parametrize(
    ("capability", "fa3", "backend"),
    [((9, 0), True, "fa3"), ((9, 0), False, "flashinfer"), ((8, 0), True, "flashinfer"),
     ((10, 0), True, "flashinfer"), (None, True, "flashinfer")],
)
def test_auto_attention_is_fa3_only_on_hopper_with_its_kernels(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int] | None,
    fa3: bool, backend: str,
) -> None:
    monkeypatch.setattr(sglang_launch, "gpu_compute_capability", lambda: capability)
    spec = build_launch(make(model_dir), fa3=fa3)
    assert arg(spec.argv, "--attention-backend") == backend
    assert any("flash_ops" in n for n in spec.notes) == (capability == (9, 0) and not fa3)


def test_an_explicit_attention_backend_is_passed_through(model_dir: Path) -> None:
    for name in ("flashinfer", "triton", "fa3"):
        spec = build_launch(make(model_dir, attention_backend=name), gpu_capability=(9, 0), fa3=False)
        assert arg(spec.argv, "--attention-backend") == name


def test_fa3_installed_looks_for_flash_ops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "sgl_kernel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not fa3_installed()
    (pkg / "flash_ops.abi3.so").write_bytes(b"")
    assert fa3_installed()


def test_cap_drives_context_prefill_and_pool(model_dir: Path) -> None:
    argv = build_launch(make(model_dir)).argv  # cap from sentence_bert_config: 8192
    assert arg(argv, "--context-length") == "8193"  # SGLang rejects len == context
    assert arg(argv, "--chunked-prefill-size") == "16384"
    assert arg(argv, "--max-prefill-tokens") == "16384"
    assert arg(argv, "--max-total-tokens") == "16384"  # one prefill batch, not 0.8 of the GPU


@pytest.mark.parametrize("cap", [512, 8192, 20000, 32768])
def test_cap_changes_everything_together(model_dir: Path, cap: int) -> None:
    s = make(model_dir, model={"max_seq_len": cap})
    argv = build_launch(s).argv
    assert ModelInfo.load(s.model).max_seq_len == cap  # the gateway truncates to this
    assert int(arg(argv, "--context-length")) == cap + 1
    budget = int(arg(argv, "--chunked-prefill-size"))
    assert budget == max(16384, cap) == int(arg(argv, "--max-prefill-tokens"))
    pool = int(arg(argv, "--max-total-tokens"))
    assert pool >= 2 * cap and pool >= budget
    assert pool == default_kv_pool_tokens(cap, budget)


def test_budget_raised_to_cap_with_note(model_dir: Path) -> None:
    spec = build_launch(make(model_dir, batch_token_budget=4096))
    assert arg(spec.argv, "--chunked-prefill-size") == "8192"
    assert any("batch_token_budget" in n for n in spec.notes)


def test_overlap_schedule_holds_two_batches(model_dir: Path) -> None:
    argv = build_launch(make(model_dir, overlap_schedule=True)).argv
    assert "--disable-overlap-schedule" not in argv
    assert arg(argv, "--max-total-tokens") == "32768"  # the batch on the GPU and the one being built
    assert arg(argv, "--max-running-requests") == "256"
    assert arg(argv, "--max-prefill-tokens") == "16384"  # each batch still within the budget
    explicit = build_launch(make(model_dir, overlap_schedule=True, kv_pool_tokens=20000)).argv
    assert arg(explicit, "--max-total-tokens") == "20000"
    plain = build_launch(make(model_dir)).argv
    assert arg(plain, "--max-running-requests") == "128" and "--disable-overlap-schedule" in plain


def test_explicit_pool_and_too_small_pool(model_dir: Path) -> None:
    argv = build_launch(make(model_dir, kv_pool_tokens=131072)).argv
    assert arg(argv, "--max-total-tokens") == "131072"
    with pytest.raises(LaunchConfigError):
        build_launch(make(model_dir, kv_pool_tokens=8000))


def test_memory_budget_lowers_fraction(model_dir: Path) -> None:
    s = make(model_dir, gpu_memory_budget_gb=25)
    spec = build_launch(s, gpu_bytes=int(143.8e9))
    assert float(arg(spec.argv, "--mem-fraction-static")) == pytest.approx(25 / 143.8, abs=1e-3)
    # no GPU visible: keep the configured fraction and say so
    spec = build_launch(s, gpu_bytes=None)
    if gpu_total_bytes() is None:
        assert arg(spec.argv, "--mem-fraction-static") == "0.85"
        assert any("gpu_memory_budget_gb" in n for n in spec.notes)
    # a budget above the fraction does not raise it
    spec = build_launch(make(model_dir, gpu_memory_budget_gb=140), gpu_bytes=int(143.8e9))
    assert arg(spec.argv, "--mem-fraction-static") == "0.85"


def test_matryoshka_override(model_dir: Path) -> None:
    argv = build_launch(make(model_dir)).argv
    assert "--json-model-override-args" not in argv
    argv = build_launch(make(model_dir, model={"matryoshka_dimensions": [1024, 256, 256]})).argv
    assert json.loads(arg(argv, "--json-model-override-args")) == {
        "matryoshka_dimensions": [256, 1024]}


def test_extra_args_appended_last(model_dir: Path) -> None:
    argv = build_launch(make(model_dir, extra_args=["--random-seed", "7"])).argv
    assert argv[-2:] == ["--random-seed", "7"]


def test_env_allocator_flashinfer_and_plugin_config(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = make(model_dir, flashinfer_cache_dir=str(tmp_path / "fi"), stats_dir="/run/es",
             stats_interval_s=2.0, cache_clear={"every_n_batches": 8, "fragmentation_ratio": None})
    env = build_launch(s).env
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["FLASHINFER_WORKSPACE_BASE"] == str(tmp_path / "fi")
    assert env["TRITON_CACHE_DIR"].startswith(str(tmp_path / "fi"))
    # the scheduler process (our plugin) reads this launch's settings back whole
    monkeypatch.setenv("EMBEDSERVE_ENGINE__STATS_INTERVAL_S", "99")  # the parent's wins over this
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    eng = load_settings().engine
    assert eng.kind == "sglang"
    assert eng.stats_dir == "/run/es"
    assert eng.stats_interval_s == 2.0
    assert eng.cache_clear.every_n_batches == 8
    assert eng.cache_clear.fragmentation_ratio is None
    assert "FLASHINFER_WORKSPACE_BASE" not in build_launch(make(model_dir)).env


def test_dry_run_prints_exact_command(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("EMBEDSERVE_MODEL__PATH", str(model_dir))
    monkeypatch.setenv("EMBEDSERVE_MODEL__MAX_SEQ_LEN", "4096")
    assert main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in out
    cmd = [ln for ln in out.splitlines() if "sglang.launch_server" in ln]
    assert len(cmd) == 1
    argv = shlex.split(cmd[0])
    assert argv == build_launch(Settings()).argv
    assert arg(argv, "--context-length") == "4097"

    assert main(["--dry-run", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["argv"] == argv
    assert json.loads(data["env"][CHILD_SETTINGS_ENV])["engine"]["kind"] == "sglang"


def test_dry_run_reports_bad_config(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("EMBEDSERVE_MODEL__PATH", str(model_dir))
    monkeypatch.setenv("EMBEDSERVE_ENGINE__KV_POOL_TOKENS", "100")
    assert main(["--dry-run"]) == 2
    assert "kv_pool_tokens" in capsys.readouterr().err


def test_run_execs_sglang(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBEDSERVE_MODEL__PATH", str(model_dir))
    seen: dict[str, object] = {}

    def fake_exec(path: str, argv: list[str], env: dict[str, str]) -> None:
        seen.update(path=path, argv=argv, env=env)
        raise SystemExit(0)

    monkeypatch.setattr(sglang_launch.os, "execvpe", fake_exec)
    with pytest.raises(SystemExit):
        main([])
    assert seen["argv"] == build_launch(Settings()).argv
    env = seen["env"]
    assert isinstance(env, dict) and env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PATH" in env  # the parent's environment is kept


def test_prefix_cache_is_off_unless_asked_for(model_dir: Path) -> None:
    assert "--disable-radix-cache" in build_launch(make(model_dir)).argv
    assert "--disable-radix-cache" not in build_launch(make(model_dir, prefix_cache=True)).argv


def test_fp8_maps_to_sglangs_quantization_flag(model_dir: Path) -> None:
    assert "--quantization" not in build_launch(make(model_dir)).argv
    argv = build_launch(make(model_dir, quantization="fp8")).argv
    assert arg(argv, "--quantization") == "fp8"


def test_an_unknown_quantization_is_a_config_error(model_dir: Path) -> None:
    with pytest.raises(ValidationError, match="quantization"):
        make(model_dir, quantization="int3")


def test_compute_capability_from_nvml_none_without_a_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    from embedserve import nvml

    class FakeNvml:
        @staticmethod
        def nvmlDeviceGetHandleByIndex(index: int) -> int:
            return index

        @staticmethod
        def nvmlDeviceGetCudaComputeCapability(handle: int) -> tuple[int, int]:
            return (9, 0) if handle == 0 else (8, 6)

        @staticmethod
        def nvmlShutdown() -> None:
            pass

    monkeypatch.setattr(nvml, "open_nvml", lambda: FakeNvml)
    assert nvml.gpu_compute_capability() == (9, 0)
    assert nvml.gpu_compute_capability(1) == (8, 6)

    def no_driver() -> None:
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr(nvml, "open_nvml", no_driver)
    assert nvml.gpu_compute_capability() is None


def test_no_kv_cache_is_one_forward_per_request_with_sglangs_flag(model_dir: Path) -> None:
    argv = build_launch(make(model_dir, kv_cache="none"), gpu_capability=(9, 0), fa3=True).argv
    assert arg(argv, "--attention-backend") == "fa3"
    assert arg(argv, "--chunked-prefill-size") == "-1"  # SGLang's fa_skip_kv_cache path needs it
    assert {"--prefill-only-disable-kv-cache", "--disable-radix-cache"} <= set(argv)
    assert [f for f in flags_of(argv) if f not in SGLANG_FLAGS] == []
    assert arg(argv, "--max-prefill-tokens") == "16384"  # the batch budget still bounds a batch
    assert arg(argv, "--cuda-graph-max-bs-prefill") == "4096"  # graphs sized, not by -1 (the 4B's width)
    paged = build_launch(make(model_dir, kv_cache="paged"), gpu_capability=(9, 0), fa3=True).argv
    assert "--prefill-only-disable-kv-cache" not in paged and arg(paged, "--chunked-prefill-size") == "16384"
    assert "--cuda-graph-max-bs-prefill" not in paged  # SGLang's own sizing from the chunk


@pytest.mark.parametrize(("hidden", "engine", "graphs"), [
    (2560, {}, "4096"),  # the 4B and wider: larger batches unpadded, without a graph
    (4096, {"batch_token_budget": 2048, "model": {"max_seq_len": 2048}}, "2048"),  # never over the budget
    (1024, {}, "16384"),  # the 0.6B: every batch a graph, up to the budget
    (2048, {}, "16384"),  # just under the 4B's width
    (1024, {"prefill_graph_tokens": 1024}, "1024"),  # a number is passed as is
])
def test_prefill_graphs_are_capped_by_the_models_width_with_the_embedding_only_forward(
        model_dir: Path, hidden: int, engine: dict[str, object], graphs: str) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "hidden_size": hidden}))
    spec = build_launch(make(model_dir, **engine), gpu_capability=(9, 0), fa3=True)
    assert arg(spec.argv, "--cuda-graph-max-bs-prefill") == graphs
    assert [f for f in flags_of(spec.argv) if f not in SGLANG_FLAGS] == []
    said = [n for n in spec.notes if n.startswith("prefill_graph_tokens")]
    assert len(said) == 1 and f": {graphs}" in said[0]  # the value launched, and why
    assert ("as asked" in said[0]) == ("prefill_graph_tokens" in engine)
    paged = build_launch(make(model_dir, kv_cache="paged", prefill_graph_tokens=512), gpu_capability=(9, 0),
                         fa3=True).argv
    assert arg(paged, "--cuda-graph-max-bs-prefill") == "512"  # a number on the paged path too
    with pytest.raises(LaunchConfigError, match=r"prefill_graph_tokens=32768 is over .* 16384 tokens"):
        build_launch(make(model_dir, prefill_graph_tokens=32768), gpu_capability=(9, 0), fa3=True)


@pytest.mark.parametrize(("engine", "why"), [
    ({"attention_backend": "flashinfer"}, "attention backend 'flashinfer' is not fa3 or fa4"),
    ({"attention_backend": "fa3", "prefix_cache": True}, "engine.prefix_cache is on"),
])
def test_no_kv_cache_only_where_sglang_allows_it(
    model_dir: Path, engine: dict[str, object], why: str
) -> None:
    with pytest.raises(LaunchConfigError, match=why):
        build_launch(make(model_dir, kv_cache="none", **engine))
    spec = build_launch(make(model_dir, kv_cache="auto", **engine))
    assert "--prefill-only-disable-kv-cache" not in spec.argv
    assert any(why in note for note in spec.notes)
    auto = build_launch(make(model_dir, kv_cache="auto", attention_backend="fa3"), gpu_capability=(9, 0)).argv
    assert "--prefill-only-disable-kv-cache" in auto


def test_the_pooled_last_layer_is_for_last_token_qwen3_models_without_compiled_prefill_graphs(
    model_dir: Path, tmp_path: Path
) -> None:
    spec = build_launch(make(model_dir, pooled_last_layer=True))
    assert spec.argv == build_launch(make(model_dir)).argv  # the plugin does it: SGLang's flags as they are
    with pytest.raises(LaunchConfigError, match="does not go with SGLang's tc_piecewise"):
        build_launch(make(model_dir, pooled_last_layer=True,
                          extra_args=["--cuda-graph-backend-prefill", "tc_piecewise"]))
    reranker = tmp_path / "rr"
    reranker.mkdir()
    (reranker / "config.json").write_text(json.dumps(
        {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
         "max_position_embeddings": 4096}))
    build_launch(make(reranker, pooled_last_layer=True))  # Qwen3-Reranker pools its last token too
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64,
                                                  "max_position_embeddings": 512}))
    with pytest.raises(LaunchConfigError, match="is not a Qwen3 model"):
        build_launch(make(bert, pooled_last_layer=True))


def test_the_vectorised_cross_encoder_is_for_xlmr_cross_encoders_without_the_prefix_cache(
    model_dir: Path, tmp_path: Path
) -> None:
    from embedserve.runtime.synth_rerank import build_cross_encoder

    xlmr = build_cross_encoder(tmp_path / "xlmr", "tiny-xlmr")
    spec = build_launch(make(xlmr, vectorised_cross_encoder=True))
    assert spec.argv == build_launch(make(xlmr)).argv  # the plugin does it: SGLang's flags as they are
    assert launched_engine(spec)["vectorised_cross_encoder"] is True
    with pytest.raises(LaunchConfigError, match="needs engine\\.prefix_cache off"):
        build_launch(make(xlmr, vectorised_cross_encoder=True, prefix_cache=True))
    with pytest.raises(LaunchConfigError, match="needs an XLM-R cross-encoder"):
        build_launch(make(model_dir, vectorised_cross_encoder=True))


# -- the embedding-only forward as the default: each auto value resolved, with its reason -----------

#: what the embedding-only forward's three settings set explicitly (bench variant nokv+overlap+pooled)
EMBEDDING_ONLY = {"kv_cache": "none", "overlap_schedule": True, "pooled_last_layer": True}
#: the former defaults (bench variant paged)
PAGED = {"kv_cache": "paged", "overlap_schedule": False, "pooled_last_layer": False}


def launched_engine(spec: LaunchSpec) -> dict[str, object]:
    """The engine settings the plugin reads in the scheduler process."""
    return dict(json.loads(spec.env[CHILD_SETTINGS_ENV])["engine"])


def test_the_embedding_only_forward_is_the_default_for_a_qwen3_embedding_model_on_hopper(
    model_dir: Path,
) -> None:
    from embedserve.engines.sglang_plugin import pooled_row_slots

    spec = build_launch(make(model_dir), gpu_capability=(9, 0), fa3=True)
    explicit = build_launch(make(model_dir, **EMBEDDING_ONLY), gpu_capability=(9, 0), fa3=True)
    assert spec.argv == explicit.argv
    assert "--prefill-only-disable-kv-cache" in spec.argv and "--disable-overlap-schedule" not in spec.argv
    assert arg(spec.argv, "--max-running-requests") == "256"  # two batches in the engine
    assert arg(spec.argv, "--attention-backend") == "fa3"
    engine = launched_engine(spec)
    assert {k: engine[k] for k in EMBEDDING_ONLY} == EMBEDDING_ONLY
    assert engine["attention_backend"] == "fa3"
    # the plugin, reading the launch's settings, hooks the last layer with room for both batches
    assert pooled_row_slots(Settings.model_validate_json(spec.env[CHILD_SETTINGS_ENV])) == 512
    said = {n.split(":", 1)[0]: n for n in spec.notes}
    assert said.keys() >= {"attention_backend auto", "kv_cache auto", "overlap_schedule auto",
                           "pooled_last_layer auto"}
    assert "auto: none (no KV pool), because the GPU has compute capability 9.0" in said["kv_cache auto"]
    assert "auto: on" in said["overlap_schedule auto"] and "auto: on" in said["pooled_last_layer auto"]
    assert not [n for n in explicit.notes if n.startswith(("kv_cache", "overlap", "pooled"))]


def qwen3_reranker(tmp_path: Path) -> Path:
    d = tmp_path / "rr"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(
        {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
         "max_position_embeddings": 4096}))
    return d


def cross_encoder(tmp_path: Path) -> Path:
    d = tmp_path / "ce"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(
        {"model_type": "xlm-roberta", "architectures": ["XLMRobertaForSequenceClassification"],
         "hidden_size": 64, "max_position_embeddings": 514, "type_vocab_size": 1,
         "position_embedding_type": "absolute", "num_labels": 1}))
    return d


@pytest.mark.parametrize(("case", "engine", "capability", "why"), [
    ("prefix cache on", {"prefix_cache": True}, (9, 0), "engine.prefix_cache is on"),
    ("FlashInfer asked for", {"attention_backend": "flashinfer"}, (9, 0),
     "attention backend 'flashinfer' is not fa3 or fa4"),
    ("Ampere", {}, (8, 0), "attention backend 'flashinfer' is not fa3 or fa4"),
    ("FA3 asked for off Hopper", {"attention_backend": "fa3"}, (8, 9),
     "the GPU has compute capability 8.9, not 9.x (measured on Hopper only)"),
    ("Blackwell with FA4", {"attention_backend": "fa4"}, (10, 0),
     "the GPU has compute capability 10.0, not 9.x"),
    ("no GPU", {"attention_backend": "fa3"}, None, "no GPU was found (NVML), not 9.x"),
    ("FP8", {"quantization": "fp8"}, (9, 0), "engine.quantization is fp8"),
    ("cross-encoder", {"model": "cross-encoder"}, (9, 0),
     "ce is not a Qwen3 embedding model or Qwen3-Reranker"),
])
def test_the_paged_forward_stays_where_the_embedding_only_one_was_not_measured_or_cannot_run(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str,
    engine: dict[str, object], capability: tuple[int, int] | None, why: str,
) -> None:
    monkeypatch.setattr(sglang_launch, "gpu_compute_capability", lambda: capability)
    folder = {"reranker": qwen3_reranker, "cross-encoder": cross_encoder}.get(str(engine.pop("model", "")))
    path = folder(tmp_path) if folder else model_dir
    spec = build_launch(make(path, **engine), fa3=True)
    assert spec.argv == build_launch(make(path, **engine, **PAGED), fa3=True).argv, case
    assert "--disable-overlap-schedule" in spec.argv and "--prefill-only-disable-kv-cache" not in spec.argv
    assert {k: launched_engine(spec)[k] for k in PAGED} == PAGED
    assert f"kv_cache auto: paged, because {why}" in "\n".join(spec.notes)
    assert any(n.startswith("overlap_schedule auto: off, because kv_cache is paged") for n in spec.notes)
    assert any(n.startswith("pooled_last_layer auto: off, because") for n in spec.notes)


def test_qwen3_reranker_gets_the_embedding_only_forward_on_hopper(tmp_path: Path) -> None:
    """Its score head reads the last token as Qwen3-Embedding's pooler does (label_head.py)."""
    spec = build_launch(make(qwen3_reranker(tmp_path)), gpu_capability=(9, 0), fa3=True)
    assert "--prefill-only-disable-kv-cache" in spec.argv and "--disable-overlap-schedule" not in spec.argv
    assert "--is-embedding" in spec.argv
    assert launched_engine(spec)["pooled_last_layer"] is True
    assert any(n.startswith("kv_cache auto: none (no KV pool)") for n in spec.notes)


def test_the_pooled_last_layer_stays_off_by_itself_beside_compiled_prefill_graphs(model_dir: Path) -> None:
    tc = ["--cuda-graph-backend-prefill", "tc_piecewise"]
    spec = build_launch(make(model_dir, extra_args=tc), gpu_capability=(9, 0), fa3=True)
    assert "--prefill-only-disable-kv-cache" in spec.argv and "--disable-overlap-schedule" not in spec.argv
    assert launched_engine(spec)["pooled_last_layer"] is False
    assert "pooled_last_layer auto: off, because engine.extra_args asks for tc_piecewise prefill graphs" \
        in spec.notes
    with pytest.raises(LaunchConfigError, match="does not go with SGLang's tc_piecewise"):
        build_launch(make(model_dir, extra_args=tc, pooled_last_layer=True), gpu_capability=(9, 0), fa3=True)


def test_the_dry_run_says_each_auto_value_and_why(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sglang_launch, "gpu_compute_capability", lambda: (9, 0))
    monkeypatch.setattr(sglang_launch, "fa3_installed", lambda: True)
    monkeypatch.setenv("EMBEDSERVE_MODEL__PATH", str(model_dir))
    assert main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for line in ("# note: attention_backend auto: fa3, because the GPU has compute capability 9.0",
                 "# note: kv_cache auto: none (no KV pool)", "# note: overlap_schedule auto: on",
                 "# note: pooled_last_layer auto: on"):
        assert line in out


def test_compiled_prefill_graphs_keep_every_batch_a_graph_and_sglangs_query_copy(model_dir: Path) -> None:
    spec = build_launch(make(model_dir, extra_args=["--cuda-graph-backend-prefill", "tc_piecewise"]),
                        gpu_capability=(9, 0), fa3=True)
    assert "--prefill-only-disable-kv-cache" in spec.argv  # still the embedding-only forward
    assert spec.argv.count("--cuda-graph-max-bs-prefill") == 1
    assert arg(spec.argv, "--cuda-graph-max-bs-prefill") == "16384"  # the budget, as before the cap
    engine = launched_engine(spec)
    assert engine["strided_query"] is False and engine["pooled_last_layer"] is False
    assert [n for n in spec.notes if n.startswith("strided_query auto: off") and "tc_piecewise" in n]
