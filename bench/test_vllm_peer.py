"""The vLLM peer's command lines and what it reads from vLLM's log, checked without vLLM:
`python3 -m pytest bench/test_vllm_peer.py`."""

from __future__ import annotations

import json
from pathlib import Path

import vllm_peer
from procs import WorkDir
from stacks import Host


def host_with_model(tmp_path: Path) -> Host:
    model = tmp_path / "models" / "4b"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"hidden_size": 2560, "num_attention_heads": 32,
                                                   "num_hidden_layers": 36, "num_key_value_heads": 8,
                                                   "head_dim": 128}))
    return Host(WorkDir(tmp_path / "work"), models={"4b": str(model)})


def test_vllm_gets_the_same_kv_pool_and_the_tuned_side_the_batch_budget(tmp_path: Path) -> None:
    host = host_with_model(tmp_path)
    assert vllm_peer.kv_pool_bytes(host.model("4b"), 16_384) == 16_384 * 2 * 36 * 8 * 128 * 2
    plain = vllm_peer.vllm_argv(host, "4b", 8720, tuned=False)
    assert plain[plain.index("serve") + 1] == host.model("4b")
    assert plain[plain.index("--runner") + 1] == "pooling"
    assert plain[plain.index("--max-model-len") + 1] == "8192"
    assert plain[plain.index("--served-model-name") + 1] == "4b" and "--api-server-count" not in plain
    assert plain[plain.index("--kv-cache-memory-bytes") + 1] == str(2_415_919_104)
    assert "--no-enable-chunked-prefill" in plain
    tuned = vllm_peer.vllm_argv(host, "4b", 8721, tuned=True)
    assert tuned[tuned.index("--max-num-batched-tokens") + 1] == "16384"
    assert int(tuned[tuned.index("--api-server-count") + 1]) > 1
    larger_pool = Host(host.work, models=host.models, vllm_kv_tokens=65_536)
    bigger = vllm_peer.vllm_argv(larger_pool, "4b", 1, tuned=False)
    assert bigger[bigger.index("--kv-cache-memory-bytes") + 1] == str(4 * 2_415_919_104)
    stub = vllm_peer.vllm_argv(Host(host.work, models=host.models, vllm_cmd=("python3", "stub.py")),
                               "4b", 1, tuned=False)
    assert stub[:3] == ["python3", "stub.py", "serve"]


def test_the_attention_backend_and_cuda_graph_mode_come_from_the_log(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text(
        "(EngineCore pid=1) INFO [core.py:117] Initializing a V1 LLM engine (v0.26.0) with config: "
        "model='/m', compilation_config={'mode': <CompilationMode.VLLM_COMPILE: 3>, "
        "'cudagraph_mode': <CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>}\n"
        "(EngineCore pid=1) WARNING [vllm.py:1344] Pooling models do not support full cudagraphs. "
        "Overriding cudagraph_mode to PIECEWISE.\n"
        "(EngineCore pid=1) INFO [cuda.py:483] Using FLASH_ATTN attention backend out of potential "
        "backends: ['FLASH_ATTN', 'FLASHINFER'].\nunrelated line\n")
    facts = vllm_peer.vllm_log_facts(log)
    assert facts["attention_backend"] == "FLASH_ATTN" and facts["cudagraph_mode"] == "PIECEWISE"
    assert len(facts["log_lines"]) == 3
    log.write_text("compilation_config={'cudagraph_mode': <CUDAGraphMode.NONE: 0>}\n")
    assert vllm_peer.vllm_log_facts(log)["cudagraph_mode"] == "NONE"


def test_variants_join_their_settings_and_sglang_flags(tmp_path: Path) -> None:
    env = vllm_peer.variant_env("x2+graphs+tokenizer-workers")
    assert env["EMBEDSERVE_ENGINE__ENGINES_PER_GPU"] == "2"
    assert json.loads(env["EMBEDSERVE_ENGINE__EXTRA_ARGS"]) == [*vllm_peer.TC_PIECEWISE,
                                                                 "--tokenizer-worker-num", "2"]
    try:
        vllm_peer.variant_env("x2+turbo")
    except ValueError as exc:
        assert "turbo" in str(exc)
    else:
        raise AssertionError("an unknown variant must be refused")


def test_every_side_of_every_shape_has_its_own_ports(tmp_path: Path) -> None:
    host = Host(WorkDir(tmp_path / "work"), embedserve_variants=("graphs", "x1", "x3"))
    ports = {shape: vllm_peer.side_ports(host, shape) for shape in vllm_peer.SHAPES}
    assert list(ports["0.6b"]) == ["embedserve", "embedserve graphs", "embedserve x1", "embedserve x3",
                                   "vllm", "vllm tuned"]
    taken: list[int] = []
    for shape, sides in ports.items():
        for side, port in sides.items():  # a gateway and its engines (port + 22000, + 1, ...)
            own = [port] if vllm_peer.is_vllm(side) else \
                [port, *range(port + 22000, port + 22000 + vllm_peer.MAX_ENGINES_PER_SIDE)]
            assert not set(own) & set(taken), (shape, side)
            taken += own
