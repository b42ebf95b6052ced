"""Quantized serving (`python -m serving.bench quant`): the ~125M Llama with bfloat16, int8 weights and int8 weights
+ an int8 KV cache beside llama.cpp (bf16 and Q8_0 GGUF of the same checkpoint), batch 1 and 16, side by side in
one run; KV pages per GB and the concurrent 2,048-token sequences a fixed KV budget holds, per KV dtype (measured on
the arrays the engine allocates); the ledger's Llama-3-70B on 8 x 80 GB with an fp8 KV cache; the int8 matmul
kernels per call; and (`--only=screen`) how many rows narrower greedy-head screens would leave to re-read. Details:
docs/quantization.md."""
from __future__ import annotations

import os
import statistics
import time

from absl import flags

from serving.bench.harness import BENCH_WORKDIR, decode_step_bytes, decode_step_times, fresh_prompts, llama_125m, \
    read_bandwidth, table

_ONLY = flags.DEFINE_list("only", ["throughput", "roofline", "capacity", "ledger", "kernels"],
                          "sections to run (and `screen`: how many rows narrower head screens would leave)")
_WORKDIR = flags.DEFINE_string("workdir", BENCH_WORKDIR, "where the benchmark model is written")
_QUICK = flags.DEFINE_bool("quick", False, "smaller workloads (a smoke run)")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "interleaved timed rounds per cell (median)")

MESHSERVE_CELLS = {  # name -> engine options over bfloat16
    "meshserve bf16": {},
    "meshserve int8 W": dict(quantization="int8"),
    "meshserve int8 W + int8 KV": dict(quantization="int8", kv_cache_dtype="int8"),
}


def _prompts(n: int, length: int) -> list[list[int]]:
    return fresh_prompts(n, length, low=3)  # ids from 3 up: the prompts of the figures in docs/quantization.md


def bench_throughput() -> None:
    from serving.bench import llamacpp
    from serving.core.llm import LLM
    from serving.params import SamplingParams
    n_in, n_out = 128, (32 if _QUICK.value else 128)
    hf_dir = llama_125m("bfloat16", _WORKDIR.value)
    greedy = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
    runners = {}
    for name, options in MESHSERVE_CELLS.items():
        llm = LLM(hf_dir, dtype="bfloat16", page_size=16, num_pages=1024, max_num_seqs=16,
                  max_num_batched_tokens=256, **options)
        runners[name] = (lambda llm: lambda batch: [list(o.token_ids) for o in llm.generate(batch, greedy)])(llm)
    if llamacpp.available():
        for name, q8 in (("llama.cpp bf16", False), ("llama.cpp Q8_0", True)):
            path = os.path.join(_WORKDIR.value, f"llama125m-bf16{'-q8_0' if q8 else ''}.gguf")
            if not os.path.exists(path) or os.path.getmtime(path) < os.path.getmtime(
                    os.path.join(hf_dir, "config.json")):
                llamacpp.write_gguf(hf_dir, path, q8_0=q8)
            cpp = llamacpp.LlamaCpp(path, max_seqs=16, max_len=n_in + n_out)
            runners[name] = (lambda cpp: lambda batch: cpp.generate(batch, n_out))(cpp)
    else:
        print("llama.cpp: not run (llama-cpp-python is not installed: `.venv/bin/pip install -e '.[llamacpp]'`)")
    for run in runners.values():  # warm-up: compile / load every path
        run(_prompts(16, n_in))
        run(_prompts(1, n_in))
    rates = {(name, b): [] for name in runners for b in (16, 1)}
    outs16 = {}
    names = list(runners)
    for r in range(1 if _QUICK.value else _ROUNDS.value):
        order = names if r % 2 == 0 else names[::-1]
        batch, singles = _prompts(16, n_in), _prompts(2 if _QUICK.value else 4, n_in)
        for name in order:
            t0 = time.perf_counter()
            outs16[name] = runners[name](batch)
            rates[name, 16].append(16 * n_out / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for p in singles:
                runners[name]([p])
            rates[name, 1].append(len(singles) * n_out / (time.perf_counter() - t0))
    med = {k: statistics.median(v) for k, v in rates.items()}
    base = "meshserve bf16"
    peer = "llama.cpp Q8_0" if "llama.cpp Q8_0" in runners else None

    def agree(name):  # share of the 16 greedy outputs equal to bf16's from the start
        same = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), n_out) / n_out
                for x, y in zip(outs16[name], outs16[base])]
        return f"{statistics.mean(same):.0%}"

    rows = []
    for name in names:
        rows.append([name, med[name, 1], med[name, 1] / med[base, 1],
                     med[name, 1] / med[peer, 1] if peer else "-", med[name, 16], med[name, 16] / med[base, 16],
                     med[name, 16] / med[peer, 16] if peer else "-", agree(name)])
    table(f"Quantized serving, ~125M Llama (bf16 checkpoint), output tokens/s, greedy, {n_in} in / {n_out} out: "
          f"batch 1 = prompts one at a time, batch 16 = 16 at once (median of interleaved rounds)",
          ["engine", "b1 tok/s", "b1 vs bf16", "b1 vs llama.cpp Q8_0", "b16 tok/s", "b16 vs bf16",
           "b16 vs llama.cpp Q8_0", "b16 tokens agree with bf16"], rows)


def bench_roofline() -> None:
    """Batch-1 and batch-16 decode steps of each meshserve cell against the read-bandwidth roofline of the bytes of
    weights the step reads (quantized weights at their size, the LM head's int8 screen at batch 1)."""
    from serving.core.llm import LLM
    from serving.params import SamplingParams
    bw = read_bandwidth()
    hf_dir = llama_125m("bfloat16", _WORKDIR.value)
    n_in, n_out = 128, 128  # the throughput section's batch-1 request
    rows, w1 = [], {}
    for name, options in MESHSERVE_CELLS.items():
        llm = LLM(hf_dir, dtype="bfloat16", page_size=16, num_pages=1024, max_num_seqs=16,
                  max_num_batched_tokens=256, **options)
        for batch in (1, 16):
            timed = decode_step_times(llm.engine, _prompts(batch, 64),
                                      SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
            step, nbytes, idle = statistics.median(timed.times), decode_step_bytes(llm.engine, batch), timed.host_gap_s
            rows.append([name, batch, nbytes / 1e6, step * 1e3, nbytes / bw * 1e3, nbytes / bw / step, idle * 1e3])
            if batch == 1:
                w1[name] = (_prefill_time(llm, n_in), step, nbytes / bw)
        del llm
    table(f"Decode step vs roofline, ~125M Llama (weight bytes a step reads / read bandwidth, {bw / 1e9:.1f} GB/s "
          "measured now)", ["engine", "batch", "MB read", "step (ms)", "roofline (ms)", "roofline/step",
                            "device idle/step (ms)"], rows)
    # A batch-1 request is its prefill (which gives the first token) and n_out - 1 decode steps; "at roofline": every
    # step at the roofline of its bytes and nothing else, the prefill as measured (compute-bound, the same work in
    # every cell). The most a cell's batch-1 rate can be; the ratio of two cells at their rooflines is not a bound on
    # their measured ratio (slower steps in both dilute the prefill less), but the ratio of their steps' bytes is.
    rate = {name: (n_out / (p + (n_out - 1) * s), n_out / (p + (n_out - 1) * r)) for name, (p, s, r) in w1.items()}
    table(f"Batch 1, {n_in} in / {n_out} out, from its parts: prefill (median of 5) + {n_out - 1} decode steps "
          "(above); at roofline: every step at its roofline", ["engine", "prefill (ms)", "step (ms)", "roofline (ms)",
                                                               "tok/s", "vs bf16", "at roofline tok/s",
                                                               "at roofline vs bf16"],
          [[name, p * 1e3, s * 1e3, r * 1e3, rate[name][0], rate[name][0] / rate["meshserve bf16"][0],
            rate[name][1], rate[name][1] / rate["meshserve bf16"][1]] for name, (p, s, r) in w1.items()])


def _prefill_time(llm, n_in: int, rounds: int = 5) -> float:
    """Median seconds of a fresh `n_in`-token prompt's prefill on its own (one output token)."""
    from serving.params import SamplingParams
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(_prompts(1, n_in), one)
    times = []
    for _ in range(rounds):
        prompt = _prompts(1, n_in)
        t0 = time.perf_counter()
        llm.generate(prompt, one)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_screen() -> None:
    """How many vocabulary rows the greedy head's screen leaves to re-read exactly, were it narrower than int8: the
    bound of `pallas_kernels/native` greedy_head.h (|x.w - s x.q| <= ||x|| ||w - s q||, one scale per row) on the
    benchmark model's final hidden states (HF transformers, float32, 8 random 128-token prompts), per screen width."""
    import numpy as np
    import torch
    import transformers as tf
    model = tf.LlamaForCausalLM.from_pretrained(llama_125m("bfloat16", _WORKDIR.value), torch_dtype=torch.float32)
    ids = torch.tensor(_prompts(8, 128))
    with torch.no_grad():
        x = model.model(ids).last_hidden_state[:, -1].double().numpy()
    w = model.lm_head.weight.detach().double().numpy()  # [V, E]
    rows = []
    for bits in (8, 6, 5, 4):
        s = np.abs(w).max(1, keepdims=True) / (2 ** (bits - 1) - 1)
        q = np.round(w / s)
        approx = x @ (s * q).T
        bound = np.linalg.norm(x, axis=1, keepdims=True) * np.linalg.norm(w - s * q, axis=1)
        floor = (approx - bound).max(1, keepdims=True)
        left = ((approx + bound) >= floor).sum(1)
        rows.append([bits, w.size * bits / 8 / 1e6, int(left.min()), float(np.median(left)), int(left.max())])
    table(f"Greedy head screen by width, ~125M Llama's head ({w.shape[0]} x {w.shape[1]}): rows its bound leaves "
          "to re-read exactly, over 8 prompts", ["bits", "screen MB", "min rows", "median rows", "max rows"], rows)


def bench_capacity() -> None:
    import jax

    from models.config import ModelConfig
    from models.kv_cache import init_kv_caches
    from models.transformer import kv_cache_specs
    from serving import ledger
    cfg = ModelConfig.from_pretrained(llama_125m("bfloat16", _WORKDIR.value))
    page_size, budget, seq = 16, 1 << 30, 2048
    rows = []
    for kv in ("auto", "int8", "fp8_e4m3"):
        pages = ledger.kv_cache_pages(cfg, dtype="bfloat16", page_size=page_size, kv_cache_bytes=budget,
                                      kv_dtype=ledger.kv_dtype_of(kv))
        caches = init_kv_caches(kv_cache_specs(cfg, dtype="bfloat16", kv_cache_dtype=kv), 64, page_size)
        measured = sum(x.nbytes for x in jax.tree.leaves(caches)) / 64  # bytes per page, every layer
        rows.append(["bfloat16" if kv == "auto" else kv, measured, (1 << 30) / measured, pages,
                     pages // (seq // page_size), int(budget / measured) // (seq // page_size)])
    table(f"KV capacity, ~125M Llama ({cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x {cfg.head_dim}), "
          f"page {page_size} tokens, KV budget 1 GiB",
          ["KV dtype", "bytes/page (allocated)", "pages/GiB", "pages (engine sizing)",
           f"{seq}-token seqs (engine sizing)", f"{seq}-token seqs (allocated bytes)"], rows)


def bench_ledger() -> None:
    from serving import ledger
    name, cfg = ledger.load_config("llama-3-70b", "")
    rows = []
    for kv in ("auto", "int8", "fp8_e4m3"):
        mm = ledger.ModelMemory(cfg, "bfloat16", ledger.kv_dtype_of(kv))
        pages = ledger.plan_kv_pages(cfg, dtype="bfloat16", page_size=16, free_bytes=80 * ledger.GB,
                                     mesh_shape={"tensor": 8}, weights_loaded=False, kv_dtype=mm.kv_dtype,
                                     max_batched_tokens=2048, max_seqs=256)
        rows.append([mm.kv_dtype, mm.kv_bytes_per_token / 1024, pages, pages * 16, pages // 128])
    table(f"ledger: {name}, bf16 weights, tp=8 on 8 x 80 GB (5% reserve, 2,048-token steps), KV pages of 16 tokens "
          "(python -m serving.ledger --preset=llama-3-70b --kv_cache_dtype=...)",
          ["KV dtype", "KiB/token", "KV pages per replica", "tokens", "2,048-token sequences"], rows)
    mm = ledger.ModelMemory(cfg, "bfloat16", "float8_e4m3fn")
    hw = ledger.Hardware(device_memory=80 * ledger.GB, num_devices=8)
    print("\n" + "\n".join(ledger.render_report(name, mm, ledger.Workload(256, 2048, 16, 2048, 0), hw, "nvlink",
                                                  show=3).splitlines()[:20]))


def main() -> None:
    for section in _ONLY.value:
        if section == "throughput":
            bench_throughput()
        elif section == "roofline":
            bench_roofline()
        elif section == "screen":
            bench_screen()
        elif section == "capacity":
            bench_capacity()
        elif section == "ledger":
            bench_ledger()
        elif section == "kernels":
            from serving.bench import quant_kernels
            quant_kernels.main([])
        else:
            raise ValueError(f"--only: unknown section {section!r}")
