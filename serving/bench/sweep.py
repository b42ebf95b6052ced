"""`python -m serving.bench sweep`: the serving benchmark at several request rates against a local server on the ~125M
Llama, then the same workload through the offline engine in-process, for the overhead of the gRPC path.
Details: docs/benchmarks.md."""
from __future__ import annotations

import json
import math
import os
import tempfile
import time

from absl import flags

from serving.bench import serve
from serving.bench.harness import llama_125m, table

_SWEEP_RATES = flags.DEFINE_list("sweep_rates", ["1", "2", "4", "8", "inf"], "Sweep: request rates.")
_SWEEP_NUM_PROMPTS = flags.DEFINE_integer("sweep_num_prompts", 32, "Sweep: requests per rate.")
_SWEEP_INPUT_LEN = flags.DEFINE_integer("sweep_input_len", 128, "Sweep: prompt tokens.")
_SWEEP_OUTPUT_LEN = flags.DEFINE_integer("sweep_output_len", 64, "Sweep: output tokens.")

# The engine of both sides (as serving/bench/offline.py runs it, with fewer pages: 32 x 192 tokens fit in 512).
ENGINE_OPTIONS = dict(dtype="float32", page_size=16, num_pages=1024, max_num_seqs=16, max_num_batched_tokens=256,
                      min_token_bucket=16, enable_prefix_caching=False)


def _server_flags() -> list[str]:
    out = []
    for k, v in ENGINE_OPTIONS.items():
        out.append(f"--{k}={v}" if not isinstance(v, bool) else f"--{'' if v else 'no'}{k}")
    return out


def offline_throughput(model: str, requests: list[serve.SampleRequest]) -> dict:
    """The requests all at once through LLM.generate (after one warm-up request), as the gRPC run at rate inf."""
    from serving.core.llm import LLM
    from serving.params import SamplingParams
    llm = LLM(model, **ENGINE_OPTIONS)
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    llm.generate([requests[0].prompt], params[:1])
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in requests], params)
    duration = time.perf_counter() - t0
    total_out = sum(len(o.token_ids) for o in outs)
    total_in = sum(r.prompt_len for r in requests)
    return {"duration": duration, "total_output_tokens": total_out, "output_throughput": total_out / duration,
            "total_token_throughput": (total_in + total_out) / duration, "request_throughput": len(outs) / duration}


def main() -> None:
    from serving.process import ServerProcess
    rates = [float(x) for x in _SWEEP_RATES.value]
    n, n_in, n_out = _SWEEP_NUM_PROMPTS.value, _SWEEP_INPUT_LEN.value, _SWEEP_OUTPUT_LEN.value
    model = llama_125m("float32")
    print(json.dumps({"sweep_rates": _SWEEP_RATES.value, "num_prompts": n, "input_len": n_in,
                      "output_len": n_out, "engine": ENGINE_OPTIONS, "cpus": os.cpu_count(),
                      "load": os.getloadavg()}), flush=True)
    workdir = tempfile.mkdtemp(prefix="meshserve-sweep-")
    t_start = time.perf_counter()
    # The platform the caller chose (ServerProcess pins CPU for tests).
    server = ServerProcess(model, workdir, *_server_flags(), env={"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "")})
    results = []
    try:
        server.wait_ready(timeout=1800)
        print(f"server ready in {time.perf_counter() - t_start:.0f} s at {server.target}", flush=True)
        requests = serve.load_requests(server.target, "random", n, seed=serve._SEED.value, input_len=n_in,
                                       output_len=n_out)
        for rate in rates:
            r = serve.benchmark(server.target, requests, request_rate=rate, seed=serve._SEED.value,
                                goodput=serve._GOODPUT.value, progress=not serve._DISABLE_TQDM.value)
            print(f"\nrate {r['request_rate']} req/s:\n{serve.format_table(r)}", flush=True)
            results.append(r)
    finally:
        rc = server.terminate()
        if rc != 0:
            print(f"the server exited with {rc}; its log: {server.log_path}", flush=True)
    rows = [[r["request_rate"], r["completed"], r["failed"], r["median_ttft_ms"], r["p99_ttft_ms"],
             r["median_tpot_ms"], r["p99_tpot_ms"], r["request_throughput"], r["output_throughput"],
             r["total_token_throughput"]] for r in results]
    table(f"Serving sweep over gRPC: ~125M Llama float32, {n} requests x ({n_in} in, {n_out} out), "
          f"max_num_seqs {ENGINE_OPTIONS['max_num_seqs']}",
          ["rate (req/s)", "completed", "failed", "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)", "TPOT p99 (ms)",
           "req/s", "output tok/s", "total tok/s"], rows)

    offline = offline_throughput(model, requests)
    # The all-at-once run is the offline engine's workload; without one, the fastest rate.
    inf_runs = [r for r in results if r["request_rate"] == "inf"]
    grpc = inf_runs[-1] if inf_runs else max(results, key=lambda r: r["output_throughput"])
    ratio = grpc["output_throughput"] / offline["output_throughput"]
    table("gRPC path vs offline engine, same workload all at once",
          ["path", "duration (s)", "output tok/s", "total tok/s"],
          [[f"gRPC (rate {grpc['request_rate']})", grpc["duration"], grpc["output_throughput"],
            grpc["total_token_throughput"]],
           ["offline LLM.generate", offline["duration"], offline["output_throughput"],
            offline["total_token_throughput"]],
           ["ratio gRPC / offline", grpc["duration"] / offline["duration"], ratio,
            grpc["total_token_throughput"] / offline["total_token_throughput"]]])
    print(f"\nsweep took {time.perf_counter() - t_start:.0f} s; load average now {os.getloadavg()}", flush=True)
    if serve._RESULT_JSON.value:
        summary = {"runs": [{k: v for k, v in r.items() if not isinstance(v, (list, dict)) or k == "goodput_slos_ms"}
                            for r in results],
                   "offline": offline, "grpc_over_offline_output_throughput": ratio,
                   "rates": [x if not math.isinf(x) else "inf" for x in rates]}
        with open(serve._RESULT_JSON.value, "w") as f:
            json.dump(summary, f, indent=1)
