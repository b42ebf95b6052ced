"""Serving benchmark over gRPC, in the method of `vllm bench serve`: an open-loop request stream through
meshserve.v1 Inference.Generate; throughput, TTFT / TPOT / ITL / E2E latency and goodput. Details: docs/benchmarks.md.

    python -m serving.bench serve --target=HOST:PORT [--request_rate=8] [--dataset=random|sharegpt] [...]
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import re
import time
from datetime import datetime
from typing import Sequence

import numpy as np
from absl import flags

_TARGET = flags.DEFINE_string("target", "127.0.0.1:50051", "Server (or gateway) address, HOST:PORT.")
_REQUEST_RATE = flags.DEFINE_float("request_rate", float("inf"),
                                   "Mean arrivals per second; inf sends every request at once.")
_BURSTINESS = flags.DEFINE_float("burstiness", 1.0,
                                 "Gamma shape of the inter-arrival times: 1 = Poisson, < 1 burstier, > 1 steadier.")
_MAX_CONCURRENCY = flags.DEFINE_integer("max_concurrency", 0, "Requests in flight at most; 0: no cap.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 1000, "Requests to send.")
_DATASET = flags.DEFINE_enum("dataset", "random", ["random", "sharegpt"], "Where prompts come from.")
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

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 90, 99)


@dataclasses.dataclass(slots=True)
class SampleRequest:
    prompt: str | list[int]  # token ids (random) or text (ShareGPT)
    prompt_len: int
    output_len: int


@dataclasses.dataclass(slots=True)
class RequestOutput:
    prompt_len: int
    requested_output_len: int
    success: bool = False
    error: str = ""
    output_len: int = 0  # tokens streamed back
    start_s: float = 0.0  # sent, seconds from the benchmark's start
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = dataclasses.field(default_factory=list)  # gaps between chunks carrying tokens
    chunk_times_s: list[float] = dataclasses.field(default_factory=list)  # from the benchmark's start
    chunk_tokens: list[int] = dataclasses.field(default_factory=list)


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


async def _send(client, req: SampleRequest, t0: float, sampling: dict, timeout: float | None) -> RequestOutput:
    from serving.server.client import ClientError
    out = RequestOutput(req.prompt_len, req.output_len)
    start = time.perf_counter()
    out.start_s = start - t0
    last = start
    try:
        async for r in client.generate(req.prompt, max_tokens=req.output_len, timeout=timeout, **sampling):
            n = len(r.token_ids)
            if not n:
                continue
            now = time.perf_counter()
            if out.output_len == 0:
                out.ttft_s = now - start
            else:
                out.itl_s.append(now - last)
            last = now
            out.output_len += n
            out.chunk_times_s.append(now - t0)
            out.chunk_tokens.append(n)
        out.latency_s = time.perf_counter() - start
        out.success = out.output_len > 0
        out.error = "" if out.success else "the stream ended without a token"
    except ClientError as e:
        out.error = str(e)
    except Exception as e:  # noqa: BLE001 - a broken stream fails this request, not the benchmark
        out.error = f"{type(e).__name__}: {e}"
    return out


async def run_requests(target: str, requests: Sequence[SampleRequest], *, request_rate: float = float("inf"),
                       burstiness: float = 1.0, max_concurrency: int = 0, seed: int = 0, ignore_eos: bool = True,
                       temperature: float = 0.0, request_timeout_s: float = 0.0, progress: bool = True
                       ) -> tuple[list[RequestOutput], float]:
    """Sends `requests` at their arrival times; returns their outputs (in order) and the benchmark duration
    (first send to last completion). One initial request checks the set-up first, as vLLM does."""
    from tqdm import tqdm

    from serving.server.client import AsyncClient
    sampling = dict(temperature=temperature, ignore_eos=ignore_eos)
    timeout = request_timeout_s or None
    offsets = arrival_offsets(len(requests), request_rate, burstiness, seed)
    async with AsyncClient(target) as client:
        probe = await _send(client, requests[0], time.perf_counter(), sampling, timeout)
        if not probe.success:
            raise RuntimeError(f"the initial test request to {target} failed: {probe.error}")
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None
        bar = tqdm(total=len(requests), disable=not progress, desc="requests", unit="req")

        async def one(req: SampleRequest, at: float) -> RequestOutput:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if semaphore is None:
                out = await _send(client, req, t0, sampling, timeout)
            else:
                async with semaphore:
                    out = await _send(client, req, t0, sampling, timeout)
            bar.update(1)
            return out

        t0 = time.perf_counter()
        outputs = await asyncio.gather(*(one(r, float(at)) for r, at in zip(requests, offsets)))
        duration = time.perf_counter() - t0
        bar.close()
    return list(outputs), duration


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
    """Output tokens/s and requests in flight per time bin (1 s, or 1/20 of a shorter run)."""
    bin_s = bin_s or (1.0 if duration >= 20 else max(duration / 20, 1e-3))
    n = max(1, math.ceil(duration / bin_s))
    tokens = np.zeros(n)
    running = np.zeros(n)
    edges = np.arange(n) * bin_s
    for o in outputs:
        for t, k in zip(o.chunk_times_s, o.chunk_tokens):
            tokens[min(n - 1, int(t / bin_s))] += k
        if o.success:
            end = o.start_s + o.latency_s
            running += (edges + bin_s > o.start_s) & (edges < end)  # overlaps the bin at all
    return {"bin_s": bin_s, "time_s": edges.tolist(), "output_tokens_per_s": (tokens / bin_s).tolist(),
            "requests_in_flight": running.astype(int).tolist()}


def compute_metrics(outputs: Sequence[RequestOutput], duration: float, goodput: dict[str, float] | None = None
                    ) -> dict:
    """vLLM's calculate_metrics: over successful requests only; TPOT over those with more than one token;
    a request is good when it meets every SLO (its TPOT taken as 0 with one token)."""
    ok = [o for o in outputs if o.success]
    ttfts = [o.ttft_s for o in ok]
    e2els = [o.latency_s for o in ok]
    all_tpots = [(o.latency_s - o.ttft_s) / (o.output_len - 1) if o.output_len > 1 else 0.0 for o in ok]
    tpots = [t for t, o in zip(all_tpots, ok) if o.output_len > 1]
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
        "max_concurrent_requests": max(over_time["requests_in_flight"]),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        m.update(_stats(name, values))
    m["throughput_over_time"] = over_time
    return m


def result_dict(outputs: Sequence[RequestOutput], duration: float, *, target: str, dataset: str,
                request_rate: float, burstiness: float, max_concurrency: int, goodput: dict[str, float]) -> dict:
    """The JSON result: the settings, the metrics, and per-request arrays as vLLM writes them."""
    rate = "inf" if math.isinf(request_rate) else request_rate
    out = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "meshserve-grpc", "target": target,
           "dataset": dataset, "num_prompts": len(outputs), "request_rate": rate, "burstiness": burstiness,
           "max_concurrency": max_concurrency or None, "goodput_slos_ms": goodput or None}
    out.update(compute_metrics(outputs, duration, goodput))
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
    tpot = [(r["e2els"][i] - r["ttfts"][i]) * 1e3 / (r["output_lens"][i] - 1) for i in ok if r["output_lens"][i] > 1]

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


# --- entry points ---------------------------------------------------------------------------------------------


def load_requests(target: str, dataset: str, num_prompts: int, *, seed: int = 0, input_len: int = 1024,
                  output_len: int = 128, range_ratio: float = 0.0, prefix_len: int = 0, dataset_path: str = "",
                  sharegpt_output_len: int = 0) -> list[SampleRequest]:
    """The dataset's requests, sized for the server at `target` (its vocabulary, EOS ids, context, tokenizer)."""
    from serving.server.client import Client
    with Client(target, timeout=60) as c:
        info = c.model_info()
        if dataset == "random":
            return random_requests(num_prompts, input_len, output_len, range_ratio, prefix_len, info.vocab_size,
                                   seed, list(info.eos_token_ids))
        if not dataset_path:
            raise ValueError("--dataset=sharegpt needs --dataset_path=FILE.json")
        if not info.has_tokenizer:
            raise ValueError(f"--dataset=sharegpt sends text, but the model at {target} has no tokenizer")
        return sharegpt_requests(dataset_path, num_prompts,
                                 lambda text, special: c.tokenize(text, add_special_tokens=special),
                                 info.max_model_len, seed, sharegpt_output_len)


def benchmark(target: str, requests: Sequence[SampleRequest], *, dataset: str = "random",
              request_rate: float = float("inf"), burstiness: float = 1.0, max_concurrency: int = 0, seed: int = 0,
              goodput: str = "", ignore_eos: bool = True, temperature: float = 0.0, request_timeout_s: float = 0.0,
              progress: bool = True, result_json: str = "", plot: str = "") -> dict:
    """Runs the requests against `target`; returns the result dict (and writes the JSON and the PNG if asked)."""
    slos = parse_goodput(goodput)
    outputs, duration = asyncio.run(run_requests(
        target, requests, request_rate=request_rate, burstiness=burstiness, max_concurrency=max_concurrency,
        seed=seed, ignore_eos=ignore_eos, temperature=temperature, request_timeout_s=request_timeout_s,
        progress=progress))
    r = result_dict(outputs, duration, target=target, dataset=dataset, request_rate=request_rate,
                    burstiness=burstiness, max_concurrency=max_concurrency, goodput=slos)
    if result_json:
        with open(result_json, "w") as f:
            json.dump(r, f, indent=1)
    if plot:
        write_plot(r, plot)
    return r


def main() -> None:
    requests = load_requests(_TARGET.value, _DATASET.value, _NUM_PROMPTS.value, seed=_SEED.value,
                             input_len=_RANDOM_INPUT_LEN.value, output_len=_RANDOM_OUTPUT_LEN.value,
                             range_ratio=_RANDOM_RANGE_RATIO.value, prefix_len=_RANDOM_PREFIX_LEN.value,
                             dataset_path=_DATASET_PATH.value, sharegpt_output_len=_SHAREGPT_OUTPUT_LEN.value)
    print(f"{len(requests)} requests to {_TARGET.value}: rate {_REQUEST_RATE.value}, burstiness "
          f"{_BURSTINESS.value}, max concurrency {_MAX_CONCURRENCY.value or 'none'}", flush=True)
    r = benchmark(_TARGET.value, requests, dataset=_DATASET.value, request_rate=_REQUEST_RATE.value,
                  burstiness=_BURSTINESS.value, max_concurrency=_MAX_CONCURRENCY.value, seed=_SEED.value,
                  goodput=_GOODPUT.value, ignore_eos=_IGNORE_EOS.value, temperature=_TEMPERATURE.value,
                  request_timeout_s=_REQUEST_TIMEOUT_S.value, progress=not _DISABLE_TQDM.value,
                  result_json=_RESULT_JSON.value, plot=_PLOT.value)
    print(format_table(r), flush=True)
