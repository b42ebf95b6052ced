"""The acceptance run's stages that time whole engines on random-weight models (`serving.bench accelerator`): the bf16
decode step against the HBM roofline, then, if time remains, an MoE model's step, int8 weights + int8 KV, and
JSON-schema-constrained decoding; the models are written once under the workdir with transformers (the test extras
here, the image's own on the device)."""
from __future__ import annotations

import importlib.util
import json
import os
import statistics
import time

import jax
import numpy as np

from serving.bench.accelerator_run import Context, StageFailure, StageSkipped
from serving.bench.harness import copy_bandwidth, decode_step_times, hf_checkpoint

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_MODEL = os.path.join(REPO_ROOT, "models", "tiny", "target")
TOKEN_BUDGET = 512  # the decode-roofline engine's max_num_batched_tokens
SKIP_STEPS = 2  # whole-batch decode steps not timed (the first runs the decode bucket's compile)
# The structured stage's schema: small and finite (enums, a boolean, a constant), so every output completes.
ENUM_SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}, "ok": {"type": "boolean"},
    "kind": {"const": "shirt"}}, "required": ["color", "size", "ok", "kind"], "additionalProperties": False}
STRUCTURED_PROMPT = "<|im_start|>user\nDescribe a shirt as JSON.<|im_end|>\n<|im_start|>assistant\n"


def write_hf_model(family: str, config: dict, name: str, workdir: str) -> str:
    """The directory of a random-weight bf16 model of transformers' `{family}Config(**config)` under `workdir`
    (`harness.hf_checkpoint`: written once, reused while it holds that)."""
    return hf_checkpoint(os.path.join(workdir, f"{name}-bfloat16"), family, config, "bfloat16")


def write_llama(config: dict, name: str, workdir: str) -> str:
    return write_hf_model("Llama", config, name, workdir)


def measured_bandwidth(ctx: Context) -> float:
    """The copy bandwidth, measured once per run (the first stage that needs it records it)."""
    done = [st["figures"]["copy_GBps"] for st in ctx.report.data["stages"].values() if "copy_GBps" in st["figures"]]
    if done:
        return done[0] * 1e9
    bw = copy_bandwidth(ctx.sizes.copy_bytes)
    ctx.note(f"copy bandwidth: {bw / 1e9:.1f} GB/s (jitted copy of {ctx.sizes.copy_bytes / 2**20:.0f} MiB, 2x bytes)")
    ctx.figure("copy_GBps", round(bw / 1e9, 1))
    return bw


def _decode_max_tokens(batch: int, context: int, steps: int) -> int:
    """Output tokens per request: enough that no sequence finishes before the last one's prefill is done (the
    first ones decode during the others' prefill) and the whole-batch decode steps follow."""
    prefill_steps = -(-batch * context // max(1, TOKEN_BUDGET - batch)) + 2
    return prefill_steps + SKIP_STEPS + steps + 4


def timed_decode_steps(engine, prompts: list[list[int]], steps: int):
    """`harness.decode_step_times` of `steps` whole-batch greedy decode steps (the first SKIP_STEPS untimed), with
    enough output tokens that every prompt's prefill is done before they start."""
    from serving.params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=_decode_max_tokens(len(prompts), max(map(len, prompts)), steps),
                            ignore_eos=True)
    return decode_step_times(engine, prompts, params, warm_tokens=0, skip_steps=SKIP_STEPS, steps=steps)


def _bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _decode_engine(model_dir: str, ctx: Context, **options):
    """An LLM sized for the decode timings of `ctx.sizes` (every batch's context and steps fit its pages)."""
    from serving.core.llm import LLM
    s = ctx.sizes
    max_batch, ps = max(s.decode_batches), 16
    max_len = s.decode_context + _decode_max_tokens(max_batch, s.decode_context, s.decode_steps) + 16
    return LLM(model_dir, warmup=False, dtype="bfloat16", page_size=ps, num_pages=max_batch * -(-max_len // ps) + 16,
               max_num_seqs=max_batch, max_num_batched_tokens=TOKEN_BUDGET, max_model_len=max_len, **options)


def time_decode(ctx: Context, llm, vocab: int, label: str, weight_bytes_for=None) -> list[str]:
    """Times the decode step at each of `ctx.sizes.decode_batches` (stopping at the stage's budget) against the
    roofline (weight + KV bytes read / the copy bandwidth); records each batch's figures under `label`. The weights
    read per step are all of them, or `weight_bytes_for(batch)` (MoE: the experts a batch touches)."""
    s, eng = ctx.sizes, llm.engine
    bw = measured_bandwidth(ctx)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(eng.runner.state))
    caches = eng.runner.kv_caches  # bytes per cached token, every layer (a quantized cache's scales too)
    kv_token_bytes = sum(x.nbytes for x in jax.tree.leaves(caches)) / (eng.num_pages * eng.config.page_size)
    rng = np.random.default_rng(0)
    parts = []
    for i, batch in enumerate(s.decode_batches):
        ctx.check_time(i, len(s.decode_batches), "batch sizes")
        prompts = [rng.integers(10, vocab, s.decode_context).tolist() for _ in range(batch)]
        timed = timed_decode_steps(eng, prompts, s.decode_steps)
        if len(timed.times) < 3:
            raise StageFailure(f"{label} batch {batch}: {len(timed.times)} whole-batch decode steps (need 3 or more)")
        step = statistics.median(timed.times)
        kv_tokens = statistics.mean(timed.kv_tokens)
        kv_bytes = kv_tokens * kv_token_bytes
        weights = weight_bytes if weight_bytes_for is None else weight_bytes_for(batch)
        roof = (weights + kv_bytes) / bw
        ctx.note(f"{label} batch {batch}, context ~{kv_tokens / batch:.0f}: {step * 1e3:.2f} ms/step (median of "
                 f"{len(timed.times)}), roofline {roof * 1e3:.3f} ms (weights {_bytes(weights)} + KV "
                 f"{_bytes(kv_bytes)} at "
                 f"{bw / 1e9:.0f} GB/s), roofline/step {roof / step:.2f}, {batch / step:.0f} tok/s")
        ctx.figure(f"{label}_b{batch}", dict(step_ms=round(step * 1e3, 3), roofline_ms=round(roof * 1e3, 4),
                                             roofline_over_step=round(roof / step, 3), tok_s=round(batch / step, 1),
                                             weight_bytes=int(weights), kv_bytes=int(kv_bytes), steps=len(timed.times)))
        parts.append(f"b{batch} {step * 1e3:.2f} ms vs roofline {roof * 1e3:.3f} ms ({roof / step:.2f})")
    return parts


def stage_decode_roofline(ctx: Context) -> str:
    cfg = ctx.sizes.llama
    model_dir = write_llama(cfg, "llama1b-shape" if not ctx.smoke else "llama-smoke", ctx.workdir)
    bw = measured_bandwidth(ctx)
    llm = _decode_engine(model_dir, ctx)
    parts = time_decode(ctx, llm, cfg["vocab_size"], "bf16")
    del llm
    shape = f"{cfg['num_hidden_layers']}L h{cfg['hidden_size']}"
    return f"{shape} bf16: " + "; ".join(parts) + f"; copy {bw / 1e9:.0f} GB/s"


# ------------------------------------------------------------------------------------------------ MoE
def stage_moe(ctx: Context) -> str:
    """A Mixtral-shaped random model's decode step (the platform's MoE path) at each batch size, against the
    roofline of the weights the batch reads: the dense part plus the experts it is expected to touch (uniform
    routing: E * (1 - (1 - k/E)^batch) per layer)."""
    cfg = ctx.sizes.moe
    model_dir = write_hf_model("Mixtral", cfg, "mixtral-shape" if not ctx.smoke else "mixtral-smoke", ctx.workdir)
    llm = _decode_engine(model_dir, ctx)
    e, k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    expert_bytes = 3 * cfg["hidden_size"] * cfg["intermediate_size"] * 2 * cfg["num_hidden_layers"]  # one expert
    total = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.state))
    dense = total - e * expert_bytes

    def weights(batch):
        return dense + e * (1 - (1 - k / e) ** batch) * expert_bytes
    parts = time_decode(ctx, llm, cfg["vocab_size"], "moe", weights)
    del llm
    return f"{cfg['num_hidden_layers']}L h{cfg['hidden_size']} {e} experts top-{k} bf16: " + "; ".join(parts)


# ------------------------------------------------------------------------------------------------ quantized
def stage_quantized(ctx: Context) -> str:
    """The decode-roofline model with int8 weights and an int8 KV cache: step times against their roofline and
    against the bf16 steps of the decode_roofline stage when it ran."""
    cfg = ctx.sizes.llama
    model_dir = write_llama(cfg, "llama1b-shape" if not ctx.smoke else "llama-smoke", ctx.workdir)
    llm = _decode_engine(model_dir, ctx, quantization="int8", kv_cache_dtype="int8")
    parts = time_decode(ctx, llm, cfg["vocab_size"], "int8")
    del llm
    bf16 = ctx.report.data["stages"].get("decode_roofline", {}).get("figures", {})
    mine = ctx.report.data["stages"]["quantized"]["figures"]
    speedups = []
    for batch in ctx.sizes.decode_batches:
        a, b = bf16.get(f"bf16_b{batch}"), mine.get(f"int8_b{batch}")
        if a and b:
            ctx.figure(f"speedup_vs_bf16_b{batch}", round(a["step_ms"] / b["step_ms"], 3))
            speedups.append(f"b{batch} {a['step_ms'] / b['step_ms']:.2f}x")
    return "int8 weights + int8 KV: " + "; ".join(parts) + (f"; vs bf16 {', '.join(speedups)}" if speedups else "")


# ------------------------------------------------------------------------------------------------ structured
def stage_structured(ctx: Context) -> str:
    """JSON-schema-constrained decoding on the shipped tiny model (the grammar masks built on the host, applied on
    the device): every constrained output is JSON of the schema's keys, and tokens/s with and without the
    constraint at one batch size. Needs llguidance (carried in the device bundle)."""
    if importlib.util.find_spec("llguidance") is None:
        raise StageSkipped("llguidance is not installed (it is in the device bundle: scripts/device_bundle.sh)")
    from serving.core.llm import LLM
    from serving.params import SamplingParams, StructuredOutput
    batch, tokens = ctx.sizes.structured_batch, ctx.sizes.structured_tokens
    # no prefix cache: the timed run of a cell takes the programs its untimed first run compiled
    llm = LLM(TINY_MODEL, warmup=False, dtype="bfloat16", max_num_seqs=batch, max_num_batched_tokens=256,
              enable_prefix_caching=False)
    spec = StructuredOutput(json_schema=json.dumps(ENUM_SCHEMA))
    rates = {}
    for i, (name, structured) in enumerate((("free", None), ("constrained", spec))):
        ctx.check_time(i, 2, "cells")
        params = SamplingParams(temperature=1.0, max_tokens=tokens, structured=structured, seed=7,
                                ignore_eos=structured is None)
        llm.generate([STRUCTURED_PROMPT] * batch, params)  # compiles this cell's programs
        t0 = time.perf_counter()
        outs = llm.generate([STRUCTURED_PROMPT] * batch, params)
        elapsed = time.perf_counter() - t0
        rates[name] = sum(len(o.token_ids) for o in outs) / elapsed
        ctx.figure(f"{name}_tok_s", round(rates[name], 1))
        if structured is not None:
            bad = []
            for o in outs:
                try:
                    value = json.loads(o.text)
                    ok = set(value) == set(ENUM_SCHEMA["required"]) and value["kind"] == "shirt"
                except (ValueError, TypeError):
                    ok = False
                if not ok or o.finish_reason != "stop":
                    bad.append(f"{o.finish_reason}: {o.text[:60]!r}")
            ctx.figure("invalid_outputs", len(bad))
            if bad:
                raise StageFailure(f"{len(bad)} of {batch} constrained outputs are not the schema's JSON: {bad[0]}")
    so = llm.engine.structured
    mask_ms = 1e3 * so.mask_time_s / max(1, so.mask_steps)
    ctx.figure("mask_ms_per_step", round(mask_ms, 3))
    return (f"batch {batch}: {batch} constrained outputs valid JSON; {rates['constrained']:.0f} tok/s constrained vs "
            f"{rates['free']:.0f} free; masks {mask_ms:.2f} ms/step on the host")
