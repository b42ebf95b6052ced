"""Batch-1 decode step on every CPU path this machine runs, against the memory roofline of the bytes the step reads
(issue 26 item 2: a step's time must follow the bytes read, not a fixed cost), for the ~125M Llama and a small
Mixtral-shaped model side by side, float32 and bfloat16.

    python -m serving.bench paths [--paths=avx512_bf16,avx512,avx2,generic,xla,xla-avx2] [--dtypes=...] [--quick]

Paths: each native kernel ISA this CPU runs (MESHSERVE_CPU_ISA forced), "xla" (MESHSERVE_CPU_KERNELS=xla: XLA's own
ops, as on a machine where the native kernels cannot build), and "xla-avx2": XLA with its code generation limited to
AVX2 (`--xla_cpu_max_isa=AVX2`), the nearest this machine comes to an AVX2-only CPU such as the AMD EPYC Zen 3. Each
path runs in its own process (XLA_FLAGS is read once). Roofline: the bytes a greedy batch-1 step reads (every weight
but the embedding table, the LM head's int8 screen where the step takes it, the selected top_k experts of each MoE
layer: `harness.decode_step_bytes`) over the read bandwidth measured in the same process."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from absl import flags

from serving.bench.harness import BENCH_WORKDIR, TinyMoE, cpu_name, decode_step_bytes, decode_step_times, \
    llama_125m, read_bandwidth, table

_PATHS = flags.DEFINE_list("paths", [], "CPU paths (default: every native ISA this CPU runs, xla, xla-avx2)")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "dtypes")
_MODELS = flags.DEFINE_list("models", ["llama-125m", "mixtral-small"], "models")
_WORKDIR = flags.DEFINE_string("workdir", BENCH_WORKDIR, "where the benchmark models are written")
_QUICK = flags.DEFINE_bool("quick", False, "fewer decode steps (for a smoke run)")
_CHILD = flags.DEFINE_string("child", "", "(internal) measure one path in this process and print its rows as JSON")

# Mixtral-shaped, ~37M parameters (the size of the model in issue 26's report): 8 experts, top-2.
MIXTRAL_SMALL = TinyMoE("mixtral-small", "Mixtral", dict(
    vocab_size=32000, hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
    intermediate_size=384, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2))


def _checkpoint(model: str, dtype: str) -> str:
    if model == "llama-125m":
        return llama_125m(dtype, _WORKDIR.value)
    if model == "mixtral-small":
        return MIXTRAL_SMALL.checkpoint(dtype, _WORKDIR.value)
    raise ValueError(f"--models: unknown {model!r}; expected llama-125m or mixtral-small")


def _path_env(path: str) -> dict[str, str]:
    env = dict(os.environ)
    for k in ("MESHSERVE_CPU_KERNELS", "MESHSERVE_CPU_ISA"):
        env.pop(k, None)
    if path.startswith("xla"):
        env["MESHSERVE_CPU_KERNELS"] = "xla"
        if path == "xla-avx2":
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_max_isa=AVX2").strip()
    else:
        env["MESHSERVE_CPU_ISA"] = path
    return env


def _measure(path: str) -> list[list]:
    """In the child process: rows for every model and dtype on the path this process was started for."""
    import numpy as np

    from serving.core.llm import LLM
    from serving.params import SamplingParams
    bw = read_bandwidth()
    n_out = 24 if _QUICK.value else 48
    rows = []
    for model in _MODELS.value:
        for dtype in _DTYPES.value:
            llm = LLM(_checkpoint(model, dtype), dtype=dtype, page_size=16, num_pages=512, max_num_seqs=4,
                      max_num_batched_tokens=128, enable_prefix_caching=False)
            eng = llm.engine
            greedy = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
            rng = np.random.default_rng(0)
            prompt = lambda: rng.integers(10, 32000, 64).tolist()  # noqa: E731
            decode_step_times(eng, [prompt()], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
            times = []
            for _ in range(2):
                times += decode_step_times(eng, [prompt()], greedy).times
            step, nbytes = statistics.median(times), decode_step_bytes(eng, 1)
            rows.append([path, model, dtype, nbytes / 1e6, step * 1e3, nbytes / bw * 1e3, nbytes / bw / step,
                         bw / 1e9])
            del llm, eng
    return rows


def _paths() -> list[str]:
    if _PATHS.value:
        return _PATHS.value
    from pallas_kernels import native
    runnable = [] if native.machine_reason() else native.runnable_isas()
    return [*reversed(runnable), "xla", "xla-avx2"]


def main() -> None:
    if _CHILD.value:
        print("ROWS " + json.dumps(_measure(_CHILD.value)), flush=True)
        return
    rows = []
    for path in _paths():
        args = [sys.executable, "-m", "serving.bench", "paths", f"--child={path}",
                f"--dtypes={','.join(_DTYPES.value)}", f"--models={','.join(_MODELS.value)}",
                f"--workdir={_WORKDIR.value}", *(["--quick"] if _QUICK.value else [])]
        out = subprocess.run(args, env=_path_env(path), capture_output=True, text=True)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("ROWS ")), None)
        if out.returncode or line is None:
            raise RuntimeError(f"path {path}: exit {out.returncode}\n{out.stderr[-3000:]}")
        rows += json.loads(line[5:])
    table(f"Batch-1 greedy decode step vs the roofline of the bytes it reads, every CPU path ({cpu_name()}); "
          "median step over 2 x 64-token prompts; GB/s: read bandwidth measured in each path's process",
          ["path", "model", "dtype", "MB read", "step (ms)", "roofline (ms)", "roofline/step", "GB/s"], rows)
