"""A stand-in for `vllm serve MODEL --runner pooling ...`, so that the vllm scenario's
orchestration, result JSON and report run on a machine without vLLM or a GPU
(`python bench/suite.py --device cpu --only vllm --vllm-cmd "python3 bench/fake_vllm.py"`).

It takes vLLM's command line (what it needs of it), serves a plain forward pass with vLLM's
routes and prefix-cache counters (bench/inprocess.py) and writes start-up lines shaped like
vLLM's. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import sys

import inprocess

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["serve"])
    ap.add_argument("model")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name")
    ap.add_argument("--max-model-len", type=int, default=512)
    a, _ = ap.parse_known_args(sys.argv[1:])
    print("INFO [cuda.py] Using FAKE_CPU attention backend out of potential backends: ['FAKE_CPU'].\n"
          "INFO [core.py] Initializing a V1 LLM engine (fake) with config: "
          "compilation_config={'cudagraph_mode': <CUDAGraphMode.NONE: 0>}", flush=True)
    inprocess.serve(inprocess.load("transformers", a.model), a.port, a.served_model_name or a.model,
                    a.max_model_len)
