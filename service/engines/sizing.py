"""How many SGLang engines share one GPU, and what each one holds there.

One SGLang process runs its scheduler, HTTP front end and result handling serially with its
forward passes, so a single engine leaves the GPU idle between batches. Several engines on
one GPU fill those gaps: while one engine's CPU work runs, another's kernels do. Each engine
holds its own weights, KV pool, activations and CUDA context, so the number that fits is
arithmetic on the checkpoint's shape, done here before anything starts.

An engine's GPU memory, as measured with SGLang 0.5.17 on one H200 (NVML, per process):

* weights: parameters x 2 bytes (bf16/fp16; FP8 stores the linear layers in 1 byte);
* the KV pool: ``--max-total-tokens`` x layers x KV heads x head size x 2 (K and V) x 2 bytes;
* activations of one prefill batch of ``batch_token_budget`` tokens;
* 2.1-2.5 GB per process for the rest: CUDA context, cuBLAS and attention workspaces,
  prefill CUDA graphs and the caching allocator's slack; 2.55 GB is counted.

That sum is at most 8% above what NVML measured per engine (14.48 GB for the 4B, 10.98 GB
for the 4B in FP8, 5.81 GB for the 0.6B with the default 16,384-token pool, 8.71 GB for the
0.6B with a 32,768-token budget and pool), and never below it. SGLang sizes its pool
against the free memory it sees at start (``--mem-fraction-static`` of it, less what is
loaded already), so N engines fit in any start order when N of them together stay within
that fraction of the GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Per engine process, beyond weights, KV pool and activations (measured; see above).
PROCESS_OVERHEAD_BYTES = 2_550_000_000

#: The default number of engines per GPU by model size (non-embedding parameters): the
#: most measured to help, on one H200 (docs/PERFORMANCE.md).
DEFAULT_ENGINES_BY_PARAMS: tuple[tuple[float, int], ...] = ((1.5e9, 2), (float("inf"), 1))


class SizingError(ValueError):
    """The requested engines cannot fit the GPU."""


@dataclass(frozen=True)
class ModelShape:
    """The few figures of a transformer checkpoint that decide its GPU memory."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        return cls(
            hidden=hidden,
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate=int(config.get("intermediate_size") or 4 * hidden),
            vocab=int(config.get("vocab_size") or 0),
        )

    @classmethod
    def read(cls, config: Mapping[str, Any]) -> ModelShape | None:
        """From a model's config.json (``ModelInfo.config``); None when it lacks the figures a
        transformer's would have."""
        try:
            return cls.from_config(config)
        except (ValueError, KeyError, TypeError):
            return None

    @property
    def layer_params(self) -> int:
        q_out = self.heads * self.head_dim
        kv_out = self.kv_heads * self.head_dim
        attention = self.hidden * q_out + 2 * self.hidden * kv_out + q_out * self.hidden
        return attention + 3 * self.hidden * self.intermediate  # gate, up and down projections

    @property
    def linear_params(self) -> int:
        """Parameters outside the embedding table: what the matrix products multiply."""
        return self.layers * self.layer_params

    def weight_bytes(self, quantization: str = "none") -> int:
        linear_bytes = 1 if quantization == "fp8" else 2
        return self.linear_params * linear_bytes + self.vocab * self.hidden * 2

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * 2

    @property
    def activation_bytes_per_token(self) -> int:
        """The live tensors of one layer's forward pass per token (bf16): residual and norm
        outputs, q/k/v, attention output, gate/up and the activation."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        return (4 * self.hidden + qkv + self.heads * self.head_dim + 3 * self.intermediate) * 2


@dataclass(frozen=True)
class EngineMemory:
    """One engine's GPU memory, by part (bytes)."""

    weights: int
    kv_pool: int
    activations: int
    overhead: int = PROCESS_OVERHEAD_BYTES

    @property
    def total(self) -> int:
        return self.weights + self.kv_pool + self.activations + self.overhead


def engine_memory(
    shape: ModelShape, kv_pool_tokens: int, batch_tokens: int, quantization: str
) -> EngineMemory:
    return EngineMemory(
        weights=shape.weight_bytes(quantization),
        kv_pool=kv_pool_tokens * shape.kv_bytes_per_token,
        activations=batch_tokens * shape.activation_bytes_per_token,
    )


def default_engines_per_gpu(shape: ModelShape) -> int:
    return next(n for limit, n in DEFAULT_ENGINES_BY_PARAMS if shape.linear_params < limit)


@dataclass(frozen=True)
class EnginesPlan:
    per_gpu: int
    engine: EngineMemory | None
    usable_bytes: int | None
    notes: tuple[str, ...] = ()


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def plan_engines_per_gpu(
    requested: int | None,
    shape: ModelShape | None,
    *,
    kv_pool_tokens: int,
    batch_tokens: int,
    quantization: str,
    gpu_total_bytes: int | None,
    mem_fraction_static: float,
) -> EnginesPlan:
    """How many engines each GPU gets. ``requested`` None means the default for the model's
    size, lowered (with a note) to what fits; an explicit number that does not fit raises
    ``SizingError``. Without a GPU or a readable shape there is nothing to check against."""
    if requested is not None and requested < 1:
        raise SizingError(f"engine.engines_per_gpu must be at least 1 (got {requested})")
    if shape is None:
        return EnginesPlan(requested or 1, None, None)
    need = engine_memory(shape, kv_pool_tokens, batch_tokens, quantization)
    wanted = requested if requested is not None else default_engines_per_gpu(shape)
    if gpu_total_bytes is None:
        return EnginesPlan(wanted, need, None)
    usable = int(gpu_total_bytes * mem_fraction_static)
    fits = max(0, usable // need.total)
    if wanted <= fits:
        return EnginesPlan(wanted, need, usable)
    why = (
        f"{wanted} engines of {_gb(need.total)} each (weights {_gb(need.weights)}, KV pool "
        f"{_gb(need.kv_pool)}, activations {_gb(need.activations)}, process {_gb(need.overhead)}) "
        f"need {_gb(wanted * need.total)}, more than mem_fraction_static {mem_fraction_static} of "
        f"the GPU's {_gb(gpu_total_bytes)} ({_gb(usable)})"
    )
    if requested is not None and requested > 1:
        raise SizingError(
            f"EMBEDSERVE_ENGINE__ENGINES_PER_GPU={wanted} does not fit: {why}; set it to "
            f"{max(fits, 1)} or lower, or shrink engine.kv_pool_tokens or engine.batch_token_budget"
        )
    if requested is not None:  # one engine, as asked: SGLang itself says whether it fits
        return EnginesPlan(1, need, usable)
    chosen = max(fits, 1)
    return EnginesPlan(chosen, need, usable, (f"engines_per_gpu: {chosen}, not {wanted}: {why}",))
