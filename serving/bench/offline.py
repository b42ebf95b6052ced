"""Offline benchmarks of the serving core on a ~125M-parameter Llama built locally (random weights).

    python -m serving.bench offline [--only=throughput,llamacpp,startup,batching,prefix,chunked,host,roofline,floor]
                                    [--dtypes=float32,bfloat16] [--quick]

Every figure that is a comparison is measured side by side in one run (absolute times on a shared machine
are noisy; ratios less so). Prints a table per benchmark.
"""
from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from absl import flags

from serving.bench.harness import BENCH_WORKDIR, LLAMA_125M, cpu_path, decode_step_bytes, decode_step_times, \
    fresh_prompts, llama_125m, median_time, random_prompts, read_bandwidth, table

_ONLY = flags.DEFINE_list("only", ["throughput", "llamacpp", "startup", "batching", "prefix", "chunked", "host",
                                   "roofline", "floor"],
                          "benchmarks to run")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "dtypes for the throughput benchmark")
_WORKDIR = flags.DEFINE_string("workdir", BENCH_WORKDIR, "where the benchmark model is written")
_QUICK = flags.DEFINE_bool("quick", False, "smaller workloads (for a smoke run)")
_HF_BASELINE = flags.DEFINE_bool("hf_baseline", True, "also time HF transformers generate")


def _cached_tokens(llm) -> int:
    """Prompt tokens the engine has served from its prefix cache so far (a cell's count is the difference)."""
    return llm.engine.scheduler.prefix_cache_hits


def _llm(dtype: str, **options):
    from serving.core.llm import LLM
    base = dict(dtype=dtype, page_size=16, num_pages=4096, max_num_seqs=16, max_num_batched_tokens=256)
    base.update(options)
    return LLM(llama_125m(dtype, _WORKDIR.value), **base)


def _greedy(max_tokens: int):
    from serving.params import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


# ---------------------------------------------------------------------------------------------------------------


def bench_throughput():
    """16 prompts x 128 tokens in, 128 out: all at once and one at a time; meshserve vs HF generate. Every timed
    pass takes prompts no earlier pass has used (no prefix-cache hits; the cells print the cached tokens)."""
    n_in, n_out = 128, (32 if _QUICK.value else 128)
    rows = []
    for dtype in _DTYPES.value:
        llm = _llm(dtype)
        llm.generate(fresh_prompts(16, n_in), _greedy(n_out))  # first touch of the KV pages and the programs
        eng = llm.engine
        screen = eng.runner.screen_greedy
        cached = {"b16": 0, "b1": 0}

        def batch16():
            prompts, hits = fresh_prompts(16, n_in), _cached_tokens(llm)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, _greedy(n_out))
            rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
            cached["b16"] += _cached_tokens(llm) - hits
            return rate

        def batch1(prompt, screened: bool) -> float:
            eng.runner.screen_greedy = screened
            hits = _cached_tokens(llm)
            t0 = time.perf_counter()
            llm.generate([prompt], _greedy(n_out))
            took = time.perf_counter() - t0
            cached["b1"] += _cached_tokens(llm) - hits
            return took

        # Async scheduling on, then off (the same engine); batch 1 with and without the LM head's int8 screen
        # alternating request by request (the machine's speed drifts over minutes).
        eng.look_ahead = eng.config.async_scheduling
        ms16 = batch16()
        b1 = {True: 0.0, False: 0.0}
        for _ in range(4):
            for screened in ((True, False) if screen else (False,)):
                b1[screened] += batch1(fresh_prompts(1, n_in)[0], screened)
        eng.look_ahead = False
        sync16 = batch16()
        sync1 = 4 * n_out / sum(batch1(fresh_prompts(1, n_in)[0], screen) for _ in range(4))
        del llm, eng
        ms1 = 4 * n_out / b1[screen]
        full1 = 4 * n_out / b1[False] if screen else "-"
        hf16 = hf1 = float("nan")
        if _HF_BASELINE.value:
            hf16, hf1 = _hf_throughput(dtype, fresh_prompts(16, n_in), n_out)
        rows.append([dtype, cpu_path(), ms16, sync16, hf16, ms16 / hf16, ms1, sync1, full1, hf1, ms1 / hf1,
                     f"{cached['b16']} / {cached['b1']}"])
    table("Output tokens/s, 16 x (128 in, %d out), greedy (sync: async scheduling off; full head: batch 1 "
          "without the LM head's int8 screen; cached: prompt tokens served from the prefix cache in the b16 / b1 "
          "cells)" % n_out,
          ["dtype", "meshserve kernels", "meshserve b16", "sync", "HF b16", "ratio", "meshserve b1", "sync",
           "full head", "HF b1", "ratio", "cached"], rows)


def _hf_throughput(dtype: str, prompts, n_out: int) -> tuple[float, float]:
    import torch
    import transformers as tf
    model = tf.AutoModelForCausalLM.from_pretrained(llama_125m(dtype, _WORKDIR.value),
                                                    dtype=getattr(torch, dtype)).eval()
    kw = dict(max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(torch.tensor(prompts[:1]), max_new_tokens=2, do_sample=False, pad_token_id=0)
        t0 = time.perf_counter()
        model.generate(torch.tensor(prompts), **kw)
        hf16 = 16 * n_out / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for p in prompts[:4]:
            model.generate(torch.tensor([p]), **kw)
        hf1 = 4 * n_out / (time.perf_counter() - t0)
    return hf16, hf1


def bench_llamacpp():
    """meshserve and llama.cpp (the batch-1 bars of #3 are llama.cpp's) on the same checkpoint: the benchmark
    model written as GGUF in its own dtype (`serving.bench.llamacpp`), the same prompts, greedy, 16 x (128 in, 128
    out) all at once and 4 of them one at a time, in one process, interleaved round by round (the order flipped
    each round), each round on prompts no earlier round used (neither side reads them from a cache). llama.cpp runs
    with its defaults (all CPUs, f16 KV cache, weights mmapped); its column names the instruction sets its build
    uses (a build for AVX2 only: see BUILD.md). "tokens agree": the mean share of the 16 greedy outputs both
    produce identically from the start (random weights leave near-ties that accumulation order and llama.cpp's f16
    KV cache decide differently after a while)."""
    from serving.bench import llamacpp
    if not llamacpp.available():
        print("\n## llama.cpp side by side: not run: llama-cpp-python is not installed "
              "(`.venv/bin/pip install -e '.[llamacpp]'` builds it, ~6 min)")
        return
    n_in, n_out = 128, (32 if _QUICK.value else 128)
    rows = []
    for dtype in _DTYPES.value:
        hf_dir = llama_125m(dtype, _WORKDIR.value)
        path = os.path.join(_WORKDIR.value, f"llama125m-{dtype}.gguf")
        if not os.path.exists(path) or os.path.getmtime(path) < os.path.getmtime(os.path.join(hf_dir, "config.json")):
            llamacpp.write_gguf(hf_dir, path)
        llm = _llm(dtype)
        llm.generate(fresh_prompts(16, n_in), _greedy(n_out))
        cpp = llamacpp.LlamaCpp(path, max_seqs=16, max_len=n_in + n_out)
        cpp.generate(fresh_prompts(16, n_in), 8)
        hits = _cached_tokens(llm)

        def ours(batch):
            return [list(o.token_ids) for o in llm.generate(batch, _greedy(n_out))]

        def theirs(batch):
            return cpp.generate(batch, n_out)

        rates = {(who, b): [] for who in ("ms", "cpp") for b in (16, 1)}
        agree = []
        for r in range(1 if _QUICK.value else 3):
            order = (("ms", ours), ("cpp", theirs)) if r % 2 == 0 else (("cpp", theirs), ("ms", ours))
            prompts, singles = fresh_prompts(16, n_in), fresh_prompts(4, n_in)
            outs = {}
            for who, run in order:
                t0 = time.perf_counter()
                outs[who] = run(prompts)
                rates[who, 16].append(16 * n_out / (time.perf_counter() - t0))
            agree += [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), n_out) / n_out
                      for x, y in zip(outs["ms"], outs["cpp"])]
            for who, run in order:
                t0 = time.perf_counter()
                for p in singles:
                    run([p])
                rates[who, 1].append(4 * n_out / (time.perf_counter() - t0))
        cached = _cached_tokens(llm) - hits
        cpp.close()
        del llm
        med = {k: statistics.median(v) for k, v in rates.items()}
        rows.append([dtype, cpu_path(), llamacpp.instruction_sets(), med["ms", 16], med["cpp", 16],
                     med["ms", 16] / med["cpp", 16], med["ms", 1], med["cpp", 1], med["ms", 1] / med["cpp", 1],
                     f"{statistics.mean(agree):.0%}", cached])
    table("meshserve vs llama.cpp, same checkpoint, output tokens/s, 16 x (128 in, %d out), greedy (median "
          "of interleaved rounds; cached: prompt tokens meshserve served from its prefix cache in the timed rounds)"
          % n_out,
          ["dtype", "meshserve kernels", "llama.cpp build", "meshserve b16", "llama.cpp b16", "ratio",
           "meshserve b1", "llama.cpp b1", "ratio", "tokens agree", "cached"], rows)


def bench_startup():
    """Process start to ready (weights loaded, every bucket compiled), in fresh processes: with an empty
    persistent compilation cache (cold), then again with the cache the first one filled (a restart)."""
    import tempfile
    dtype = _DTYPES.value[0]
    code = ("import time, psutil; from serving.core.llm import LLM; "
            f"llm = LLM({llama_125m(dtype, _WORKDIR.value)!r}, dtype={dtype!r}, page_size=16, num_pages=4096, "
            "max_num_seqs=16, max_num_batched_tokens=256); "
            "e = llm.engine; print('READY', time.time() - psutil.Process().create_time(), e.runner.load_time_s, "
            "e.compile_count, e.compile_time_s, len(e.buckets))")
    rows = []
    with tempfile.TemporaryDirectory(prefix="meshserve-bench-xla-") as cache:
        env = dict(os.environ, MESHSERVE_COMPILATION_CACHE=cache)
        for name in ("cold (empty cache)", "restart (cache filled)"):
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                 env=env).stdout
            _, total, load, count, compile_s, buckets = next(
                line for line in out.splitlines() if line.startswith("READY")).split()
            rows.append([dtype, name, float(total), float(load), int(buckets), int(count), float(compile_s)])
    table("Start-up (fresh process)", ["dtype", "compilation cache", "process start -> ready (s)",
                                       "weights load (s)", "token buckets", "programs", "compile (s)"], rows)


def bench_batching():
    """Continuous vs static batching (the same engine, waiting for a whole batch before admitting more)."""
    n = 40 if _QUICK.value else 200
    rng = np.random.default_rng(1)
    lengths = rng.integers(16, 513 if not _QUICK.value else 129, n).tolist()
    prompts = random_prompts(n, 32, seed=2)
    from serving.params import SamplingParams
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths]
    dtype = _DTYPES.value[0]
    llm = _llm(dtype)
    llm.generate(prompts[:2], _greedy(4))
    steps0 = llm.engine.step_count
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    continuous = sum(lengths) / (time.perf_counter() - t0)
    steps1 = llm.engine.step_count
    batch = llm.engine.config.max_num_seqs
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        llm.generate(prompts[i:i + batch], params[i:i + batch])
    static = sum(lengths) / (time.perf_counter() - t0)
    steps2 = llm.engine.step_count
    # Engine steps are what an accelerator pays for (its step time hardly depends on the batch); a CPU step
    # gets cheaper as the batch empties, which favours static batching's tails.
    table(f"Continuous vs static batching, {n} requests, output 16-{max(lengths)} tokens, {batch} slots",
          ["mode", "output tok/s", "engine steps"],
          [["continuous", continuous, steps1 - steps0], ["static", static, steps2 - steps1],
           ["gain (tok/s: continuous/static; steps: static/continuous)", continuous / static,
            (steps2 - steps1) / (steps1 - steps0)]])


def bench_prefix():
    """TTFT with a 1,024-token shared system prompt, prefix cache on vs off (requests one at a time)."""
    system = random_prompts(1, 1024, seed=3)[0]
    users = random_prompts(9, 32, seed=4)
    dtype = _DTYPES.value[0]
    rows = []
    for on in (False, True):
        llm = _llm(dtype, enable_prefix_caching=on, max_num_batched_tokens=512)
        llm.generate([system + users[0]], _greedy(1))
        ttft = []
        for u in users[1:]:
            out = llm.generate([system + u], _greedy(1))[0]
            ttft.append(out.metrics.first_token_time - out.metrics.arrival_time)
        rows.append(["on" if on else "off", statistics.mean(ttft) * 1e3,
                     sum(o for o in [out.metrics.num_cached_prompt_tokens])])
    rows.append(["ratio off/on", rows[0][1] / rows[1][1], ""])
    table("Prefix cache, 1,024-token shared system prompt + 32-token user turn",
          ["prefix cache", "mean TTFT (ms)", "cached prompt tokens (last)"], rows)


def bench_chunked():
    """A 16k-token prompt arrives while 16 requests decode: their inter-token latency, chunked vs not."""
    long_len = 2048 if _QUICK.value else 16384
    dtype = _DTYPES.value[0]
    rows = []
    for chunked in (True, False):
        budget = 512 if chunked else 1 << (long_len + 16 - 1).bit_length()
        # 32 sequence slots: the long prompt must be admitted while the 16 decoders run (with 16 slots it waited
        # for them to finish, and neither mode measured anything).
        llm = _llm(dtype, max_num_batched_tokens=budget, max_model_len=long_len + 64, num_pages=2048,
                   long_prompt_threshold=long_len - 1, max_num_seqs=32)
        eng = llm.engine
        decoders = [eng.make_request(f"d{i}", p, _greedy(64)) for i, p in enumerate(random_prompts(16, 16, seed=5))]
        for r in decoders:
            eng.add_request(r)
        steps = 0
        while steps < 8:  # let them reach steady decode
            eng.step()
            steps += 1
        long = eng.make_request("long", random_prompts(1, long_len, seed=6)[0], _greedy(1))
        eng.add_request(long)
        while eng.has_unfinished():
            eng.step()
        itl = np.concatenate([np.diff(r.metrics.token_times) for r in decoders])
        # Decoders still running when the long prompt's first token came: the ITL above covers its prefill.
        overlapped = sum(r.metrics.finished_time > long.metrics.first_token_time for r in decoders)
        rows.append(["chunked (512/step)" if chunked else "whole prompt in one step", np.percentile(itl, 50) * 1e3,
                     np.percentile(itl, 99) * 1e3, itl.max() * 1e3,
                     long.metrics.first_token_time - long.metrics.arrival_time, overlapped])
        del llm, eng
    table(f"Inter-token latency of 16 decoding requests while a {long_len}-token prompt is prefilled",
          ["mode", "ITL p50 (ms)", "ITL p99 (ms)", "ITL max (ms)", "long prompt TTFT (s)",
           "decoders running past its prefill"], rows)


def bench_host():
    """Host time per step with 256 running sequences, device work stubbed out."""
    from serving.bench.host_overhead import report
    report(num_seqs=256, steps=200 if _QUICK.value else 1000)


def bench_roofline():
    """Decode step time at batch 1 and 32 vs the memory-bandwidth roofline (bytes of weights a step reads / read
    bandwidth measured now on a buffer backed like the weights)."""
    rows = []
    bw = read_bandwidth()
    for dtype in _DTYPES.value:
        llm = _llm(dtype, max_num_seqs=32, max_num_batched_tokens=256)
        eng = llm.engine
        for batch in (1, 32):
            idle = {}
            for look_ahead in (False, True):  # async scheduling off, then on: the device's idle time between steps
                eng.look_ahead = look_ahead
                timed = decode_step_times(eng, random_prompts(batch, 64), _greedy(40))
                idle[look_ahead] = timed.host_gap_s
            step, nbytes = statistics.median(timed.times), decode_step_bytes(eng, batch)
            rows.append([dtype, batch, nbytes / 1e6, step * 1e3, nbytes / bw * 1e3, nbytes / bw / step, batch / step,
                         idle[False] * 1e3, idle[True] * 1e3])
        del llm, eng
    table(f"Decode step vs roofline (weight bytes a step reads / read bandwidth, {bw / 1e9:.1f} GB/s measured now;"
          " batch 1: the LM head's int8 screen instead of the head); device idle per step waiting on the host, "
          "async scheduling off / on",
          ["dtype", "batch", "MB read", "step (ms)", "roofline (ms)", "roofline/step", "tok/s", "idle off (ms)",
           "idle on (ms)"], rows)


def bench_floor():
    """The weight matmuls alone (the 12 layers' q/k/v/o/gate/up/down dots and the LM head, random weights of the
    benchmark model's shapes, nothing else jitted in but an RMS scaling per layer): a floor under any decode step,
    side by side for XLA's dot,
    the native kernel on the row-major weights, and what the engine runs (`pallas_kernels.matmul.matmul` on weights
    packed at load as `CausalLM.pack_for_cpu_kernels` does: q|k|v and gate|up fused, in the huge-page buffer, when the
    native kernels are on)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.matmul import SCREEN_MAX_ROWS, matmul
    from pallas_kernels import native
    c = LLAMA_125M
    e, i, v, kv = c["hidden_size"], c["intermediate_size"], c["vocab_size"], \
        c["hidden_size"] * c["num_key_value_heads"] // c["num_attention_heads"]
    rows = []
    for dtype in _DTYPES.value:
        dt = jnp.dtype(dtype)
        key = iter(jax.random.split(jax.random.PRNGKey(0), 8 * c["num_hidden_layers"] + 1))

        def w(*shape):
            return (jax.random.normal(next(key), shape, jnp.float32) * 0.02).astype(dt)

        layers = [dict(q=w(e, e), k=w(e, kv), v=w(e, kv), o=w(e, e), g=w(e, i), u=w(e, i), d=w(i, e))
                  for _ in range(c["num_hidden_layers"])]
        head = w(e, v)
        packed = (layers, head)
        if native.enabled():
            flat = native.pack_weights([m for p in layers for m in ([p["q"], p["k"], p["v"]], p["o"], [p["g"], p["u"]],
                                                                    p["d"])] + [head])
            packed = ([dict(qkv=flat[4 * j], o=flat[4 * j + 1], gu=flat[4 * j + 2], d=flat[4 * j + 3])
                       for j in range(len(layers))], flat[-1])

        def xla_mm(x, m):
            return jnp.dot(x, m, preferred_element_type=jnp.float32).astype(x.dtype)

        def chain(mm, layers, head, x, screen=None):
            for p in layers:
                if "qkv" in p:
                    qkv = mm(x, p["qkv"])
                    h = qkv[:, :e] + qkv[:, e:e + kv].sum() + qkv[:, e + kv:].sum()
                else:
                    h = mm(x, p["q"]) + mm(x, p["k"]).sum() + mm(x, p["v"]).sum()
                x = x + mm(h, p["o"])
                if "gu" in p:
                    gu = mm(x, p["gu"])
                    x = x + mm(jax.nn.silu(gu[:, :i]) * gu[:, i:], p["d"])
                else:
                    x = x + mm(jax.nn.silu(mm(x, p["g"])) * mm(x, p["u"]), p["d"])
                x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6).astype(
                    x.dtype)  # kept finite (random weights without norms overflow in a few layers)
            if screen is not None:  # the greedy tokens from the head's int8 screen
                return native.greedy_head(x, *screen, head, jnp.array([x.shape[0]], jnp.int32), layout="packed")[0]
            return mm(x, head)

        weight_bytes = sum(a.nbytes for p in layers for a in p.values()) + head.nbytes
        screen = None
        if native.enabled():
            screen = tuple(jnp.asarray(a) for a in native.greedy_head_screen(np.asarray(head.astype(jnp.float32)).T))
        for m in (1, 4, 8, 16, 32, 256):
            x = w(m, e)
            steps = []
            variants = [(xla_mm, (layers, head), None), (matmul, (layers, head), None), (matmul, packed, None)]
            if screen is not None and m <= SCREEN_MAX_ROWS:
                variants.append((matmul, packed, screen))
            for mm, ws, scr in variants:
                f = jax.jit(functools.partial(chain, mm, screen=scr))
                steps.append(median_time(lambda: f(*ws, x).block_until_ready(), 10))
            screened = steps[3] if len(steps) > 3 else float("nan")
            rows.append([dtype, m, cpu_path(), steps[0] * 1e3, _blas_chain_ms(layers, head, x) if dt == jnp.float32
                         else "-", steps[1] * 1e3, steps[2] * 1e3, steps[0] / steps[2],
                         weight_bytes / steps[2] / 1e9, m / steps[2], screened * 1e3, m / screened])
    table("Weight matmuls alone (no attention, norms or sampling): a floor under the decode step; OpenBLAS: "
          "the same dots in NumPy (float32; its own threads); screened: the LM head replaced by its int8 screen's "
          "greedy head (greedy steps of <= %d rows)" % SCREEN_MAX_ROWS,
          ["dtype", "rows", "kernels", "XLA dot ms", "OpenBLAS ms", "native row-major ms", "native packed ms (engine)",
           "XLA/packed", "weights GB/s", "max tok/s at that batch", "screened ms", "max tok/s screened"], rows)


def _blas_chain_ms(layers, head, x) -> float:
    """The floor's dots (unfused weights) through NumPy's BLAS (OpenBLAS in NumPy's wheels), median of 10."""
    mats = [np.asarray(m) for p in layers for m in p.values()] + [np.asarray(head)]
    xs = {a.shape[0]: np.asarray(x[:, :1].repeat(a.shape[0], axis=1)) for a in mats}
    return median_time(lambda: [xs[a.shape[0]] @ a for a in mats], 10) * 1e3


BENCHES = dict(throughput=bench_throughput, llamacpp=bench_llamacpp, startup=bench_startup, batching=bench_batching,
               prefix=bench_prefix, chunked=bench_chunked, host=bench_host, roofline=bench_roofline, floor=bench_floor)


def main() -> None:
    print(json.dumps({"benchmarks": _ONLY.value, "dtypes": _DTYPES.value, "quick": _QUICK.value,
                      "cpus": os.cpu_count(), "load": os.getloadavg()}))
    for name in _ONLY.value:
        BENCHES[name]()
