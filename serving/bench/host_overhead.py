"""Host time per engine step with N running decode sequences: schedule(), batch arrays, update(), outputs, with a fake
model returning random tokens so only host work is timed. Details: docs/benchmarks.md.

    python -m serving.bench host_overhead [--num_seqs=256]
"""
from __future__ import annotations

import os
import time

import numpy as np
from absl import flags

from models.tokenizer import Tokenizer
from serving.bench.harness import table
from serving.core import BatchBuilder, Request, SamplingParams, Scheduler, SchedulerConfig, sampling
from serving.core.output_processor import RequestText

TOKENIZER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "models", "tiny", "target")

_NUM_SEQS = flags.DEFINE_integer("num_seqs", 256, "running decode sequences")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 512, "prompt tokens per sequence")
_STEPS = flags.DEFINE_integer("steps", 1000, "timed steps")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "tokens per KV page")


def measure_host_overhead(num_seqs: int = 256, prompt_len: int = 512, steps: int = 1000, page_size: int = 16,
                          warmup: int = 20) -> dict[str, float]:
    """Returns per-step host times in microseconds (mean and p50/p99 of schedule, build, update, total)."""
    max_len = prompt_len + steps + warmup + 64
    pages_per_seq = -(-max_len // page_size)
    config = SchedulerConfig(max_model_len=max_len, num_pages=num_seqs * pages_per_seq + 8, page_size=page_size,
                             max_num_batched_tokens=max(8192, num_seqs), max_num_seqs=num_seqs,
                             max_waiting_requests=num_seqs)
    sched = Scheduler(config)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        sched.add_request(Request(f"r{i}", rng.integers(1, 30000, prompt_len).tolist(), params,
                                  arrival_time=0.0, eos_token_ids=(2,)))
    tokens = np.full(num_seqs, 7, np.int32)  # during prefill
    num_tokens, max_pages = 1 << (num_seqs - 1).bit_length(), pages_per_seq
    now = 0.0
    while any(r.num_computed_tokens + 1 != r.num_tokens for r in sched.running) or sched.waiting:  # prefill
        now += 1
        out = sched.schedule(now)
        sched.update(out, tokens[:len(out.scheduled)], now)
    builder = BatchBuilder(page_size=page_size, max_pages=max_pages, max_seqs=num_seqs)
    tokenizer = Tokenizer.from_pretrained(TOKENIZER_DIR)
    detoks = {r.request_id: RequestText(tokenizer, r.prompt_token_ids, r.sampling_params) for r in sched.running}
    times = np.zeros((steps + warmup, 6), np.int64)
    for i in range(steps + warmup):
        now += 1
        tokens = rng.integers(10, tokenizer.vocab_size, num_seqs)
        t0 = time.perf_counter_ns()
        out = sched.schedule(now)
        t1 = time.perf_counter_ns()
        builder.build(out.scheduled, num_tokens=num_tokens, num_seqs=num_seqs)
        t15 = time.perf_counter_ns()
        requests = [s.request for s in out.scheduled]
        sampling.build_sampling_tensors([r.sampling_params for r in requests], vocab_size=tokenizer.vocab_size,
                                        num_slots=num_seqs, token_ids=[r.token_ids for r in requests],
                                        num_prompt_tokens=[r.num_prompt_tokens for r in requests])
        t2 = time.perf_counter_ns()
        results = sched.update(out, tokens, now)
        t3 = time.perf_counter_ns()
        for o in results:  # what the engine does with step N-1's tokens while step N runs on the device
            detoks[o.request_id].add(o.new_token_ids, o.finished)
        t4 = time.perf_counter_ns()
        assert len(out.scheduled) == num_seqs, "every sequence should decode every step"
        times[i] = (t1 - t0, t15 - t1, t2 - t15, t3 - t2, t4 - t3, t4 - t0)
    us = times[warmup:] / 1e3
    serial = us[:, 0] + us[:, 1] + us[:, 3]  # greedy: no sampling tensors
    result = {"overlapped_share": float(us[:, 4].sum() / (us[:, 5] - us[:, 2]).sum())}
    for name, col in (("schedule", us[:, 0]), ("batch arrays", us[:, 1]),
                      ("sampling tensors (non-greedy steps)", us[:, 2]), ("update", us[:, 3]),
                      ("schedule+update", us[:, 0] + us[:, 3]), ("serial before launch, greedy, sync", serial),
                      ("serial before launch, sampling, sync", serial + us[:, 2]),
                      ("outputs (overlapped)", us[:, 4]), ("total, greedy", us[:, 5] - us[:, 2])):
        result[f"{name}_mean_us"] = float(col.mean())
        result[f"{name}_p50_us"] = float(np.percentile(col, 50))
        result[f"{name}_p99_us"] = float(np.percentile(col, 99))
    return result


def report(num_seqs: int = 256, steps: int = 1000, prompt_len: int = 512, page_size: int = 16) -> None:
    """Measures and prints the table (offline's `--only=host` runs it too)."""
    r = measure_host_overhead(num_seqs, prompt_len, steps, page_size)
    parts = [k.removesuffix("_p50_us") for k in r if k.endswith("_p50_us")]
    table(f"Host time per step, {num_seqs} running decodes, {steps} steps (device stubbed)",
          ["part", "mean (us)", "p50 (us)", "p99 (us)"],
          [[p, r[f"{p}_mean_us"], r[f"{p}_p50_us"], r[f"{p}_p99_us"]] for p in parts]
          + [["share hidden behind the device, greedy, synchronous (outputs / total; async scheduling: offline's "
              "roofline table's idle columns)", f"{r['overlapped_share']:.0%}", "", ""]])


def main() -> None:
    report(_NUM_SEQS.value, _STEPS.value, _PROMPT_LEN.value, _PAGE_SIZE.value)
