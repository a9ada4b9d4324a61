"""CPU peers side by side in one run on one machine: embedserve ``up`` (torch, ONNX fp32,
ONNX int8), Infinity 0.0.78 (its ``torch`` engine, its ``optimum`` engine as shipped and with
its graph optimisation made to work) and, in process, sentence-transformers (torch; ONNX) and
ONNX Runtime on embedserve's own export. A benchmark that prints numbers, not a test.

    python -m bench.cpu.cpu_peers --out results/cpu-peers --rounds 3 --seconds 15 \
        --infinity-site /work/venv-infinity/lib/python3.11/site-packages

Every server runs for the whole run; rounds alternate the sides (each load, each side in
turn, the order rotating per round) so a busy neighbour hits all of them alike; tables show
medians of the rounds. Inputs are unique (loadtest's word builder: each text opens with its
own marker); every side gets the same texts in a round, other texts in the next. Vectors of
every server are checked against in-process sentence-transformers (cosine). Memory: RSS of
each side's whole process tree (gateway and engine for embedserve), the largest seen after
each run, and the load average next to every row. Infinity comes from its own folder
(``--infinity-site``: a virtual environment's site-packages with infinity-emb 0.0.78,
transformers 4.57, sentence-transformers 5.1, optimum-onnx) and pools by mean (``auto`` picks
the first token for this model: wrong vectors).

Infinity's ``optimum`` engine and sentence-transformers' ONNX backend read an ONNX file from
the model's folder, which the bundled model does not ship: before the servers start, the run
writes one (sentence-transformers' own export, ``model.onnx``) into a copy of the folder under
``--work``. Infinity finds it only when started in that folder with ``--model-id .`` (given a
path, it passes the whole path as the file name, which optimum-onnx looks up by bare name and
does not find). Its optimisation step fails on optimum-onnx 0.1.0 (``OptimizationConfig`` no
longer takes ``optimize_with_onnxruntime_only``) and it then serves the graph unoptimised: that
is the ``Infinity optimum`` side. ``Infinity optimum optimised`` is the same engine given the
file its optimisation step would have written (optimum's optimiser at level 99, for CPU),
where it looks for it first.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

from embedserve.config import BUNDLED_MODEL, resolve_model_path
from embedserve.loadtest.mixes import parse_mix
from embedserve.loadtest.runner import RunConfig, Runner
from embedserve.loadtest.stats import percentiles
from embedserve.loadtest.textbuild import WordBuilder
from embedserve.loadtest.traffic import RequestFactory

MODEL = "all-MiniLM-L6-v2"
MODEL_DIR = str(resolve_model_path(BUNDLED_MODEL))


@dataclass(frozen=True)
class Load:
    name: str
    words: int
    inputs: int
    conc: int
    in_process_batches: tuple[int, ...]  # what the in-process sides run for this load


LOADS = [
    Load("20-word texts, 1 per request, 16 in flight", 20, 1, 16, (1, 16)),
    Load("64-word texts x 32 per request, 4 in flight", 64, 32, 4, (32,)),
    Load("one in flight", 20, 1, 1, (1,)),
]


def texts_for(words: int, n: int, seed: int) -> list[str]:
    builder, rng = WordBuilder(seed), __import__("random").Random(seed)
    return [builder.build(words, rng, serial)[0] for serial in range(n)]


# -- servers -----------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    path: str  # the embeddings route
    ready_path: str
    cwd: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    rss_mib: list[float] = field(default_factory=list)
    ready_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.path}"

    def start(self, logs: Path) -> None:
        log = (logs / f"{self.name.replace(' ', '_')}.log").open("wb")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, env={**os.environ, **self.env}, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True, cwd=self.cwd)

    def wait(self, timeout: float = 900) -> None:
        deadline = self.t0 + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}{self.ready_path}", timeout=2).status_code == 200:
                    self.warm_up()
                    self.ready_s = round(time.monotonic() - self.t0, 1)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not ready after {timeout} s")

    def warm_up(self) -> None:
        """One call of the kind the run makes, once the server says it is ready."""
        embed(self.url, ["warm up"])

    def tree_rss(self) -> dict[str, float]:
        assert self.proc is not None
        root = psutil.Process(self.proc.pid)
        out = {}
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                out[f"{p.pid} {' '.join(p.cmdline()[1:4])[:60]}"] = p.memory_info().rss / 2**20
        return out

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)


def embed(url: str, texts: list[str]) -> np.ndarray:
    r = httpx.post(url, json={"model": MODEL, "input": texts}, timeout=120)
    r.raise_for_status()
    data = sorted(r.json()["data"], key=lambda d: d["index"])
    return np.asarray([d["embedding"] for d in data], dtype=np.float32)


def embedserve(name: str, port: int, engine_port: int, *flags: str,
               env: dict[str, str] | None = None) -> Server:
    """`embedserve up` on the CPU engine, with ``env``'s settings on top."""
    base = {"EMBEDSERVE_LOG_LEVEL": "WARNING", "EMBEDSERVE_ENGINE__KIND": "cpu", "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "embedserve", "up", "--port", str(port), "--engine-port", str(engine_port),
            *flags]
    return Server(name, argv, base | (env or {}), port, "/v1/embeddings", "/health/ready")


def infinity(name: str, port: int, engine: str, site: str, onnx_dir: Path | None = None,
             hub_cache: Path | None = None) -> Server:
    """``onnx_dir``: the folder with model.onnx, for the optimum engine (started in it, ``--model-id
    .``); ``hub_cache``: its HF_HUB_CACHE, where it looks for (and would write) the optimised graph."""
    env = {"PYTHONPATH": site, "HF_HUB_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
           "DO_NOT_TRACK": "1"}
    if hub_cache is not None:  # huggingface_hub 0.36 reads HUGGINGFACE_HUB_CACHE for Infinity's constant
        hub_cache.mkdir(parents=True, exist_ok=True)
        env["HF_HUB_CACHE"] = env["HUGGINGFACE_HUB_CACHE"] = str(hub_cache)
    argv = [sys.executable, "-m", "infinity_emb.cli", "v2", "--model-id", "." if onnx_dir else MODEL_DIR,
            "--served-model-name", MODEL, "--engine", engine, "--device", "cpu", "--dtype", "float32",
            "--pooling-method", "mean", "--port", str(port)]
    return Server(name, argv, env, port, "/embeddings", "/health", cwd=str(onnx_dir) if onnx_dir else None)


PREPARE = """
import shutil, sys
from pathlib import Path
from sentence_transformers import SentenceTransformer
from optimum.onnxruntime import ORTModelForFeatureExtraction, ORTOptimizer
from optimum.onnxruntime.configuration import OptimizationConfig

source, folder, optimised = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
shutil.rmtree(folder, ignore_errors=True)
SentenceTransformer(source, device="cpu", backend="onnx", local_files_only=True).save_pretrained(str(folder))
(folder / "onnx" / "model.onnx").rename(folder / "model.onnx")
(folder / "onnx").rmdir()
model = ORTModelForFeatureExtraction.from_pretrained(str(folder), file_name="model.onnx")
# Infinity's own settings (infinity_emb/transformer/utils_optimum.py) less the argument that
# optimum-onnx 0.1.0 refuses
config = OptimizationConfig(optimization_level=99, optimize_for_gpu=False, fp16=False)
ORTOptimizer.from_pretrained(model).optimize(optimization_config=config, save_dir=str(optimised),
                                             one_external_file=True)
"""


def prepare_onnx(work: Path, site: str) -> tuple[Path, Path, Path]:
    """The bundled model with sentence-transformers' ONNX export beside it, and the hub caches of
    the two Infinity optimum sides: empty (as shipped), and holding the optimised graph where
    Infinity looks for it (HF_HUB_CACHE/infinity_onnx/CPUExecutionProvider/ + the model id ``.``)."""
    folder, plain, optimised = work / "minilm-onnx", work / "hub-plain", work / "hub-optimised"
    shutil.rmtree(plain, ignore_errors=True)
    shutil.rmtree(optimised, ignore_errors=True)
    target = optimised / "infinity_onnx" / "CPUExecutionProvider"
    subprocess.run([sys.executable, "-c", PREPARE, MODEL_DIR, str(folder), str(target)], check=True,
                   env={**os.environ, "PYTHONPATH": site, "HF_HUB_OFFLINE": "1"}, capture_output=True)
    return folder, plain, optimised


async def drive(url: str, load: Load, seconds: float, warmup: float, seed: int) -> dict[str, Any]:
    factory = RequestFactory(parse_mix(f"fixed:{load.words}"), WordBuilder(seed), "text",
                             (load.inputs, load.inputs), MODEL, seed)
    cfg = RunConfig(url=url, mode="closed", concurrency=load.conc, duration_s=seconds, warmup_s=warmup,
                    timeout_s=120.0, seed=seed)
    out = await Runner(cfg).run(factory.make)
    rec = out.rec
    lat = [lt for lt, c, w in zip(rec.latency, rec.code, rec.warm, strict=True) if not w and 200 <= c < 300]
    bad = sum(1 for c, w in zip(rec.code, rec.warm, strict=True) if not w and not 200 <= c < 300)
    span = out.measured_end - out.measured_start
    return {"texts_per_s": round(len(lat) * load.inputs / span, 1),
            "p50_ms": percentiles(np.asarray(lat, dtype=float))["p50"] if lat else None,
            "requests": len(lat), "errors": bad}


# -- in process ----------------------------------------------------------------------------


def worker(backend: str) -> None:
    """The in-process side: one model, commands as JSON lines on stdin, answers on stdout."""
    if backend == "st-torch":
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(MODEL_DIR, device="cpu", local_files_only=True)

        def encode(texts: list[str]) -> np.ndarray:
            out: np.ndarray = model.encode(texts, batch_size=len(texts), normalize_embeddings=True)
            return out
    elif backend == "st-onnx":  # the folder prepare_onnx wrote, in ONNX_DIR
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(os.environ["ONNX_DIR"], device="cpu", local_files_only=True,
                                    backend="onnx", model_kwargs={"file_name": "model.onnx"})

        def encode(texts: list[str]) -> np.ndarray:
            out: np.ndarray = model.encode(texts, batch_size=len(texts), normalize_embeddings=True)
            return out
    else:  # "ort-export": the tokenizer and ONNX Runtime on embedserve's own export
        from embedserve.config import Settings
        from embedserve.engines.cpu_backends import OnnxForward
        from embedserve.loadtest.textbuild import load_tokenizer

        forward = OnnxForward(Settings(_env_file=None))
        tok = load_tokenizer(MODEL_DIR)
        tok.enable_truncation(256)

        def encode(texts: list[str]) -> np.ndarray:
            enc = tok.encode_batch(texts)
            tok_ids = [e.ids for e in enc]
            width = max(map(len, tok_ids))
            ids = np.zeros((len(tok_ids), width), dtype=np.int64)
            mask = np.zeros_like(ids)
            for row, x in enumerate(tok_ids):
                ids[row, : len(x)] = x
                mask[row, : len(x)] = 1
            return forward(ids, mask)

    encode(["warm up"] * 4)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "embed":
            print(json.dumps({"vectors": encode(cmd["texts"]).tolist()}), flush=True)
            continue
        batch, words, seconds, seed = cmd["batch"], cmd["words"], cmd["seconds"], cmd["seed"]
        builder, rng, serial = WordBuilder(seed), __import__("random").Random(seed), 0
        lat: list[float] = []
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            texts = [builder.build(words, rng, serial + i)[0] for i in range(batch)]
            serial += batch
            t0 = time.perf_counter()
            encode(texts)
            lat.append(time.perf_counter() - t0)
        span = sum(lat)
        print(json.dumps({"texts_per_s": round(len(lat) * batch / span, 1),
                          "p50_ms": round(1000 * statistics.median(lat), 2), "requests": len(lat),
                          "rss_mib": psutil.Process().memory_info().rss / 2**20}), flush=True)


@dataclass
class InProcess:
    name: str
    backend: str
    env: dict[str, str]
    proc: subprocess.Popen[str] | None = None
    rss_mib: list[float] = field(default_factory=list)

    def start(self, logs: Path) -> None:
        err = (logs / f"{self.name.replace(' ', '_')}.log").open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.cpu.cpu_peers", "--worker", self.backend],
                                     env={**os.environ, **self.env}, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=err, text=True)
        if not json.loads(self._line()).get("ready"):
            raise RuntimeError(f"{self.name} did not start")

    def _line(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited")
        return line

    def ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        answer: dict[str, Any] = json.loads(self._line())
        return answer

    def stop(self) -> None:
        if self.proc:
            self.proc.kill()
            self.proc.wait()


# -- the run -------------------------------------------------------------------------------


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out: np.ndarray = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return out


def cold_exports() -> dict[str, Any]:
    """What a first start adds: the export into an empty cache (fp32, then int8 from it), in the
    child process the engine runs: wall-clock seconds, and the CPU seconds it used (which a busy
    machine changes less)."""
    import tempfile

    out: dict[str, Any] = {"load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as cache:
        for quantization in ("none", "int8"):
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "EMBEDSERVE_LOG_LEVEL": "WARNING",
                   "EMBEDSERVE_ENGINE__CPU_EXPORT_DIR": cache,
                   "EMBEDSERVE_ENGINE__CPU_QUANTIZATION": quantization}
            t0, cpu0 = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run([sys.executable, "-m", "embedserve.engines.onnx_export"], env=env, check=True,
                           capture_output=True)
            cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            out[quantization] = round(time.monotonic() - t0, 1)
            used = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
            out[f"{quantization}_cpu_s"] = round(used, 1)
    out["load_average_after"] = os.getloadavg()
    print(json.dumps({"first_start_export_s": out}), flush=True)
    return out


def run(a: argparse.Namespace) -> dict[str, Any]:
    out = Path(a.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    servers = [embedserve("embedserve torch", 8101, 30101, "--cpu-backend", "torch"),
               embedserve("embedserve onnx", 8102, 30111),
               embedserve("embedserve onnx int8", 8103, 30121, "--cpu-quantization", "int8")]
    doc: dict[str, Any] = {"load_average_before": os.getloadavg(), "started": time.time(), "rows": [],
                           "skipped": {}}
    onnx_dir: Path | None = None
    if not a.no_infinity:
        onnx_dir, plain, optimised = prepare_onnx(Path(a.work), a.infinity_site)
        servers += [infinity("Infinity torch", 8104, "torch", a.infinity_site),
                    infinity("Infinity optimum", 8105, "optimum", a.infinity_site, onnx_dir, plain),
                    infinity("Infinity optimum optimised", 8106, "optimum", a.infinity_site, onnx_dir,
                             optimised)]
    inproc = [InProcess("ST torch in process", "st-torch", {})]
    if onnx_dir is not None:
        inproc.append(InProcess("ST ONNX in process", "st-onnx",
                                {"PYTHONPATH": a.infinity_site, "ONNX_DIR": str(onnx_dir)}))
    inproc.append(InProcess("embedserve's export in process", "ort-export", {}))
    if not a.no_cold_export:
        doc["first_start_export"] = cold_exports()
    try:
        live: list[Server] = []
        for s in servers:  # one at a time: a start is not measured against another's export
            s.start(logs)
            try:
                s.wait()
                live.append(s)
            except RuntimeError as exc:
                doc["skipped"][s.name] = str(exc)
                s.stop()
            print(f"{s.name}: ready in {s.ready_s} s", flush=True)
        for worker_side in list(inproc):
            try:
                worker_side.start(logs)
            except RuntimeError:  # once, on a busy machine, one exited at start without a word
                worker_side.stop()
                try:
                    worker_side.start(logs)
                except RuntimeError as exc:
                    doc["skipped"][worker_side.name] = str(exc)
                    worker_side.stop()
                    inproc.remove(worker_side)
        check = texts_for(3, 4, 7) + texts_for(20, 8, 8) + texts_for(64, 8, 9) + texts_for(180, 4, 10)
        reference = np.asarray(inproc[0].ask({"op": "embed", "texts": check})["vectors"], dtype=np.float32)
        doc["vector_check"] = {}
        for s in list(live):
            try:
                cos = cosine(embed(s.url, check), reference)
            except httpx.HTTPError as exc:  # it died after its start: say so, go on without it
                doc["skipped"][s.name] = f"stopped answering: {exc}"
                live.remove(s)
                continue
            doc["vector_check"][s.name] = {"min": round(float(cos.min()), 7),
                                           "median": round(float(np.median(cos)), 7)}
        for worker_side in inproc[1:]:
            cos = cosine(np.asarray(worker_side.ask({"op": "embed", "texts": check})["vectors"]), reference)
            doc["vector_check"][worker_side.name] = {"min": round(float(cos.min()), 7),
                                                     "median": round(float(np.median(cos)), 7)}
        print(json.dumps(doc["vector_check"], indent=1), flush=True)
        for rnd in range(a.rounds):
            for li, load in enumerate(LOADS):
                seed = 1000 * (rnd + 1) + li
                sides: list[Server | InProcess] = [*live, *inproc]
                shift = rnd % len(sides)
                for side in sides[shift:] + sides[:shift]:
                    if isinstance(side, Server):
                        r = asyncio.run(drive(side.url, load, a.seconds, a.warmup, seed))
                        rss = side.tree_rss()
                        r["rss_mib"] = round(sum(rss.values()), 1)
                        r["rss_parts_mib"] = {k: round(v, 1) for k, v in rss.items()}
                        rows = [{"side": side.name, "batch": None, **r}]
                    else:
                        rows = []
                        for batch in load.in_process_batches:
                            r = side.ask({"op": "run", "batch": batch, "words": load.words,
                                          "seconds": a.seconds, "seed": seed})
                            r["rss_mib"] = round(r["rss_mib"], 1)
                            rows.append({"side": side.name, "batch": batch, **r})
                    for row in rows:
                        row.update(round=rnd, load=load.name, load_average=os.getloadavg()[0])
                        doc["rows"].append(row)
                        print(json.dumps({k: v for k, v in row.items() if k != "rss_parts_mib"}), flush=True)
    finally:
        for s in servers:
            s.stop()
        for p in inproc:
            p.stop()
    doc["load_average_after"] = os.getloadavg()
    doc["ready_s"] = {s.name: s.ready_s for s in servers}
    return doc


def versions(site: str) -> dict[str, str]:
    import importlib.metadata as md

    out = {p: md.version(p) for p in ("embedserve", "torch", "transformers", "sentence-transformers",
                                      "onnxruntime", "onnx")}
    for dist in Path(site).glob("*.dist-info"):
        name, _, release = dist.name.removesuffix(".dist-info").rpartition("-")
        name = name.lower().replace("_", "-")
        if name in ("infinity-emb", "transformers", "sentence-transformers", "optimum", "optimum-onnx",
                    "onnxruntime", "torch"):
            out[f"{name} (Infinity's folder)"] = release
    return out


def medians(rows: list[dict[str, Any]]) -> dict[tuple[str, str, int | None], dict[str, float]]:
    groups: dict[tuple[str, str, int | None], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["side"], r["load"], r["batch"]), []).append(r)
    return {k: {f: statistics.median(x[f] for x in v) for f in ("texts_per_s", "p50_ms", "rss_mib")
                if all(x.get(f) is not None for x in v)} | {"errors": sum(x.get("errors", 0) for x in v)}
            for k, v in groups.items()}


def to_markdown(doc: dict[str, Any]) -> str:
    """The side-by-side table (medians of the rounds), the ratios the targets name, the vector check."""
    med = {(m["side"], m["load"], m["batch"]): m for m in doc["medians"]}
    sides = list(dict.fromkeys(m["side"] for m in doc["medians"]))

    def cell(side: str, load: Load) -> str:
        if side.endswith("in process"):
            parts = [f"{med[(side, load.name, b)]['texts_per_s']:g} at batch {b}"
                     for b in load.in_process_batches if (side, load.name, b) in med]
            if load.conc == 1 and (one := med.get((side, load.name, 1))):
                return f"{one['texts_per_s']:g}, {one['p50_ms']:.1f} ms"
            return "; ".join(parts)
        m = med.get((side, load.name, None))
        if not m:
            return "-"
        text = f"{m['texts_per_s']:g}" + (f", {m['p50_ms']:.1f} ms" if load.conc == 1 else "")
        return text + (f" ({m['errors']} errors)" if m["errors"] else "")

    def rss(side: str) -> str:
        values = [r["rss_mib"] for r in doc["rows"] if r["side"] == side]
        return f"{max(values):,.0f} MiB" if values else "-"

    lines = ["| load | " + " | ".join(sides) + " |", "|---|" + "---|" * len(sides)]
    for load in LOADS:
        unit = "texts/s, P50" if load.conc == 1 else "texts/s"
        lines.append(f"| {load.name} ({unit}) | " + " | ".join(cell(s, load) for s in sides) + " |")
    lines.append("| resident memory, largest seen | " + " | ".join(rss(s) for s in sides) + " |")
    check = doc.get("vector_check", {})
    lines.append("| cosine to sentence-transformers, min | "
                 + " | ".join(f"{check[s]['min']:.7f}" if s in check else "reference" for s in sides) + " |")
    return "\n".join(lines) + "\n"


def ratios(doc: dict[str, Any], default: str = "embedserve onnx") -> dict[str, Any]:
    """The targets' figures for ``default`` (and for int8 and the torch backend beside it): against
    Infinity's fastest side per load, against the in-process sides of the same backend and batch
    size, P50 at one in flight, and the stack's largest RSS."""
    med = {(m["side"], m["load"], m["batch"]): m for m in doc["medians"]}
    short, batches, single = (load.name for load in LOADS)

    def tps(side: str, load: str, batch: int | None = None) -> float | None:
        m = med.get((side, load, batch))
        return m["texts_per_s"] if m else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 2) if a and b else None

    infinity = sorted(s for s in {m["side"] for m in doc["medians"]} if s.startswith("Infinity"))
    fastest = {load: max(infinity, key=lambda s: tps(s, load) or 0.0, default=None)
               for load in (short, batches)}
    out: dict[str, Any] = {"Infinity's fastest": fastest}
    for side in (default, "embedserve onnx int8"):
        for load, batch in ((short, 16), (batches, 32)):
            key = "short" if load == short else "batches"
            best = fastest[load]
            out[f"{side}, {key} vs Infinity's fastest"] = ratio(tps(side, load),
                                                                 tps(best, load) if best else None)
            out[f"{side}, {key} vs ST ONNX in process at batch {batch}"] = ratio(
                tps(side, load), tps("ST ONNX in process", load, batch))
            out[f"{side}, {key} vs its export in process at batch {batch}"] = ratio(
                tps(side, load), tps("embedserve's export in process", load, batch))
        out[f"{side}, one in flight P50 ms"] = (med.get((side, single, None)) or {}).get("p50_ms")
        rss = [r["rss_mib"] for r in doc["rows"] if r["side"] == side]
        out[f"{side}, largest RSS MiB"] = max(rss) if rss else None
    for load, batch in ((short, 16), (batches, 32)):
        key = "short" if load == short else "batches"
        out[f"embedserve torch, {key} vs ST torch in process at batch {batch}"] = ratio(
            tps("embedserve torch", load), tps("ST torch in process", load, batch))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/cpu-peers")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--infinity-site", default="/tmp/site-infinity",
                    help="site-packages of infinity-emb 0.0.78 with transformers 4.57, "
                    "sentence-transformers 5.1 and optimum-onnx (sentence-transformers' ONNX side runs "
                    "from it too)")
    ap.add_argument("--no-infinity", action="store_true")
    ap.add_argument("--no-cold-export", action="store_true", help="skip timing a first start's export")
    ap.add_argument("--work", default="/tmp/cpu-peers",
                    help="the ONNX copy of the model for Infinity and sentence-transformers, and hub caches")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker)
        return 0
    doc = run(a)
    doc["machine"] = {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
                      "cpu": platform.processor() or platform.machine(), "python": platform.python_version()}
    doc["versions"] = versions(a.infinity_site)
    doc["settings"] = {"rounds": a.rounds, "seconds": a.seconds, "warmup": a.warmup}
    doc["medians"] = [{"side": k[0], "load": k[1], "batch": k[2], **v}
                      for k, v in medians(doc["rows"]).items()]
    doc["ratios"] = ratios(doc)
    out = Path(a.out)
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    (out / "table.md").write_text(to_markdown(doc))
    print(to_markdown(doc))
    print(json.dumps(doc["ratios"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
