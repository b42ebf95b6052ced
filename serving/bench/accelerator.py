"""Acceptance run for a machine with a GPU or TPU, in one process, the stages in order of value: one `PASS <stage>:
...` line per stage (or FAIL, SKIP: cannot run here, TIMEOUT: its budget ran out, NOT REACHED: the run's did), then
`accelerator acceptance: N passed, M failed, ...`; the exit status is non-zero unless every stage passed or was
skipped (a stage that raises fails with the exception's first line, and the run goes on). Stages:

  environment          jax/jaxlib and the packages beside them, the devices, the engine's platform choices (bf16)
  attention            the platform's attention kernel (Triton / Mosaic, compiled) on the named ragged cases and
                       engine-shaped bf16 cases, vs the float64 NumPy oracle (max error per case group)
  kv_write             write_kv on the device vs a NumPy expectation
  greedy_parity        models/tiny/target greedy tokens (float32) on the device vs on CPU (a subprocess)
  decode_roofline      a Llama-3.2-1B-shaped random bf16 model: decode step at batch 1 and 64 (~1k context) vs
                       (weight + KV bytes a step reads) / the copy bandwidth measured in the run
  attention_bandwidth  decode attention GB/s: ours vs JAX's Pallas paged attention and the XLA reference
  moe                  a Mixtral-shaped random model's decode step at batch 1 and 64 vs its roofline
  quantized            the 1B-shaped model with int8 weights and an int8 KV cache: step times vs bf16's
  structured           JSON-schema-constrained decoding (llguidance, from the device bundle): validity and tok/s

--budget_s (default 420 on an accelerator): the run's time budget. A stage starts while time is left and stops at
its own budget (STAGE_BUDGET_S), keeping the figures it reached; every figure goes to --out/accelerator.json as it
arrives, and if the budget runs out inside a stage a watchdog writes the report and ends the run (status 3).

--smoke (automatic on a CPU host): tiny shapes, the GPU and TPU kernels in interpret mode on CPU, JAX's own kernels
skipped, no budget. `run(smoke=True)` is the same in-process (tests). --parity_subprocess: greedy_parity's CPU side
in a subprocess even on a CPU host (the accelerator host's path; default: only off a CPU host).

    python -m serving.bench accelerator [--smoke] [--stages=attention,kv_write] [--workdir=DIR] [--out=DIR]
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import json
import os
import subprocess
import sys
import time
import zlib
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import jax_compat
import pallas_kernels
from pallas_kernels import reference
from pallas_kernels.cases import NAMED_CASES, TOLERANCES, dense_attention, make_case
from pallas_kernels.target import canonical_platform, tracing_for
from serving.bench.accelerator_models import (TINY_MODEL, stage_decode_roofline, stage_moe, stage_quantized,
                                              stage_structured)
from serving.bench.accelerator_models import TOKEN_BUDGET, write_llama  # noqa: F401 - re-exported (tests)
from serving.bench.accelerator_run import (Budget, Context, Report, StageFailure, StageOutOfTime, StageResult,
                                           StageSkipped, Watchdog, exit_status, first_line)
from serving.bench.accelerator_run import summary  # noqa: F401 - re-exported
from serving.bench.harness import BENCH_WORKDIR, median_time

_SMOKE = flags.DEFINE_bool("smoke", False, "tiny shapes, kernels in interpret mode on CPU (automatic on a CPU host)")
_STAGES = flags.DEFINE_list("stages", [], "stages to run (default: all, in order)")
_WORKDIR = flags.DEFINE_string("workdir", BENCH_WORKDIR, "where the benchmark models are written (and reused)")
_OUT = flags.DEFINE_string("out", "", "directory for accelerator.json (every figure, rewritten as each arrives) and "
                           "accelerator_summary.txt; empty: print only")
_PARITY_SUBPROCESS = flags.DEFINE_bool("parity_subprocess", None, "greedy_parity's CPU side in a JAX_PLATFORMS=cpu "
                                        "subprocess (default: unless this host is the CPU)")
_BUDGET = flags.DEFINE_float("budget_s", None, "the run's time budget in seconds (default: 420 on an accelerator, "
                             "none in smoke mode; 0: none)")

STAGES = ("environment", "attention", "kv_write", "greedy_parity", "decode_roofline", "attention_bandwidth", "moe",
          "quantized", "structured")
# Seconds each stage may take on an accelerator (its checkpoints stop it there; compiles included). In order of
# value: the first six take ~350 s of the default 420 s run; moe, quantized and structured get what remains.
STAGE_BUDGET_S = {"environment": 20, "attention": 90, "kv_write": 20, "greedy_parity": 60, "decode_roofline": 100,
                  "attention_bandwidth": 60, "moe": 60, "quantized": 60, "structured": 40}
DEFAULT_BUDGET_S = 420.0  # the run's: with the install, inside the 8 minutes scripts/device_accept.sh allows
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The packages whose versions the environment stage records (what the device image brings).
REPORTED_PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "libtpu", "flax", "orbax-checkpoint",
                     "optax", "numpy", "ml-dtypes", "triton", "grpcio", "protobuf", "tokenizers", "safetensors",
                     "transformers", "torch", "llguidance")


def _decodes(n: int, longest: int) -> Callable[[np.random.Generator], list]:
    """n decodes with random contexts up to `longest`, the first ones on and just past a page boundary."""
    def seqs(rng):
        ctx = [16, 17, 1, longest] + rng.integers(1, longest + 1, max(0, n - 4)).tolist()
        return [(1, int(c)) for c in ctx[:n]]
    return seqs


# Engine-shaped bf16 cases (page 16, GQA 4:1 and 8:1, head_dim 64 and 128): name: (seqs or a function of an rng
# giving them, shape, options).
ENGINE_CASES = {
    "decode_b64_d128_gqa4": (_decodes(64, 2048), dict(hq=32, hkv=8, d=128, ps=16), {}),
    "decode_b1_ctx4096_d64_gqa8": ([(1, 4096)], dict(hq=32, hkv=4, d=64, ps=16, t=8, s=4), {}),
    "decode_b8_d64_gqa4": (_decodes(8, 3000), dict(hq=32, hkv=8, d=64, ps=16, t=16, s=16), {}),
    "mixed_d128_gqa8": (lambda rng: _decodes(30, 3000)(rng) + [(256, 1280), (100, 100)],
                        dict(hq=32, hkv=4, d=128, ps=16, t=512, s=64), {}),
    "prefill_d64_gqa4": ([(512, 512), (300, 2048)], dict(hq=32, hkv=8, d=64, ps=16, t=1024, s=4), {}),
}
SMOKE_ENGINE_CASES = {
    "engine_bf16_d128_gqa4": ([(1, 40), (1, 16), (9, 25)], dict(hq=8, hkv=2, d=128, ps=16, t=16, s=4), {}),
}

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=True,
                bos_token_id=1, eos_token_id=2)
LLAMA_SMOKE = dict(LLAMA_1B, vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)

# ~0.5B parameters, 8 experts of which 2 per token (Mixtral's routing), 64-wide heads.
MIXTRAL_SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                     num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_local_experts=8,
                     num_experts_per_tok=2, max_position_embeddings=4096, tie_word_embeddings=False,
                     bos_token_id=1, eos_token_id=2)
MIXTRAL_SMOKE = dict(MIXTRAL_SHAPE, vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4)

PARITY_PROMPTS = ("def main():\n", "import os\nimport sys\n\n", 'class Config:\n    """', "for i in range(10):\n")


@dataclasses.dataclass(frozen=True)
class Sizes:
    named_cases: tuple[str, ...]
    engine_cases: dict
    kv_write_cases: tuple[dict, ...]  # dict(pages, ps, hkv, d, t, dtype)
    parity_tokens: int  # greedy tokens generated per prompt
    parity_required: int  # of which the first this many must agree on every prompt
    llama: dict
    decode_batches: tuple[int, ...]
    decode_context: int  # prompt tokens of each sequence before the timed decode steps
    decode_steps: int  # timed decode steps per batch (after every sequence has 4 tokens)
    copy_bytes: int  # the array copied to measure the bandwidth
    bandwidth_shapes: tuple[tuple[int, int], ...]  # (batch, context) of the decode-attention timing
    bandwidth_heads: tuple[int, int, int, int]  # (q heads, kv heads, head_dim, page_size)
    repeats: int  # timed calls per measurement (the median is reported)
    moe: dict  # the MoE stage's Mixtral config
    structured_batch: int  # sequences per structured-outputs cell
    structured_tokens: int  # max_tokens of each


FULL = Sizes(
    named_cases=tuple(NAMED_CASES), engine_cases=ENGINE_CASES,
    kv_write_cases=(dict(pages=5, ps=8, hkv=2, d=64, t=12, dtype="float32"),
                    dict(pages=64, ps=16, hkv=8, d=128, t=64, dtype="bfloat16"),
                    dict(pages=8, ps=16, hkv=8, d=64, t=8, dtype="bfloat16", all_padding=True)),
    parity_tokens=32, parity_required=16, llama=LLAMA_1B, decode_batches=(1, 64), decode_context=1024,
    decode_steps=32, copy_bytes=1 << 30, bandwidth_shapes=((1, 1024), (1, 8192), (64, 1024), (64, 8192)),
    bandwidth_heads=(32, 8, 128, 16), repeats=10, moe=MIXTRAL_SHAPE, structured_batch=16, structured_tokens=48)
SMOKE = Sizes(
    named_cases=("decode_only", "mixed_gqa8"), engine_cases=SMOKE_ENGINE_CASES,
    kv_write_cases=(dict(pages=5, ps=8, hkv=2, d=64, t=12, dtype="float32"),
                    dict(pages=8, ps=16, hkv=2, d=128, t=16, dtype="bfloat16")),
    parity_tokens=12, parity_required=8, llama=LLAMA_SMOKE, decode_batches=(1, 8), decode_context=48,
    decode_steps=6, copy_bytes=1 << 24, bandwidth_shapes=((1, 256), (4, 64)), bandwidth_heads=(8, 2, 64, 16),
    repeats=3, moe=MIXTRAL_SMOKE, structured_batch=4, structured_tokens=48)


# ------------------------------------------------------------------------------------------------ 1. environment
def stage_environment(ctx: Context) -> str:
    import jaxlib

    from serving.core.platform import platform_choices
    devices = jax.devices()
    platform = canonical_platform()
    kinds = sorted({d.device_kind for d in devices})
    ctx.note(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, python {sys.version.split()[0]} (meshserve "
             f"tested on jax {', '.join(jax_compat.TESTED_JAX)})")
    versions = {}
    for name in REPORTED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    ctx.note("packages: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    ctx.figure("python", sys.version.split()[0])
    ctx.figure("packages", versions)
    ctx.note(f"devices: {len(devices)} x {', '.join(kinds)} (platform {devices[0].platform}, default backend "
             f"{jax.default_backend()})")
    ctx.figure("devices", dict(count=len(devices), kinds=kinds, platform=devices[0].platform))
    try:
        limit = (devices[0].memory_stats() or {}).get("bytes_limit")
        if limit:
            ctx.note(f"device memory: {limit / 2**30:.1f} GiB")
            ctx.figure("device_memory_GiB", round(limit / 2**30, 1))
    except Exception:  # noqa: BLE001 - memory_stats is optional per backend
        pass
    choices = platform_choices(None, dtype="bfloat16")
    ctx.note("platform_choices(None, dtype='bfloat16'): " + ", ".join(
        f"{k}={v}" for k, v in dataclasses.asdict(choices).items()))
    ctx.figure("platform_choices", dataclasses.asdict(choices))
    detail = (f"{platform} ({', '.join(kinds)} x{len(devices)}), jax {jax.__version__}, attention "
              f"{choices.attention_backend}, KV {choices.kv_storage_dtype}")
    if platform in ("gpu", "tpu"):
        if choices.attention_backend != platform:
            raise StageFailure(f"{detail}: the engine would not run the {platform} attention kernel "
                               f"(MESHSERVE_ATTENTION={os.environ.get('MESHSERVE_ATTENTION')!r}?)")
        return detail
    if ctx.smoke:
        return detail + " (smoke mode: a CPU host passes)"
    raise StageFailure(f"{detail}: no GPU or TPU")


# ------------------------------------------------------------------------------------------------ 2. attention
def _build_case(name: str, spec, dtype):
    seqs, shape, options = spec
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    seqs = seqs(rng) if callable(seqs) else seqs
    case = make_case(rng, seqs, num_q_heads=shape["hq"], num_kv_heads=shape["hkv"], head_dim=shape["d"],
                     page_size=shape["ps"], num_tokens=shape.get("t"), num_seq_slots=shape.get("s"), dtype=dtype)
    return case, options


def attention_kernels(smoke: bool) -> dict[str, Callable]:
    """The attention kernels the attention stage checks: the entry point (the platform's compiled kernel), or in
    smoke mode the GPU and TPU kernels in interpret mode."""
    if smoke:
        from pallas_kernels import gpu, tpu
        return {"gpu-interpret": functools.partial(gpu.ragged_paged_attention_gpu, interpret=True),
                "tpu-interpret": functools.partial(tpu.ragged_paged_attention_tpu, interpret=True)}
    return {pallas_kernels.attention_backend(): pallas_kernels.ragged_paged_attention}


def _case_error(kernel, case, options, dtype_name: str, device) -> tuple[float, bool]:
    """(max |error| vs the oracle, within tolerance) of `kernel` on `case`."""
    d = case.q.shape[-1]
    fn = jax.jit(functools.partial(kernel, sm_scale=d ** -0.5, **options))
    args = [jax.device_put(np.asarray(a), device) for a in case.attention_args()]
    out = np.asarray(jax.device_get(fn(*args)).astype(np.float32), np.float64)
    want = dense_attention(case, sm_scale=d ** -0.5, **options)
    atol, rtol = TOLERANCES[dtype_name]
    err = np.abs(out - want)
    ok = bool(np.isfinite(out).all() and (err <= atol + rtol * np.abs(want)).all())
    return float(np.nan_to_num(err, nan=np.inf).max()), ok


def stage_attention(ctx: Context) -> str:
    device = jax.devices("cpu")[0] if ctx.smoke else jax.devices()[0]
    groups = [("named", "float32", {n: NAMED_CASES[n] for n in ctx.sizes.named_cases}),
              ("engine-shaped", "bfloat16", ctx.sizes.engine_cases)]
    failures, parts = [], []
    kernels = attention_kernels(ctx.smoke)
    total, done = len(kernels) * sum(len(c) for _, _, c in groups), 0
    for kname, kernel in kernels.items():
        for group, dtype_name, cases in groups:
            worst = 0.0
            for name, spec in cases.items():
                ctx.check_time(done, total, "cases")
                done += 1
                try:
                    case, options = _build_case(name, spec, jnp.dtype(dtype_name))
                    err, ok = _case_error(kernel, case, options, dtype_name, device)
                except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
                    failures.append(f"{kname} {name}: {first_line(e)}")
                    ctx.note(f"{kname} {name}: raised {first_line(e)}")
                    ctx.figure(f"{kname}/{name}", dict(raised=first_line(e)))
                    continue
                worst = max(worst, err)
                ctx.note(f"{kname} {name} ({dtype_name}, {len(case.q_lens)} seqs, {sum(case.q_lens)} tokens, "
                         f"KV up to {max(case.kv_lens)}): max |err| {err:.2e}{'' if ok else '  OUT OF TOLERANCE'}")
                ctx.figure(f"{kname}/{name}", dict(dtype=dtype_name, max_err=err, within_tolerance=ok))
                if not ok:
                    failures.append(f"{kname} {name} max |err| {err:.2e} > tol {TOLERANCES[dtype_name][0]:g}")
            parts.append(f"{kname} {len(cases)} {group} {dtype_name} max err {worst:.1e} "
                           f"(tol {TOLERANCES[dtype_name][0]:g})")
    if failures:
        raise StageFailure(f"{len(failures)} case(s) failed: " + "; ".join(failures[:3]))
    return "; ".join(parts)


# ------------------------------------------------------------------------------------------------ 3. KV write
def kv_writers(smoke: bool) -> dict[str, Callable]:
    """The KV writes the kv_write stage checks: the entry point (on the device), plus in smoke mode the TPU
    kernel in interpret mode."""
    writers = {f"entry point ({pallas_kernels.attention_backend()})": pallas_kernels.write_kv}
    if smoke:
        from pallas_kernels import tpu
        writers["tpu-interpret"] = functools.partial(tpu.write_kv_tpu, interpret=True)
    return writers


def expected_kv_write(cache: np.ndarray, k: np.ndarray, v: np.ndarray, slots: Sequence[int]) -> np.ndarray:
    """Host-side. The cache after writing each real token's k/v into its slot (K at 2h, V at 2h+1)."""
    p, ps, h2, d = cache.shape
    want = cache.copy().reshape(p * ps, h2, d)
    for t, slot in enumerate(slots):
        if slot >= 0:
            want[slot, 0::2] = k[t]
            want[slot, 1::2] = v[t]
    return want.reshape(cache.shape)


def _kv_write_inputs(spec: dict, seed: int):
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(spec["dtype"])
    p, ps, hkv, d, t = spec["pages"], spec["ps"], spec["hkv"], spec["d"], spec["t"]
    cache = rng.standard_normal((p, ps, 2 * hkv, d)).astype(dtype)
    k = rng.standard_normal((t, hkv, d)).astype(dtype)
    v = rng.standard_normal((t, hkv, d)).astype(dtype)
    slots = rng.choice(p * ps, t, replace=False).astype(np.int32)
    padding = np.ones(t, bool) if spec.get("all_padding") else rng.random(t) < 0.25
    slots[padding] = -1
    return cache, k, v, slots


def stage_kv_write(ctx: Context) -> str:
    # smoke mode: on CPU, traced for it (the entry point's CPU path, even on an accelerator host)
    with tracing_for("cpu" if ctx.smoke else None):
        return _kv_write_checks(ctx, jax.devices("cpu")[0] if ctx.smoke else jax.devices()[0])


def _kv_write_checks(ctx: Context, device) -> str:
    failures, checked = [], 0
    for wname, writer in kv_writers(ctx.smoke).items():
        # a fresh partial: a fresh trace (jit's cache does not key on the platform traced for)
        fn = jax.jit(functools.partial(writer), donate_argnums=0)
        for i, spec in enumerate(ctx.sizes.kv_write_cases):
            label = f"{wname} {spec['dtype']} pages={spec['pages']}x{spec['ps']} Hkv={spec['hkv']} D={spec['d']} " \
                    f"T={spec['t']}"
            try:
                cache, k, v, slots = _kv_write_inputs(spec, seed=i)
                out = np.asarray(jax.device_get(fn(*[jax.device_put(a, device) for a in (cache, k, v, slots)])))
                want = expected_kv_write(cache, k, v, slots)
                bad = np.any((out != want).reshape(out.shape[0] * out.shape[1], -1), axis=1)
                real = set(int(s) for s in slots if s >= 0)
                bad_real = sum(1 for s in np.flatnonzero(bad) if int(s) in real)
                checked += 1
                msg = (f"{len(real)} real tokens, {int((slots < 0).sum())} padding: "
                       + ("exact" if not bad.any() else
                          f"{int(bad.sum())} slots wrong ({bad_real} of the written, {int(bad.sum()) - bad_real} "
                          "that should be untouched)"))
                ctx.note(f"{label}: {msg}")
                ctx.figure(label, dict(real_tokens=len(real), wrong_slots=int(bad.sum())))
                if bad.any():
                    failures.append(f"{label}: {msg}")
            except Exception as e:  # noqa: BLE001
                ctx.note(f"{label}: raised {first_line(e)}")
                failures.append(f"{label}: {first_line(e)}")
    if failures:
        raise StageFailure("; ".join(failures[:3]))
    return f"{checked} writes exact ({', '.join(kv_writers(ctx.smoke))})"


# ------------------------------------------------------------------------------------------------ 4. greedy parity
PARITY_OPTIONS = dict(dtype="float32", page_size=16, num_pages=256, max_num_seqs=8, max_num_batched_tokens=128)

_PARITY_SNIPPET = """
import json, sys
import jax
from serving.core.llm import LLM
from serving.params import SamplingParams
model, prompts, n, options = json.loads(sys.argv[1])
with jax.default_matmul_precision("highest"):
    llm = LLM(model, warmup=False, **options)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
print("TOKENS " + json.dumps([[int(t) for t in o.token_ids] for o in outs]))
"""


def greedy_tokens(model: str, prompts: Sequence[str], n: int) -> list[list[int]]:
    """Greedy token ids (float32, highest matmul precision) of `prompts` in this process, on the default device."""
    from serving.core.llm import LLM
    from serving.params import SamplingParams
    with jax.default_matmul_precision("highest"):
        llm = LLM(model, warmup=False, **PARITY_OPTIONS)
        outs = llm.generate(list(prompts), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return [[int(t) for t in o.token_ids] for o in outs]


def start_cpu_greedy_tokens(model: str, prompts: Sequence[str], n: int) -> subprocess.Popen:
    """`greedy_tokens` in a CPU subprocess (JAX_PLATFORMS=cpu) started now, to run beside the device side. XLA's CPU
    kernels (MESHSERVE_CPU_KERNELS=xla: the same results) spare a device machine the native kernels' C++ build."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", MESHSERVE_CPU_KERNELS="xla")
    env.pop("MESHSERVE_ATTENTION", None)
    arg = json.dumps([model, list(prompts), n, PARITY_OPTIONS])
    return subprocess.Popen([sys.executable, "-c", _PARITY_SNIPPET, arg], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)


def cpu_greedy_tokens(proc: subprocess.Popen, timeout_s: float) -> list[list[int]]:
    """The tokens of a `start_cpu_greedy_tokens` subprocess (killed past `timeout_s`)."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise StageFailure(f"the CPU subprocess did not finish in {timeout_s:.0f}s") from None
    for line in stdout.splitlines():
        if line.startswith("TOKENS "):
            return json.loads(line[len("TOKENS "):])
    tail = (stderr.strip().splitlines() or ["no output"])[-1]
    raise RuntimeError(f"the CPU subprocess exited {proc.returncode}: {tail}")


def agreeing_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def stage_greedy_parity(ctx: Context) -> str:
    n, need = ctx.sizes.parity_tokens, ctx.sizes.parity_required
    proc = start_cpu_greedy_tokens(TINY_MODEL, PARITY_PROMPTS, n) if ctx.parity_subprocess else None
    try:
        device = greedy_tokens(TINY_MODEL, PARITY_PROMPTS, n)
    except BaseException:
        if proc is not None:
            proc.kill()
            proc.communicate()
        raise
    # the CPU side: whatever is left of the stage's budget (at least a minute: it is the reference)
    cpu = (cpu_greedy_tokens(proc, max(60.0, min(300.0, ctx.budget.stage_left()))) if proc is not None
           else greedy_tokens(TINY_MODEL, PARITY_PROMPTS, n))
    where = "CPU subprocess" if ctx.parity_subprocess else "CPU in-process (this host is the CPU)"
    agree = [agreeing_prefix(a, b) for a, b in zip(device, cpu)]
    for prompt, a, b, k in zip(PARITY_PROMPTS, device, cpu, agree):
        ctx.note(f"{prompt!r}: {k}/{n} agree; {jax.default_backend()} {a[:8]}... vs cpu {b[:8]}...")
    ctx.figure("agreeing_prefix", dict(per_prompt=agree, of=n, need=need))
    ctx.figure("tokens", dict(device=device, cpu=cpu))
    detail = (f"models/tiny/target float32 greedy, {jax.default_backend()} vs {where}: tokens agreeing from the "
              f"start per prompt {agree} of {n} (need {need})")
    if len(device) != len(PARITY_PROMPTS) or len(cpu) != len(PARITY_PROMPTS) or min(agree) < need:
        raise StageFailure(detail)
    return detail


# ------------------------------------------------------------------------------------------------ 6. attention GB/s
@dataclasses.dataclass(frozen=True)
class DecodeShape:
    batch: int
    context: int
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: str = "bfloat16"

    @property
    def pages_per_seq(self) -> int:
        """Block-table width: the context's pages rounded up so JAX's GPU kernel can split it into min(16, width)
        partitions of whole compute blocks (<= 8 pages): a power of two up to 16, then a multiple of 16 up to 128,
        then of 128."""
        pages = -(-self.context // self.page_size)
        if pages <= 16:
            return 1 << (pages - 1).bit_length()
        step = 16 if pages <= 128 else 128
        return -(-pages // step) * step

    @property
    def kv_bytes(self) -> int:
        """KV bytes a decode step reads: every sequence's context, K and V."""
        return self.batch * self.context * 2 * self.kv_heads * self.head_dim * jnp.dtype(self.dtype).itemsize


def decode_inputs(key, shape: DecodeShape):
    """Pure (traceable: `jax.eval_shape` gives the abstract inputs). A decode batch in the ragged layout: q, kv_pages,
    kv_lens, page_indices, cu_q_lens, num_seqs; pages scattered at random over the cache."""
    b, pps = shape.batch, shape.pages_per_seq
    num_pages = b * pps + 1
    kq, kkv, kp = jax.random.split(key, 3)
    dtype = jnp.dtype(shape.dtype)
    q = jax.random.normal(kq, (b, shape.q_heads, shape.head_dim), jnp.float32).astype(dtype)
    kv_pages = jax.random.normal(kkv, (num_pages, shape.page_size, 2 * shape.kv_heads, shape.head_dim),
                                 jnp.float32).astype(dtype)
    page_indices = jax.random.permutation(kp, num_pages)[:b * pps].reshape(b, pps).astype(jnp.int32)
    kv_lens = jnp.full((b,), shape.context, jnp.int32)
    cu_q_lens = jnp.arange(b + 1, dtype=jnp.int32)
    return q, kv_pages, kv_lens, page_indices, cu_q_lens, jnp.array([b], jnp.int32)


def to_jax_layout(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale):
    """Pure. The ragged decode inputs in the layout of JAX's Pallas paged attention (gpu and tpu alike): q
    pre-scaled by sm_scale (JAX's kernels apply none), k_pages / v_pages `[Hkv, P, page_size, D]`, lengths,
    block tables."""
    del cu_q_lens, num_seqs  # decode: one token per sequence, every slot real
    p, ps, h2, d = kv_pages.shape
    kv = kv_pages.reshape(p, ps, h2 // 2, 2, d)
    k_pages = kv[:, :, :, 0].transpose(2, 0, 1, 3)
    v_pages = kv[:, :, :, 1].transpose(2, 0, 1, 3)
    return (q.astype(jnp.float32) * sm_scale).astype(q.dtype), k_pages, v_pages, kv_lens, page_indices


def decode_attention_impls(platform: str, shape: DecodeShape, *, include_jax: bool = True) -> dict:
    """name -> (jitted fn, 'ragged' | 'jax': the layout of the inputs it takes) for the bandwidth stage: ours (the
    entry point), the XLA reference, and JAX's Pallas paged attention of `platform` (gpu/tpu)."""
    sm_scale = shape.head_dim ** -0.5
    impls = {
        "ours": (jax.jit(functools.partial(pallas_kernels.ragged_paged_attention, sm_scale=sm_scale)), "ragged"),
        "xla-reference": (jax.jit(functools.partial(reference.ragged_paged_attention_reference, sm_scale=sm_scale)),
                          "ragged"),
    }
    if include_jax and platform == "gpu":
        jax_compat.allow_gpu_lowering_without_gpu()  # the lowering tests (JAX >= 0.11 asks for the GPU model)
        pps = shape.pages_per_seq
        k_splits = min(16, pps)

        def jax_gpu_fn(q, k_pages, v_pages, lengths, block_tables):
            return jax_compat.jax_gpu_paged_attention(q, k_pages, v_pages, block_tables, lengths, k_splits=k_splits)
        impls["jax-pallas-gpu"] = (jax.jit(jax_gpu_fn), "jax")
    elif include_jax and platform == "tpu":
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as jax_tpu
        block = max(1, min(shape.pages_per_seq, 128 // shape.page_size))
        impls["jax-pallas-tpu"] = (jax.jit(functools.partial(jax_tpu, pages_per_compute_block=block)), "jax")
    return impls


def stage_attention_bandwidth(ctx: Context) -> str:
    platform = canonical_platform()
    hq, hkv, d, ps = ctx.sizes.bandwidth_heads
    atol, rtol = TOLERANCES["bfloat16"]
    parts, failures = [], []
    for i, (batch, context) in enumerate(ctx.sizes.bandwidth_shapes):
        ctx.check_time(i, len(ctx.sizes.bandwidth_shapes), "shapes")
        shape = DecodeShape(batch, context, hq, hkv, d, ps)
        ragged = jax.jit(decode_inputs, static_argnums=1)(jax.random.PRNGKey(i), shape)
        jax_args = jax.block_until_ready(jax.jit(functools.partial(to_jax_layout, sm_scale=d ** -0.5))(*ragged))
        outs, rates = {}, {}
        for name, (fn, layout) in decode_attention_impls(platform, shape, include_jax=not ctx.smoke).items():
            args = ragged if layout == "ragged" else jax_args
            try:
                t = median_time(lambda: jax.block_until_ready(fn(*args)), ctx.sizes.repeats)
                outs[name] = np.asarray(jax.device_get(fn(*args)).astype(jnp.float32))
                rates[name] = shape.kv_bytes / t
            except Exception as e:  # noqa: BLE001 - JAX's kernels may reject a shape; ours must not
                ctx.note(f"b={batch} ctx={context}: {name} raised {first_line(e)}")
                if name == "ours":
                    failures.append(f"b={batch} ctx={context}: ours raised {first_line(e)}")
        want = outs.get("xla-reference")
        errs = {}
        for name, o in outs.items():
            if want is not None and name != "xla-reference":
                errs[name] = float(np.abs(o - want).max())
                if name == "ours" and not np.all(np.abs(o - want) <= atol + rtol * np.abs(want)):
                    failures.append(f"b={batch} ctx={context}: ours differs from the reference by {errs[name]:.2e}")
        cells = ", ".join(f"{n} {r / 1e9:.1f} GB/s" + (f" (max |diff| vs ref {errs[n]:.1e})" if n in errs else "")
                          for n, r in rates.items())
        ctx.note(f"b={batch} ctx={context} Hq={hq} Hkv={hkv} D={d} page={ps} bf16, KV {shape.kv_bytes / 1e6:.1f} MB: "
                 f"{cells}")
        ctx.figure(f"b{batch}_ctx{context}", dict(kv_bytes=shape.kv_bytes, GBps={n: round(r / 1e9, 2) for n, r in
                                                                                 rates.items()},
                                                  max_diff_vs_reference=errs))
        parts.append(f"b{batch}/ctx{context} " + "/".join(f"{rates[n] / 1e9:.0f}" for n in rates))
    names = list(decode_attention_impls(platform, DecodeShape(1, 16, hq, hkv, d, ps), include_jax=not ctx.smoke))
    if failures:
        raise StageFailure("; ".join(failures[:3]))
    detail = f"GB/s {'/'.join(names)}: " + ", ".join(parts)
    if ctx.smoke:
        detail += " (note: JAX's Pallas GPU/TPU paged attention skipped in smoke mode)"
    elif platform not in ("gpu", "tpu"):
        detail += f" (note: JAX's Pallas paged attention has no {platform} kernel)"
    return detail


# ------------------------------------------------------------------------------------------------ the run
STAGE_FUNCTIONS: dict[str, Callable[[Context], str]] = {
    "environment": stage_environment,
    "attention": stage_attention,
    "kv_write": stage_kv_write,
    "greedy_parity": stage_greedy_parity,
    "decode_roofline": stage_decode_roofline,
    "attention_bandwidth": stage_attention_bandwidth,
    "moe": stage_moe,
    "quantized": stage_quantized,
    "structured": stage_structured,
}


def run(smoke: bool = False, stages: Sequence[str] | None = None, *, workdir: str = BENCH_WORKDIR,
        parity_subprocess: bool | None = None, out: Callable[[str], None] | None = None, out_dir: str = "",
        budget_s: float | None = None, stage_budgets: dict[str, float] | None = None) -> list[StageResult]:
    """Runs `stages` (default all, in order), printing each one's information lines and its result line, then the
    summary line; returns the results, and with `out_dir` writes accelerator.json / accelerator_summary.txt as it
    goes. Smoke mode is forced on a CPU host. `budget_s`: the run's budget (None: DEFAULT_BUDGET_S on an
    accelerator, none in smoke mode; 0: none); `stage_budgets`: per stage (default STAGE_BUDGET_S; none in smoke
    mode). `parity_subprocess`: the greedy parity's CPU side in a subprocess (default: unless this host is the
    CPU)."""
    out = out or (lambda line: print(line, flush=True))
    stages = list(stages or STAGES)
    unknown = [s for s in stages if s not in STAGE_FUNCTIONS]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; expected some of {list(STAGES)}")
    platform = canonical_platform()
    smoke = smoke or platform == "cpu"
    if parity_subprocess is None:
        parity_subprocess = platform != "cpu"
    if budget_s is None:
        budget_s = None if smoke else DEFAULT_BUDGET_S
    if stage_budgets is None:
        stage_budgets = {} if smoke else STAGE_BUDGET_S
    budget = Budget(budget_s or None)
    report = Report(out_dir, dict(platform=platform, device_kind=jax.devices()[0].device_kind, smoke=smoke,
                                  stages=stages, budget_s=budget.total_s, jax=jax.__version__,
                                  started=time.strftime("%Y-%m-%dT%H:%M:%S%z")))
    ctx = Context(smoke, SMOKE if smoke else FULL, workdir, parity_subprocess, out, report, budget)
    os.makedirs(workdir, exist_ok=True)
    out(f"accelerator acceptance on {platform} ({jax.devices()[0].device_kind})"
        f"{', smoke mode' if smoke else ''}{f', budget {budget.total_s:.0f}s' if budget.total_s else ''}: "
        f"{', '.join(stages)}")
    watchdog = Watchdog(report, budget, out)
    watchdog.start()
    results = []
    try:
        for name in stages:
            t0 = time.perf_counter()
            if not budget.begin_stage(stage_budgets.get(name)):
                result = StageResult(name, "not_reached", f"the run's budget of {budget.total_s:.0f}s was spent",
                                     0.0)
            else:
                ctx.stage = name
                watchdog.current = (name, budget.clock())
                report.stage(name, status="running", budget_s=budget.stage_budget_s)
                try:
                    result = StageResult(name, "pass", STAGE_FUNCTIONS[name](ctx), time.perf_counter() - t0)
                except Exception as e:  # noqa: BLE001 - a failing stage is reported and the run goes on
                    status = ("skip" if isinstance(e, StageSkipped) else "timeout" if isinstance(e, StageOutOfTime)
                              else "fail")
                    result = StageResult(name, status, first_line(e), time.perf_counter() - t0)
                watchdog.current = None
            results.append(result)
            watchdog.results = list(results)
            report.result(result, budget.stage_budget_s)
            out(result.line)
    finally:
        watchdog.stop()
    out(report.finish(results, budget.clock() - budget.start))
    return results


def main() -> None:
    unknown = [s for s in _STAGES.value if s not in STAGES]
    if unknown:
        raise app.UsageError(f"--stages: unknown {unknown}; expected some of {', '.join(STAGES)}")
    results = run(smoke=_SMOKE.value, stages=_STAGES.value or None, workdir=_WORKDIR.value, out_dir=_OUT.value,
                  budget_s=_BUDGET.value, parity_subprocess=_PARITY_SUBPROCESS.value)
    status = exit_status(results)
    if status:
        sys.exit(status)
