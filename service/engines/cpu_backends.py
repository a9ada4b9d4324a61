"""The CPU engine's forward passes (``engine.cpu_backend``): padded token ids and their
attention mask in, unit vectors out, one row per input.

``onnx`` runs the model's cached ONNX export on ONNX Runtime and never imports torch (the
export is made in a child process, ``onnx_export``); ``torch`` runs sentence-transformers, or a
reranker's module (``score_modules``). A reranker's "vectors" are one raw score each. An
embedding model's forward also gives the last hidden state of every token (``with_tokens``),
which late chunking pools, and a model with sparse or ColBERT outputs all of its graph's outputs
from one forward (``heads``: ``contracts/onnx_export.graph_outputs``), on torch from the module the
export traces (``hybrid_modules``).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import numpy as np

from embedserve.config import Settings
from embedserve.contracts.onnx_export import MODEL_FILE, TOKEN_STATES_OUTPUT, VECTORS_OUTPUT, graph_outputs
from embedserve.engines.cores import usable_cores
from embedserve.engines.ort_session import open_session
from embedserve.model_info import ModelInfo

log = logging.getLogger(__name__)


class Forward(Protocol):
    dimension: int
    vocab_size: int
    description: str

    def __call__(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray: ...

    def with_tokens(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The vectors and every token's last hidden state (batch, sequence, hidden)."""
        ...

    def heads(self, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        """Every output of the graph but the token states, by name, from one forward."""
        ...


def compute_threads(settings: Settings) -> int:
    return settings.engine.cpu_threads or usable_cores()


def session_options(threads: int) -> Any:
    """Full graph optimisation, ``threads`` intra-op threads, no busy-waiting between calls:
    the gateway (and, in a pod, its neighbours) share these cores; on a busy 2-core VM a
    spinning pool ran a single input 1.8-3x slower."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


class OnnxForward:
    """ONNX Runtime with full graph optimisation, one intra-op thread per usable core."""

    def __init__(self, settings: Settings) -> None:
        from embedserve.engines.onnx_export import ensure_export

        folder, export = ensure_export(settings)
        options = session_options(compute_threads(settings))
        self.session = open_session(folder / MODEL_FILE, options)
        self.output = self.session.get_outputs()[0].name  # a reranker's is its score
        self.heads_names = [o.name for o in self.session.get_outputs() if o.name != TOKEN_STATES_OUTPUT]
        self.dimension = export.dimension
        self.vocab_size = export.vocab_size
        self.description = f"onnx ({export.quantization}, {folder})"
        log.info("onnx runtime session", extra={
            "folder": str(folder), "threads": options.intra_op_num_threads,
            "quantization": export.quantization,
        })

    def __call__(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        out: np.ndarray = self.session.run([self.output], {"input_ids": ids, "attention_mask": mask})[0]
        return out

    def with_tokens(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        vectors, states = self.session.run(
            [VECTORS_OUTPUT, TOKEN_STATES_OUTPUT], {"input_ids": ids, "attention_mask": mask}
        )
        return vectors, states

    def heads(self, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        out = self.session.run(self.heads_names, {"input_ids": ids, "attention_mask": mask})
        return dict(zip(self.heads_names, out, strict=True))


def torch_device(settings: Settings) -> tuple[str, Any]:
    """Where the torch backend runs and in what dtype: the engine kind ``torch`` on this process's
    first visible GPU (``engine.dtype`` auto: bfloat16), else the CPU in float32.

    On the GPU, attention (SDPA) runs without its cuDNN backend: cuDNN builds an execution plan for
    every new (batch, length) shape, hundreds of milliseconds each, and an engine's batches keep
    taking new shapes (inputs of every length, coalesced from several requests). On one H100 the
    cross-encoder's engines sat idle for half of each second while they built plans, and scored
    more pairs every round as the plans piled up (results/gpu-rerank-cudnn-h100/). FlashAttention
    and memory-efficient attention build nothing per shape."""
    import torch

    if settings.engine.kind != "torch":
        return "cpu", torch.float32
    torch.backends.cuda.enable_cudnn_sdp(False)
    name = "bfloat16" if settings.engine.dtype == "auto" else settings.engine.dtype
    return "cuda", getattr(torch, name)


class TorchForward:
    """sentence-transformers on torch, the model folder's own pooling."""

    def __init__(self, settings: Settings) -> None:
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(compute_threads(settings))
        self._torch = torch
        self.device, dtype = torch_device(settings)
        path = str(settings.model.resolved_path)
        self.model = SentenceTransformer(
            path, device=self.device, local_files_only=True, model_kwargs={"dtype": dtype}
        )
        self.model.eval()
        dim_of = (
            getattr(self.model, "get_embedding_dimension", None)
            or self.model.get_sentence_embedding_dimension
        )
        self.dimension = int(dim_of() or 0)
        transformer: Any = self.model[0].auto_model
        self.vocab_size = int(transformer.get_input_embeddings().num_embeddings)
        self.description = f"torch ({self.device}, {dtype})"

    def __call__(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return self.with_tokens(ids, mask)[0]

    def with_tokens(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        torch = self._torch
        with torch.inference_mode():
            features = {"input_ids": torch.from_numpy(ids).to(self.device),
                        "attention_mask": torch.from_numpy(mask).to(self.device)}
            out = self.model.forward(features)
            vectors = torch.nn.functional.normalize(out["sentence_embedding"].float(), dim=-1).cpu().numpy()
            states = out["token_embeddings"].float().cpu().numpy()
        return vectors, states

    def heads(self, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        return {VECTORS_OUTPUT: self(ids, mask)}


class TorchHeadsForward:
    """A model with sparse or ColBERT outputs on torch: the module its ONNX export traces."""

    def __init__(self, settings: Settings, info: ModelInfo) -> None:
        import torch

        from embedserve.engines.hybrid_modules import load_hybrid_module
        from embedserve.engines.onnx_export import pooled

        torch.set_num_threads(compute_threads(settings))
        self._torch = torch
        self.names = graph_outputs(info.outputs)

        def dense() -> Any:
            from sentence_transformers import SentenceTransformer

            return pooled(SentenceTransformer(str(info.path), device="cpu", local_files_only=True).eval())

        self.device, dtype = torch_device(settings)
        self.module = load_hybrid_module(info, dense)
        self.vocab_size = self.module.vocab_size
        self.module = self.module.to(self.device, dtype)
        self.dimension = info.dimension
        self.description = f"torch ({', '.join(info.outputs)}, {self.device}, {dtype})"

    def _run(self, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        torch = self._torch
        with torch.inference_mode():
            out = self.module(torch.from_numpy(ids).to(self.device), torch.from_numpy(mask).to(self.device))
            outs = out if isinstance(out, tuple) else (out,)
            return {name: t.float().cpu().numpy() for name, t in zip(self.names, outs, strict=True)}

    def __call__(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return self._run(ids, mask)[VECTORS_OUTPUT]

    def with_tokens(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = self._run(ids, mask)
        return out[VECTORS_OUTPUT], out[TOKEN_STATES_OUTPUT]

    def heads(self, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        return {k: v for k, v in self._run(ids, mask).items() if k != TOKEN_STATES_OUTPUT}


class TorchScoreForward:
    """A reranker on torch (``engines/score_modules.py``): one raw score per input."""

    def __init__(self, settings: Settings, info: ModelInfo) -> None:
        import torch

        from embedserve.engines.score_modules import load_score_module, vocab_size

        torch.set_num_threads(compute_threads(settings))
        self._torch = torch
        self.device, dtype = torch_device(settings)
        self.module = load_score_module(info, dtype, self.device)
        self.dimension = 1
        self.vocab_size = vocab_size(self.module)
        self.description = f"torch ({info.scoring}, {self.device}, {dtype})"

    def __call__(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        torch = self._torch
        with torch.inference_mode():
            out = self.module(torch.from_numpy(ids).to(self.device), torch.from_numpy(mask).to(self.device))
            scores: np.ndarray = out.float().cpu().numpy()
        return scores

    def with_tokens(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Never called: the engine refuses late chunking for a model that does not embed
        (``cpu._extension_problem``) before it reaches the forward; the protocol asks for it."""
        raise NotImplementedError("a reranker's forward gives scores, not token states")

    def heads(self, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        """Never called: the engine refuses ``outputs`` for a reranker (``cpu._extension_problem``,
        ``hybrid_rows.outputs_problem``) before it reaches the forward; the protocol asks for it."""
        raise NotImplementedError("a reranker's forward gives scores, not an embedding model's outputs")


def runs_onnx(settings: Settings) -> bool:
    """The engine kind ``torch`` runs the torch backend on its GPU, whatever ``cpu_backend`` says."""
    return settings.engine.cpu_backend == "onnx" and settings.engine.kind != "torch"


def load_forward(settings: Settings) -> Forward:
    if runs_onnx(settings):
        return OnnxForward(settings)
    info = ModelInfo.load(settings.model)
    if not info.embeds:
        return TorchScoreForward(settings, info)
    return TorchForward(settings) if info.outputs == ("dense",) else TorchHeadsForward(settings, info)
