"""Serving benchmark in the method of `vllm bench serve`: an open-loop request stream through meshserve.v1
Inference.Generate (gRPC) or the OpenAI-compatible HTTP API (streamed /v1/completions, /v1/chat/completions);
throughput, TTFT / TPOT / ITL / E2E latency and goodput; several backends side by side on the same requests, and
requests with n samples against n separate requests. Details: docs/benchmarks.md.

    python -m serving.bench serve --target=HOST:PORT [--backend=grpc,openai,openai-chat --base_url=http://HOST:PORT]
        [--request_rate=8] [--dataset=random|sharegpt|multiturn] [--n=K | --compare_n=K --metrics_url=URL] [...]
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import re
import textwrap
import time
import urllib.request
from datetime import datetime
from typing import Sequence

import numpy as np
from absl import flags

from serving.bench.serve_backends import (  # noqa: F401 - the backends' names, importable from here as before
    BACKEND_LABELS, BACKENDS, GrpcBackend, OpenAIBackend, RequestOutput, SampleRequest, SSEDecoder, make_backend,
    parse_backends)

_TARGET = flags.DEFINE_string("target", "127.0.0.1:50051",
                              "Server (or gateway) gRPC address, HOST:PORT: the grpc backend, and the dataset's "
                              "sizing (ModelInfo) for every backend.")
_BACKEND = flags.DEFINE_string(
    "backend", "grpc", "grpc (meshserve.v1), openai (/v1/completions) or openai-chat (/v1/chat/completions); a comma "
    "list sends the same requests through each in turn and prints them side by side.")
_BASE_URL = flags.DEFINE_string("base_url", "", "The OpenAI-compatible API, http://HOST:PORT (the openai backends).")
_ROUNDS = flags.DEFINE_integer("rounds", 1, "Runs of every backend, the order reversed every other round.")
_N = flags.DEFINE_integer("n", 1, "Samples per request (n); output tokens are summed over the samples.")
_COMPARE_N = flags.DEFINE_integer("compare_n", 0, "K >= 2: the workload as requests with n=K and as K separate "
                                  "requests per prompt, through the first backend; 0: off.")
_METRICS_URL = flags.DEFINE_string("metrics_url", "", "The instance's Prometheus endpoint, http://HOST:PORT/metrics: "
                                   "--compare_n reads the server's prefill work from it.")
_REQUEST_RATE = flags.DEFINE_float("request_rate", float("inf"),
                                   "Mean arrivals per second; inf sends every request at once.")
_BURSTINESS = flags.DEFINE_float("burstiness", 1.0,
                                 "Gamma shape of the inter-arrival times: 1 = Poisson, < 1 burstier, > 1 steadier.")
_MAX_CONCURRENCY = flags.DEFINE_integer("max_concurrency", 0, "Requests in flight at most; 0: no cap.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 1000, "Requests to send.")
_DATASET = flags.DEFINE_enum("dataset", "random", ["random", "sharegpt", "multiturn"], "Where prompts come from.")
_MULTITURN_CONVERSATIONS = flags.DEFINE_integer("multiturn_conversations", 8, "Multiturn: conversations.")
_MULTITURN_HISTORY_LEN = flags.DEFINE_integer("multiturn_history_len", 512,
                                              "Multiturn: tokens of a conversation's first prompt.")
_MULTITURN_TURN_LEN = flags.DEFINE_integer("multiturn_turn_len", 32, "Multiturn: user tokens each later turn adds.")
_DATASET_PATH = flags.DEFINE_string("dataset_path", "", "ShareGPT-format JSON file (--dataset=sharegpt).")
_SHAREGPT_OUTPUT_LEN = flags.DEFINE_integer("sharegpt_output_len", 0,
                                            "ShareGPT: output tokens per request; 0: the reply's length.")
_RANDOM_INPUT_LEN = flags.DEFINE_integer("random_input_len", 1024, "Random: prompt tokens (after the prefix).")
_RANDOM_OUTPUT_LEN = flags.DEFINE_integer("random_output_len", 128, "Random: output tokens.")
_RANDOM_RANGE_RATIO = flags.DEFINE_float("random_range_ratio", 0.0,
                                         "Random: lengths drawn uniformly from [len * (1 - r), len * (1 + r)].")
_RANDOM_PREFIX_LEN = flags.DEFINE_integer("random_prefix_len", 0, "Random: tokens of a prefix shared by all.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the dataset and the arrival times.")
_IGNORE_EOS = flags.DEFINE_boolean("ignore_eos", True, "Generate exactly the requested output lengths.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0: greedy).")
_GOODPUT = flags.DEFINE_string("goodput", "", "SLOs in ms, e.g. ttft:500,tpot:50 (keys: ttft, tpot, e2el).")
_RESULT_JSON = flags.DEFINE_string("result_json", "", "Write the result here as JSON.")
_PLOT = flags.DEFINE_string("plot", "", "Write latency CDFs and throughput over time here (PNG).")
_DISABLE_TQDM = flags.DEFINE_boolean("disable_tqdm", False, "No progress bar.")
_REQUEST_TIMEOUT_S = flags.DEFINE_float("request_timeout_s", 0.0, "Deadline of each request; 0: none.")
_LORA_ADAPTERS = flags.DEFINE_list("lora_adapters", [], "LoRA adapters the requests name, in turn (request i: "
                                   "adapter i mod count; gRPC sampling.adapter, OpenAI `model`); empty: none.")

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 90, 99)


# --- datasets -------------------------------------------------------------------------------------------------


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float, prefix_len: int,
                    vocab_size: int, seed: int = 0, excluded_ids: Sequence[int] = ()) -> list[SampleRequest]:
    """vLLM's random dataset: per request input and output lengths uniform in len * [1 - r, 1 + r], token ids
    uniform over the vocabulary (less `excluded_ids`, e.g. EOS), after a random prefix shared by all."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1 or prefix_len < 0:
        raise ValueError(f"random lengths must be input >= 1, output >= 1, prefix >= 0; got "
                         f"{input_len}, {output_len}, {prefix_len}")
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(excluded_ids, dtype=np.int64))
    prefix = allowed[rng.integers(0, len(allowed), prefix_len)].tolist()
    in_lo, in_hi = max(1, int(input_len * (1 - range_ratio))), int(input_len * (1 + range_ratio))
    out_lo, out_hi = max(1, int(output_len * (1 - range_ratio))), int(output_len * (1 + range_ratio))
    in_lens = rng.integers(in_lo, in_hi + 1, num_prompts)
    out_lens = rng.integers(out_lo, out_hi + 1, num_prompts)
    out = []
    for n_in, n_out in zip(in_lens, out_lens):
        ids = prefix + allowed[rng.integers(0, len(allowed), n_in)].tolist()
        out.append(SampleRequest(ids, len(ids), int(n_out)))
    return out


def multiturn_requests(num_prompts: int, conversations: int, history_len: int, turn_len: int, output_len: int,
                       vocab_size: int, seed: int = 0, excluded_ids: Sequence[int] = ()) -> list[SampleRequest]:
    """Chats: `conversations` histories of `history_len` random tokens, each turn's prompt the previous prompt plus
    `output_len` tokens standing for the reply (random: the model's own is not known in advance) and `turn_len` new
    user tokens; turn-major order (every conversation's turn t before any turn t + 1), each turn sent once the
    previous turn of its conversation finished. `num_prompts` requests in all (turns = num_prompts / conversations,
    rounded up)."""
    if conversations < 1 or history_len < 1 or turn_len < 1 or output_len < 1:
        raise ValueError(f"multiturn sizes must be >= 1: conversations {conversations}, history {history_len}, "
                         f"turn {turn_len}, output {output_len}")
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(excluded_ids, dtype=np.int64))
    prompts = [allowed[rng.integers(0, len(allowed), history_len)].tolist() for _ in range(conversations)]
    out: list[SampleRequest] = []
    while len(out) < num_prompts:
        for c in range(conversations):
            if len(out) == num_prompts:
                break
            prev = len(out) - conversations
            if prev >= 0:
                prompts[c] = prompts[c] + allowed[rng.integers(0, len(allowed), output_len + turn_len)].tolist()
            out.append(SampleRequest(list(prompts[c]), len(prompts[c]), output_len, after=max(prev, -1)))
    return out


def sharegpt_requests(path: str, num_prompts: int, tokenize, max_model_len: int, seed: int = 0,
                      fixed_output_len: int = 0) -> list[SampleRequest]:
    """vLLM's ShareGPT sampling: first human turn as the prompt, the reply's token count as the output length
    (or `fixed_output_len`), shuffled with `seed`; drops prompts or replies under 4 tokens, prompts over 1,024 and
    pairs over 2,048 tokens (or the context); repeats the kept ones if fewer than `num_prompts`.
    `tokenize(text, add_special_tokens) -> ids`."""
    with open(path) as f:
        data = json.load(f)
    pairs = [(d["conversations"][0]["value"], d["conversations"][1]["value"])
             for d in data if len(d.get("conversations", ())) >= 2]
    random.Random(seed).shuffle(pairs)
    out: list[SampleRequest] = []
    for prompt, reply in pairs:
        if len(out) == num_prompts:
            break
        prompt_len = len(tokenize(prompt, True))
        output_len = fixed_output_len or len(tokenize(reply, False))
        if prompt_len < 4 or output_len < 4:
            continue
        if prompt_len > 1024 or prompt_len + output_len > min(2048, max_model_len):
            continue
        out.append(SampleRequest(prompt, prompt_len, output_len))
    if not out:
        raise ValueError(f"{path}: no conversation fits (prompt >= 4 tokens, reply >= 4, together <= "
                         f"{min(2048, max_model_len)})")
    return [out[i % len(out)] for i in range(num_prompts)]


# --- the run --------------------------------------------------------------------------------------------------


def arrival_offsets(num: int, request_rate: float, burstiness: float, seed: int = 0) -> np.ndarray:
    """Send times in seconds from the start: gamma inter-arrivals of mean 1 / rate and shape `burstiness`
    (1: Poisson); all zero for an infinite rate."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request_rate and burstiness must be > 0, got {request_rate}, {burstiness}")
    if math.isinf(request_rate):
        return np.zeros(num)
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), num)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


async def check_setup(backend, req: SampleRequest) -> None:
    """One request before the timed run, as vLLM sends: a set-up that cannot answer fails here, once."""
    out = await backend.send(req, time.perf_counter())
    if not out.success:
        raise RuntimeError(f"the initial test request to {backend.address} ({backend.name}) failed: {out.error}")


async def run_requests(backend, requests: Sequence[SampleRequest], *, offsets: Sequence[float] | None = None,
                       request_rate: float = float("inf"), burstiness: float = 1.0, max_concurrency: int = 0,
                       seed: int = 0, check_first: bool = True, progress: bool = True, desc: str = "requests"
                       ) -> tuple[list[RequestOutput], float]:
    """Sends `requests` through `backend` (opened and prepared) at their arrival times (`offsets` in seconds, else
    drawn from the rate and burstiness); returns their outputs (in order) and the benchmark duration (first send to
    last completion). With `check_first`, one initial request checks the set-up first."""
    from tqdm import tqdm

    offsets = arrival_offsets(len(requests), request_rate, burstiness, seed) if offsets is None else offsets
    if check_first:
        await check_setup(backend, requests[0])
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None
    bar = tqdm(total=len(requests), disable=not progress, desc=desc, unit="req")

    finished = [asyncio.Event() for _ in requests]

    async def one(i: int, req: SampleRequest, at: float) -> RequestOutput:
        if req.after >= 0:  # a conversation's next turn: once the previous one finished
            await finished[req.after].wait()
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            if semaphore is None:
                out = await backend.send(req, t0)
            else:
                async with semaphore:
                    out = await backend.send(req, t0)
        finally:
            finished[i].set()
        bar.update(1)
        return out

    t0 = time.perf_counter()
    outputs = await asyncio.gather(*(one(i, r, float(at)) for i, (r, at) in enumerate(zip(requests, offsets))))
    duration = time.perf_counter() - t0
    bar.close()
    return list(outputs), duration


# --- the server's counters (--metrics_url) --------------------------------------------------------------------

# Prometheus samples summed over their labels; serving/telemetry/metrics.py defines them.
SERVER_COUNTERS = {
    "prompt_tokens": "meshserve:prompt_tokens_total",  # a request's prompt, counted once (n > 1 too)
    "prefix_cache_hits": "meshserve:prefix_cache_hits_total",
    "step_tokens": "meshserve:step_tokens_total",  # every token run through the model: prompt chunks and decode
    "generation_tokens": "meshserve:generation_tokens_total",
    "finished_sequences": "meshserve:request_success_total",  # every sample, every finish reason
    "num_preemptions": "meshserve:num_preemptions_total",
    "running": "meshserve:num_requests_running",
    "waiting": "meshserve:num_requests_waiting",
}


def scrape_counters(metrics_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """SERVER_COUNTERS read from the instance's Prometheus endpoint."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as r:
        text = r.read().decode()
    by_sample = {name: 0.0 for name in SERVER_COUNTERS.values()}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in by_sample:
                by_sample[s.name] += s.value
    return {key: by_sample[name] for key, name in SERVER_COUNTERS.items()}


async def settled_counters(metrics_url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """The counters once nothing runs or waits and two reads 0.2 s apart agree (a finished request's books are kept
    just after its last token goes out)."""
    deadline = time.monotonic() + timeout_s
    last = await asyncio.to_thread(scrape_counters, metrics_url)
    while True:
        await asyncio.sleep(0.2)
        now = await asyncio.to_thread(scrape_counters, metrics_url)
        if (now == last and not now["running"] and not now["waiting"]) or time.monotonic() > deadline:
            return now
        last = now


def prefill_work(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """What the server computed between two reads. Prompt tokens run through the model = step tokens - decode tokens;
    every finished sequence (sample) fed all its generated tokens but the last one back as decode tokens. Without
    speculative decoding; recomputation after a preemption counts as prefill."""
    d = {k: int(round(after[k] - before[k])) for k in SERVER_COUNTERS if k not in ("running", "waiting")}
    d["prefill_tokens_computed"] = d["step_tokens"] - (d["generation_tokens"] - d["finished_sequences"])
    return d


# --- metrics --------------------------------------------------------------------------------------------------


def parse_goodput(spec: str) -> dict[str, float]:
    """'ttft:500,tpot:50' (or space-separated) -> {'ttft': 500.0, 'tpot': 50.0}, in ms."""
    slos = {}
    for item in filter(None, re.split(r"[,\s]+", spec or "")):
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"goodput item {item!r}: expected NAME:MS with NAME one of {list(GOODPUT_METRICS)}")
        slos[name] = float(value)
        if slos[name] < 0:
            raise ValueError(f"goodput {name}: the SLO must be >= 0 ms, got {value}")
    return slos


def _stats(prefix: str, values_s: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    if not len(ms):
        ms = np.zeros(1)
    out = {f"mean_{prefix}_ms": float(ms.mean()), f"median_{prefix}_ms": float(np.median(ms)),
           f"std_{prefix}_ms": float(ms.std())}
    out.update({f"p{p}_{prefix}_ms": float(np.percentile(ms, p)) for p in PERCENTILES})
    return out


def throughput_over_time(outputs: Sequence[RequestOutput], duration: float, bin_s: float = 0.0) -> dict:
    """Output tokens/s and requests in flight (time-weighted mean) per time bin (1 s, or 1/20 of a shorter run), and
    the most requests in flight at one instant."""
    bin_s = bin_s or (1.0 if duration >= 20 else max(duration / 20, 1e-3))
    n = max(1, math.ceil(duration / bin_s))
    tokens = np.zeros(n)
    running = np.zeros(n)
    edges = np.arange(n) * bin_s
    events = []
    for o in outputs:
        for t, k in zip(o.chunk_times_s, o.chunk_tokens):
            tokens[min(n - 1, int(t / bin_s))] += k
        if o.success:
            end = o.start_s + o.latency_s
            running += np.clip(np.minimum(edges + bin_s, end) - np.maximum(edges, o.start_s), 0, None) / bin_s
            events += [(o.start_s, 1), (end, -1)]
    peak = now = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):  # an end before a start at the same instant
        now += step
        peak = max(peak, now)
    return {"bin_s": bin_s, "time_s": edges.tolist(), "output_tokens_per_s": (tokens / bin_s).tolist(),
            "requests_in_flight": running.round(2).tolist(), "max_in_flight": peak}


def compute_metrics(outputs: Sequence[RequestOutput], duration: float, goodput: dict[str, float] | None = None
                    ) -> dict:
    """vLLM's calculate_metrics: over successful requests only; TPOT over those with more than one token (per sample:
    with n > 1, output tokens / n); a request is good when it meets every SLO (its TPOT taken as 0 with one token)."""
    ok = [o for o in outputs if o.success]
    ttfts = [o.ttft_s for o in ok]
    e2els = [o.latency_s for o in ok]
    per_sample = [o.output_len / o.num_samples for o in ok]  # n > 1: TPOT as one sample's stream sees it
    all_tpots = [(o.latency_s - o.ttft_s) / (k - 1) if k > 1 else 0.0 for o, k in zip(ok, per_sample)]
    tpots = [t for t, k in zip(all_tpots, per_sample) if k > 1]
    itls = [x for o in ok for x in o.itl_s]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_len for o in ok)
    good = len(ok)
    if goodput:
        per_request = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        good = sum(all(per_request[k][i] * 1e3 <= slo for k, slo in goodput.items()) for i in range(len(ok)))
    over_time = throughput_over_time(outputs, duration)
    m = {
        "duration": duration, "completed": len(ok), "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "request_goodput": good / duration if goodput else None,
        "output_throughput": total_out / duration, "total_token_throughput": (total_in + total_out) / duration,
        "max_output_tokens_per_s": max(over_time["output_tokens_per_s"]),
        "max_concurrent_requests": over_time["max_in_flight"],
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        m.update(_stats(name, values))
    m["throughput_over_time"] = over_time
    return m


def result_dict(outputs: Sequence[RequestOutput], duration: float, *, target: str, dataset: str,
                request_rate: float, burstiness: float, max_concurrency: int, goodput: dict[str, float],
                backend: str = "grpc", base_url: str = "", n: int = 1) -> dict:
    """The JSON result: the settings, the metrics, and per-request arrays as vLLM writes them."""
    rate = "inf" if math.isinf(request_rate) else request_rate
    out = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": BACKEND_LABELS[backend], "target": target,
           "base_url": base_url or None, "dataset": dataset, "num_prompts": len(outputs), "n": n,
           "request_rate": rate, "burstiness": burstiness, "max_concurrency": max_concurrency or None,
           "goodput_slos_ms": goodput or None}
    out.update(compute_metrics(outputs, duration, goodput))
    out["cached_prompt_tokens"] = sum(o.cached_tokens for o in outputs if o.success)
    out.update({
        "input_lens": [o.prompt_len for o in outputs],
        "requested_output_lens": [o.requested_output_len for o in outputs],
        "output_lens": [o.output_len if o.success else 0 for o in outputs],
        "start_times": [o.start_s for o in outputs],
        "ttfts": [o.ttft_s if o.success else None for o in outputs],
        "e2els": [o.latency_s if o.success else None for o in outputs],
        "itls": [o.itl_s for o in outputs],
        "errors": [o.error for o in outputs],
    })
    return out


def format_table(r: dict) -> str:
    """The result as `vllm bench serve` prints it (plus P90 and the end-to-end latency section)."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label, value, fmt="{:<10}"):
        lines.append("{:<40} ".format(label) + fmt.format(value))

    row("Successful requests:", r["completed"])
    row("Failed requests:", r["failed"])
    rate = r["request_rate"]
    row("Request rate configured (RPS):", rate if rate == "inf" else f"{rate:.2f}")
    if r["max_concurrency"]:
        row("Maximum request concurrency:", r["max_concurrency"])
    row("Benchmark duration (s):", r["duration"], "{:<10.2f}")
    row("Total input tokens:", r["total_input_tokens"])
    row("Total generated tokens:", r["total_output_tokens"])
    row("Request throughput (req/s):", r["request_throughput"], "{:<10.2f}")
    if r["request_goodput"] is not None:
        row("Request goodput (req/s):", r["request_goodput"], "{:<10.2f}")
    row("Output token throughput (tok/s):", r["output_throughput"], "{:<10.2f}")
    row("Peak output token throughput (tok/s):", r["max_output_tokens_per_s"], "{:<10.2f}")
    row("Peak concurrent requests:", r["max_concurrent_requests"])
    row("Total Token throughput (tok/s):", r["total_token_throughput"], "{:<10.2f}")
    for key, title, name in (("ttft", "Time to First Token", "TTFT"),
                             ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
                             ("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL")):
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {name} (ms):", r[f"mean_{key}_ms"], "{:<10.2f}")
        row(f"Median {name} (ms):", r[f"median_{key}_ms"], "{:<10.2f}")
        for p in PERCENTILES[1:]:
            row(f"P{p} {name} (ms):", r[f"p{p}_{key}_ms"], "{:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)


def write_plot(r: dict, path: str) -> None:
    """Latency CDFs (TTFT, TPOT and ITL, E2E) and output throughput / requests in flight over time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [i for i, n in enumerate(r["output_lens"]) if n > 0]
    ttft = [r["ttfts"][i] * 1e3 for i in ok]
    e2e = [r["e2els"][i] * 1e3 for i in ok]
    itl = [x * 1e3 for i in ok for x in r["itls"][i]]
    per_sample = [n / r.get("n", 1) for n in r["output_lens"]]
    tpot = [(r["e2els"][i] - r["ttfts"][i]) * 1e3 / (per_sample[i] - 1) for i in ok if per_sample[i] > 1]

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))

    def cdf(ax, series, title):
        for label, values in series:
            if values:
                x = np.sort(values)
                ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=f"{label} (n={len(x)})")
        ax.set(title=title, xlabel="ms", ylabel="fraction")
        ax.grid(alpha=0.3)
        ax.legend()

    cdf(axes[0, 0], [("TTFT", ttft)], "TTFT CDF")
    cdf(axes[0, 1], [("TPOT", tpot), ("ITL", itl)], "TPOT / ITL CDF")
    cdf(axes[1, 0], [("E2E", e2e)], "End-to-end latency CDF")
    t = r["throughput_over_time"]
    ax = axes[1, 1]
    ax.step(t["time_s"], t["output_tokens_per_s"], where="post", label="output tok/s")
    ax.set(title=f"Throughput over time ({t['bin_s']:.2g} s bins)", xlabel="s since start", ylabel="output tok/s")
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    twin.step(t["time_s"], t["requests_in_flight"], where="post", color="tab:orange", label="requests in flight")
    twin.set_ylabel("requests in flight")
    ax.legend(loc="upper left")
    twin.legend(loc="upper right")
    fig.suptitle(f"meshserve serve benchmark: {r['dataset']}, {r['num_prompts']} requests, rate {r['request_rate']}"
                 f", max concurrency {r['max_concurrency'] or 'none'}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- side by side: backends, and n samples vs n requests ------------------------------------------------------


def pooled_metrics(runs: Sequence[tuple[Sequence[RequestOutput], float]], goodput: dict[str, float] | None = None
                   ) -> dict:
    """One backend's rounds taken together: throughput over their summed durations, percentiles over every request."""
    outputs = [o for outs, _ in runs for o in outs]
    m = compute_metrics(outputs, sum(d for _, d in runs), goodput)
    for key in ("throughput_over_time", "max_output_tokens_per_s", "max_concurrent_requests"):
        del m[key]  # a run's own: the rounds' timelines overlap
    m["output_throughput_by_round"] = [sum(o.output_len for o in outs if o.success) / d for outs, d in runs]
    m["mean_input_tokens"] = m["total_input_tokens"] / max(1, m["completed"])
    m["cached_prompt_tokens"] = sum(o.cached_tokens for o in outputs if o.success)
    return m


def _settings_line(r: dict) -> str:
    return (f"{r['dataset']}, rate {r['request_rate']}, max concurrency {r['max_concurrency'] or 'none'}"
            + (f", n={r['n']}" if r.get("n", 1) > 1 else ""))


def format_comparison(r: dict) -> str:
    """The backends side by side, each pooled over its rounds, output throughput relative to the reference (grpc)."""
    ref = r["reference_backend"]
    cols = (f"{'Backend':<12} {'OK/failed':>10} {'req/s':>7} {'out tok/s':>10} {'vs ' + ref:>9}  "
            f"{'TTFT p50/p99':>15} {'TPOT p50/p99':>13} {'ITL p50/p99':>13} {'in tok/req':>10} {'cached':>7}")
    rounds = r["rounds"]
    lines = ["{s:{c}^{n}}".format(s=" Backends side by side ", n=len(cols), c="="),
             f"{r['num_prompts']} requests x {rounds} round{'s' if rounds > 1 else ''}: {_settings_line(r)}",
             "(latencies in ms: median/p99)", cols, "-" * len(cols)]
    for name in r["backends"]:
        s = r["summary"][name]

        def pair(key, s=s):
            return f"{s[f'median_{key}_ms']:.1f}/{s[f'p99_{key}_ms']:.1f}"
        lines.append(f"{name:<12} {str(s['completed']) + '/' + str(s['failed']):>10} {s['request_throughput']:>7.2f} "
                     f"{s['output_throughput']:>10.1f} {s['relative_output_throughput']:>8.3f}x  {pair('ttft'):>15} "
                     f"{pair('tpot'):>13} {pair('itl'):>13} {s['mean_input_tokens']:>10.1f} "
                     f"{s['cached_prompt_tokens']:>7}")
    lines.append("-" * len(cols))
    notes = []
    if rounds > 1:
        notes.append("Output tok/s by round: " + "; ".join(
            f"{name} " + " / ".join(f"{x:.1f}" for x in r["summary"][name]["output_throughput_by_round"])
            for name in r["backends"]))
    if rounds > 1 and len(r["backends"]) > 1:
        notes.append(f"Order: odd rounds {' > '.join(r['backends'])}, even rounds reversed.")
    notes.append("Chunks: gRPC responses carrying tokens; HTTP SSE chunks carrying text (TTFT, ITL). Output tokens: "
                 "gRPC token ids, HTTP usage.completion_tokens.")
    if "openai-chat" in r["backends"] and r["dataset"] == "random":
        notes.append("openai-chat sends each prompt's token ids as text in a user message, re-tokenized with the chat "
                     "template around it: its input tokens differ.")
    if any(r["summary"][name]["cached_prompt_tokens"] for name in r["backends"]):
        notes.append("Prefix-cache hits (cached) differ between runs (a run reuses pages an earlier one cached): serve "
                     "with --enable_prefix_caching=false for a like-for-like comparison.")
    lines.extend(textwrap.fill(note, len(cols), subsequent_indent="  ") for note in notes)
    lines.append("=" * len(cols))
    return "\n".join(lines)


def n_run_summary(outputs: Sequence[RequestOutput], duration: float, *, n: int, per_prompt: int,
                  server: dict | None = None) -> dict:
    """One run of --compare_n: `outputs` in order, `per_prompt` consecutive requests per prompt (1 for requests
    with n samples, n for separate requests); `server` the prefill_work between the run's start and end."""
    ok = [o for o in outputs if o.success]
    groups = [outputs[i:i + per_prompt] for i in range(0, len(outputs), per_prompt)]
    done = [max(o.start_s + o.latency_s for o in g) - min(o.start_s for o in g)
            for g in groups if all(o.success for o in g)]
    out_tokens = sum(o.output_len for o in ok)
    m = {"n": n, "requests": len(outputs), "completed": len(ok), "failed": len(outputs) - len(ok),
         "samples": len(ok) * n, "prompt_tokens_sent": sum(o.prompt_len for o in outputs),
         "output_tokens": out_tokens, "duration": duration, "output_throughput": out_tokens / duration,
         "server": server}
    m.update(_stats("e2el", [o.latency_s for o in ok]))
    m.update(_stats("prompt_done", done))  # arrival to the last sample of the prompt
    m.update(_stats("ttft", [o.ttft_s for o in ok]))
    return m


def format_compare_n(r: dict) -> str:
    """n samples per request against n separate requests, in two columns."""
    k, a, b = r["k"], r["runs"]["n"], r["runs"]["separate"]
    width, notes = 78, []
    lines = ["{s:{c}^{n}}".format(s=f" n={k} vs {k} separate requests ({r['backend']}) ", n=width, c="="),
             f"{r['num_prompts']} prompts: {_settings_line(r)}", f"{'':<46}{f'n={k}':>15}{f'{k} x n=1':>16}"]

    def row(label, x, y):
        lines.append(f"{label:<46}{x:>15}{y:>16}")
    row("Requests completed / sent", f"{a['completed']}/{a['requests']}", f"{b['completed']}/{b['requests']}")
    row("Samples completed", a["samples"], b["samples"])
    row("Output tokens", a["output_tokens"], b["output_tokens"])
    row("Duration (s)", f"{a['duration']:.2f}", f"{b['duration']:.2f}")
    row("Output token throughput (tok/s)", f"{a['output_throughput']:.1f}", f"{b['output_throughput']:.1f}")
    for key, label in (("e2el", "request latency"), ("prompt_done", "prompt done (last sample)"), ("ttft", "TTFT")):
        row(f"Median / P99 {label} (ms)", f"{a[f'median_{key}_ms']:.0f}/{a[f'p99_{key}_ms']:.0f}",
            f"{b[f'median_{key}_ms']:.0f}/{b[f'p99_{key}_ms']:.0f}")
    row("Prompt tokens sent", a["prompt_tokens_sent"], b["prompt_tokens_sent"])
    if a["server"] is None or b["server"] is None:
        notes.append("Prefill work: not measured (give --metrics_url=http://HOST:PORT/metrics, the instance's "
                     "Prometheus endpoint).")
    else:
        sa, sb = a["server"], b["server"]
        lines.append(f"-- the server's work, from {r['metrics_url']} --")
        row("Prompt tokens computed (prefill)", sa["prefill_tokens_computed"], sb["prefill_tokens_computed"])
        row("Prompt tokens counted (meshserve:prompt_tokens)", sa["prompt_tokens"], sb["prompt_tokens"])
        row("Prefix-cache hits (tokens)", sa["prefix_cache_hits"], sb["prefix_cache_hits"])
        row("Preemptions", sa["num_preemptions"], sb["num_preemptions"])
        notes.append("Computed = step tokens - decode tokens (generated - finished sequences): every prompt token run "
                     "through the model. The counter counts a request's prompt once, n samples or not. Prefix "
                     "caching as the server runs it (the hits above).")
    cap = r["max_concurrency"]
    notes.append(f"Each run has its own prompts (so neither reuses pages the other cached); {k} x n=1 sends each "
                 f"prompt {k} times at its arrival time" + (f", up to {cap * k} requests in flight against {cap} "
                                                           f"(the same sequences)." if cap else "."))
    notes.append(f"n={k}: the samples share the prompt's full KV pages ({r['page_size']} tokens each); each extra "
                 f"sample computes only the page holding the last prompt token.")
    lines.extend(textwrap.fill(note, width, subsequent_indent="  ") for note in notes)
    lines.append("=" * width)
    return "\n".join(lines)


# --- entry points ---------------------------------------------------------------------------------------------


def load_requests(target: str, dataset: str, num_prompts: int, *, seed: int = 0, input_len: int = 1024,
                  output_len: int = 128, range_ratio: float = 0.0, prefix_len: int = 0, dataset_path: str = "",
                  sharegpt_output_len: int = 0, multiturn: tuple[int, int, int] = (8, 512, 32)) -> list[SampleRequest]:
    """The dataset's requests, sized for the server at `target` (its vocabulary, EOS ids, context, tokenizer);
    `multiturn`: (conversations, history_len, turn_len)."""
    from serving.wire.client import Client
    with Client(target, timeout=60) as c:
        info = c.model_info()
        if dataset == "random":
            return random_requests(num_prompts, input_len, output_len, range_ratio, prefix_len, info.vocab_size,
                                   seed, list(info.eos_token_ids))
        if dataset == "multiturn":
            return multiturn_requests(num_prompts, *multiturn, output_len, info.vocab_size, seed,
                                      list(info.eos_token_ids))
        if not dataset_path:
            raise ValueError("--dataset=sharegpt needs --dataset_path=FILE.json")
        if not info.has_tokenizer:
            raise ValueError(f"--dataset=sharegpt sends text, but the model at {target} has no tokenizer")
        return sharegpt_requests(dataset_path, num_prompts,
                                 lambda text, special: c.tokenize(text, add_special_tokens=special),
                                 info.max_model_len, seed, sharegpt_output_len)


def _write_json(r: dict, path: str) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(r, f, indent=1)


def benchmark(target: str, requests: Sequence[SampleRequest], *, backend: str = "grpc", base_url: str = "",
              n: int = 1, dataset: str = "random", request_rate: float = float("inf"), burstiness: float = 1.0,
              max_concurrency: int = 0, seed: int = 0, goodput: str = "", ignore_eos: bool = True,
              temperature: float = 0.0, request_timeout_s: float = 0.0, progress: bool = True, result_json: str = "",
              plot: str = "") -> dict:
    """Runs the requests through one backend (gRPC at `target`, or the HTTP API at `base_url`); returns the result
    dict (and writes the JSON and the PNG if asked)."""
    slos = parse_goodput(goodput)

    async def run():
        async with make_backend(backend, target=target, base_url=base_url, n=n, temperature=temperature,
                                ignore_eos=ignore_eos, timeout_s=request_timeout_s,
                                max_connections=max_concurrency) as b:
            await b.prepare(requests)
            return await run_requests(b, requests, request_rate=request_rate, burstiness=burstiness,
                                      max_concurrency=max_concurrency, seed=seed, progress=progress)
    outputs, duration = asyncio.run(run())
    r = result_dict(outputs, duration, target=target, dataset=dataset, request_rate=request_rate,
                    burstiness=burstiness, max_concurrency=max_concurrency, goodput=slos, backend=backend,
                    base_url=base_url, n=n)
    _write_json(r, result_json)
    if plot:
        write_plot(r, plot)
    return r


def compare_backends(target: str, requests: Sequence[SampleRequest], backends: Sequence[str], *, base_url: str = "",
                     rounds: int = 1, n: int = 1, dataset: str = "random", request_rate: float = float("inf"),
                     burstiness: float = 1.0, max_concurrency: int = 0, seed: int = 0, goodput: str = "",
                     ignore_eos: bool = True, temperature: float = 0.0, request_timeout_s: float = 0.0,
                     progress: bool = True, result_json: str = "", plot: str = "", log=print) -> dict:
    """The same requests (same arrival times) through each backend in turn, `rounds` times, the order reversed every
    other round so drift on a shared machine hits all alike. Returns {"summary": {backend: metrics pooled over its
    rounds, with relative_output_throughput against grpc (else the first)}, "runs": {backend: [result per round]},
    settings}; writes the JSON, and a plot per backend (its first round) at PLOT.<backend>.png, if asked."""
    backends = list(backends)
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    slos = parse_goodput(goodput)

    async def run():
        runs = {name: [] for name in backends}
        async with contextlib.AsyncExitStack() as stack:
            opened = {}
            for name in backends:
                opened[name] = await stack.enter_async_context(make_backend(
                    name, target=target, base_url=base_url, n=n, temperature=temperature, ignore_eos=ignore_eos,
                    timeout_s=request_timeout_s, max_connections=max_concurrency))
                await opened[name].prepare(requests)  # before any timing (chat: token ids to text)
            for i in range(rounds):
                for name in backends if i % 2 == 0 else backends[::-1]:
                    outputs, duration = await run_requests(
                        opened[name], requests, request_rate=request_rate, burstiness=burstiness,
                        max_concurrency=max_concurrency, seed=seed, progress=progress, desc=f"{name} {i + 1}")
                    runs[name].append((outputs, duration))
                    ok = [o for o in outputs if o.success]
                    log(f"round {i + 1} {name}: {len(ok)}/{len(outputs)} requests, "
                        f"{sum(o.output_len for o in ok)} output tokens in {duration:.2f} s")
        return runs
    runs = asyncio.run(run())
    settings = dict(target=target, base_url=base_url or None, dataset=dataset, num_prompts=len(requests), n=n,
                    request_rate="inf" if math.isinf(request_rate) else request_rate, burstiness=burstiness,
                    max_concurrency=max_concurrency or None, goodput_slos_ms=slos or None)
    summary = {name: pooled_metrics(rs, slos) for name, rs in runs.items()}
    reference = "grpc" if "grpc" in summary else backends[0]
    for s in summary.values():
        base = summary[reference]["output_throughput"]
        s["relative_output_throughput"] = s["output_throughput"] / base if base else float("nan")
    r = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), **settings, "backends": backends, "rounds": rounds,
         "reference_backend": reference, "summary": summary,
         "runs": {name: [result_dict(outs, d, target=target, dataset=dataset, request_rate=request_rate,
                                     burstiness=burstiness, max_concurrency=max_concurrency, goodput=slos,
                                     backend=name, base_url=base_url, n=n) for outs, d in rs]
                  for name, rs in runs.items()}}
    _write_json(r, result_json)
    if plot:
        root, ext = os.path.splitext(plot)
        for name in backends:
            write_plot(r["runs"][name][0], f"{root}.{name}{ext or '.png'}")
    return r


def compare_n(target: str, requests: Sequence[SampleRequest], separate_requests: Sequence[SampleRequest], k: int, *,
              backend: str = "grpc", base_url: str = "", metrics_url: str = "", dataset: str = "random",
              request_rate: float = float("inf"), burstiness: float = 1.0, max_concurrency: int = 0, seed: int = 0,
              ignore_eos: bool = True, temperature: float = 0.0, request_timeout_s: float = 0.0,
              progress: bool = True, result_json: str = "") -> dict:
    """Two runs through `backend`: `requests` with n=k, then `separate_requests` (as many, other prompts, so that
    neither run reuses pages the other cached) each sent k times at its arrival time, with k times the concurrency
    cap (the same sequences in flight). With `metrics_url`, each run's prefill work read from the server's counters
    (prefill_work). Returns {"runs": {"n": ..., "separate": ...}, settings} (n_run_summary each)."""
    from serving.wire.client import Client
    if k < 2:
        raise ValueError(f"compare_n needs k >= 2 samples, got {k}")
    if len(separate_requests) != len(requests):
        raise ValueError(f"compare_n: {len(requests)} prompts for n={k} but {len(separate_requests)} for the copies")
    with Client(target, timeout=60) as c:
        page_size = c.model_info().page_size
    offsets = arrival_offsets(len(requests), request_rate, burstiness, seed)
    copies = [r for r in separate_requests for _ in range(k)]
    common = dict(target=target, base_url=base_url, temperature=temperature, ignore_eos=ignore_eos,
                  timeout_s=request_timeout_s)

    async def one(label, b, reqs, at, cap, n, per_prompt):
        async with b:
            await b.prepare(reqs)
            await check_setup(b, reqs[0])
            before = await settled_counters(metrics_url) if metrics_url else None
            outputs, duration = await run_requests(b, reqs, offsets=at, max_concurrency=cap, check_first=False,
                                                   progress=progress, desc=label)
            server = prefill_work(before, await settled_counters(metrics_url)) if metrics_url else None
        return n_run_summary(outputs, duration, n=n, per_prompt=per_prompt, server=server)

    async def run():
        with_n = await one(f"n={k}", make_backend(backend, n=k, max_connections=max_concurrency, **common),
                           requests, offsets, max_concurrency, k, 1)
        separate = await one(f"{k} x n=1", make_backend(backend, n=1, max_connections=max_concurrency * k, **common),
                             copies, np.repeat(offsets, k), max_concurrency * k, 1, k)
        return {"n": with_n, "separate": separate}
    runs = asyncio.run(run())
    r = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "mode": "compare_n", "k": k,
         "backend": backend, "target": target, "base_url": base_url or None,
         "metrics_url": metrics_url or None, "dataset": dataset, "num_prompts": len(requests), "page_size": page_size,
         "request_rate": "inf" if math.isinf(request_rate) else request_rate, "burstiness": burstiness,
         "max_concurrency": max_concurrency or None, "runs": runs}
    _write_json(r, result_json)
    return r


def main() -> None:
    backends = parse_backends(_BACKEND.value)
    k, n = _COMPARE_N.value, _N.value
    if k == 1 or k < 0:
        raise ValueError(f"--compare_n={k}: give K >= 2 samples (0: off)")
    if n < 1 or (k and n != 1):
        raise ValueError(f"--n={n}: give n >= 1, and leave it at 1 with --compare_n (which sets n itself)")
    num = _NUM_PROMPTS.value
    requests = load_requests(_TARGET.value, _DATASET.value, 2 * num if k else num, seed=_SEED.value,
                             input_len=_RANDOM_INPUT_LEN.value, output_len=_RANDOM_OUTPUT_LEN.value,
                             range_ratio=_RANDOM_RANGE_RATIO.value, prefix_len=_RANDOM_PREFIX_LEN.value,
                             dataset_path=_DATASET_PATH.value, sharegpt_output_len=_SHAREGPT_OUTPUT_LEN.value,
                             multiturn=(_MULTITURN_CONVERSATIONS.value, _MULTITURN_HISTORY_LEN.value,
                                        _MULTITURN_TURN_LEN.value))
    for i, req in enumerate(requests):  # adapters mixed uniformly over the requests, as they arrive
        req.adapter = _LORA_ADAPTERS.value[i % len(_LORA_ADAPTERS.value)] if _LORA_ADAPTERS.value else ""
    where = ", ".join(f"{b} at {_TARGET.value if b == 'grpc' else _BASE_URL.value}" for b in backends)
    print(f"{num} requests through {where}: rate {_REQUEST_RATE.value}, burstiness {_BURSTINESS.value}, max "
          f"concurrency {_MAX_CONCURRENCY.value or 'none'}"
          + (f", LoRA adapters {', '.join(_LORA_ADAPTERS.value)}" if _LORA_ADAPTERS.value else ""), flush=True)
    common = dict(base_url=_BASE_URL.value, dataset=_DATASET.value, request_rate=_REQUEST_RATE.value,
                  burstiness=_BURSTINESS.value, max_concurrency=_MAX_CONCURRENCY.value, seed=_SEED.value,
                  ignore_eos=_IGNORE_EOS.value, temperature=_TEMPERATURE.value,
                  request_timeout_s=_REQUEST_TIMEOUT_S.value, progress=not _DISABLE_TQDM.value,
                  result_json=_RESULT_JSON.value)
    if k:
        r = compare_n(_TARGET.value, requests[:num], requests[num:], k, backend=backends[0],
                      metrics_url=_METRICS_URL.value, **common)
        print(format_compare_n(r), flush=True)
    elif len(backends) == 1 and _ROUNDS.value == 1:
        r = benchmark(_TARGET.value, requests, backend=backends[0], n=n, goodput=_GOODPUT.value, plot=_PLOT.value,
                      **common)
        print(format_table(r), flush=True)
    else:
        r = compare_backends(_TARGET.value, requests, backends, rounds=_ROUNDS.value, n=n, goodput=_GOODPUT.value,
                             plot=_PLOT.value, log=lambda line: print(line, flush=True), **common)
        print(format_comparison(r), flush=True)
