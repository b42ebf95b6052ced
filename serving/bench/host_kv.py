"""A short measurement of the host KV tier (issue 39): time to first token of a 241-token prompt recomputed, hit in
the device pool and hit in the host tier, and the tier's copy bandwidth each way against numpy's memcpy, on the shipped
tiny model (page_size 16); `multiturn`: `serving.bench serve`'s multi-turn dataset through an instance server with and
without the tier (TTFT, throughput, hit rates); `preemption`: preempted sequences recomputed or brought back from the
host tier. Run: `python -m serving.bench.host_kv [multiturn | preemption]` (figures: docs/engine.md)."""
import os
import sys
import tempfile
import time

import jax
import numpy as np

from serving.core.llm import LLM
from serving.core.sampling_params import SamplingParams


def main() -> None:
    llm = LLM('models/tiny/target', warmup=False, num_pages=32, page_size=16, host_kv_cache_gb=0.05,
              max_num_batched_tokens=256, max_num_seqs=4)
    e, pool = llm.engine, llm.engine.host_kv
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(0)

    def prompt():
        return [int(t) for t in rng.integers(3, 8000, 241)]

    def ttft(p):
        t = time.perf_counter()
        llm.generate([p], sp)
        return time.perf_counter() - t

    for _ in range(2):  # compile: fresh, device hit, host hit
        q = prompt()
        for p in (q, q, prompt(), prompt(), q):
            ttft(p)
    res = {"recompute": [], "device hit": [], "host hit": []}
    c0 = pool.compiled_programs
    for _ in range(5):
        p = prompt()
        res["recompute"].append(ttft(p))
        res["device hit"].append(ttft(p))
        for other in (prompt(), prompt()):  # 32 pages: p's blocks go to the host tier
            ttft(other)
        h0 = e.scheduler.block_manager.host.hit_blocks
        res["host hit"].append(ttft(p))
        print("host-tier hit blocks", e.scheduler.block_manager.host.hit_blocks - h0)
    print("transfer programs compiled while measuring:", pool.compiled_programs - c0)
    for k, v in res.items():
        print(f"{k:11s} median {1e3 * np.median(v):7.2f} ms  (240 cached tokens of 241)")
    # bandwidth: 15-page gathers+landing and scatters, vs numpy copies of the same bytes
    n = 15
    nbytes = n * pool.page_bytes
    def load():  # start the copy, wait for it, launch the scatter (what a host hit's load does over its steps)
        pool._load(list(range(n)), list(range(n)))
        pool.wait_loads(1.0)
        assert pool.poll()
        jax.block_until_ready(e.runner.kv_caches)

    for _ in range(3):
        pool._offload(list(range(n)), list(range(n)))
        pool.flush()
        load()
    t = time.perf_counter()
    for _ in range(20):
        pool._offload(list(range(n)), list(range(n)))
        pool.flush()
    d2h = (time.perf_counter() - t) / 20
    t = time.perf_counter()
    for _ in range(20):
        load()
    h2d = (time.perf_counter() - t) / 20
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    t = time.perf_counter()
    for _ in range(200):
        np.copyto(dst, src)
    mc = (time.perf_counter() - t) / 200
    print(f"page {pool.page_bytes} B; {n} pages = {nbytes / 1e6:.2f} MB: device->host {nbytes / d2h / 1e9:.2f} GB/s, "
          f"host->device {nbytes / h2d / 1e9:.2f} GB/s, numpy memcpy {nbytes / mc / 1e9:.2f} GB/s")


def multiturn(conversations: int = 16, turns: int = 4, history_len: int = 128, turn_len: int = 16,
              output_len: int = 16, num_pages: int = 32, host_gb: float = 0.05, concurrency: int = 4) -> None:
    """The multi-turn chat workload (serving.bench.serve.multiturn_requests) through one instance server per setting:
    a `num_pages`-page device pool whose histories total several times its size, without and with a host tier."""
    from serving.bench.serve import benchmark, multiturn_requests
    from serving.process import ServerProcess
    from serving.wire.client import Client
    model = "models/tiny/target"
    flags = ("--page_size=16", f"--num_pages={num_pages}", "--max_num_seqs=8", "--max_num_batched_tokens=256",
             "--min_token_bucket=64")
    root = tempfile.mkdtemp(prefix="hostkv-multiturn-")
    for name, extra in (("device pool only", ()), ("with host tier", (f"--host_kv_cache_gb={host_gb}",))):
        proc = ServerProcess(model, os.path.join(root, name.replace(" ", "_")), *flags, *extra).wait_ready()
        try:
            with Client(proc.target, timeout=60) as c:
                info = c.model_info()
                requests = multiturn_requests(conversations * turns, conversations, history_len, turn_len,
                                              output_len, info.vocab_size, 0, list(info.eos_token_ids))
                total = sum(len(r.prompt) for r in requests[-conversations:])
                before = c.get_load()
                r = benchmark(proc.target, requests, max_concurrency=concurrency, progress=False)
                after = c.get_load()
            queries = after.prefix_cache_queries - before.prefix_cache_queries
            hits = after.prefix_cache_hits - before.prefix_cache_hits
            host = after.host_prefix_cache_hits - before.host_prefix_cache_hits
            print(f"{name}: {conversations} conversations x {turns} turns, last histories {total} tokens over a "
                  f"{num_pages * 16}-token device pool (host tier {info.host_kv_cache_pages} pages): TTFT p50 "
                  f"{r['median_ttft_ms']:.1f} ms, p99 {r['p99_ttft_ms']:.1f} ms; output "
                  f"{r['output_throughput']:.1f} tok/s, total {r['total_token_throughput']:.1f} tok/s; prefix hits "
                  f"{hits / queries:.1%} of prompt tokens, from the host tier {host / queries:.1%}", flush=True)
        finally:
            proc.terminate()


def preemption(num_pages: int = 24, requests: int = 4, prompt_len: int = 100, max_tokens: int = 100,
               rounds: int = 3) -> None:
    """Preempted sequences recomputed against brought back from the host tier: `requests` greedy requests whose
    prompts and outputs need more than the `num_pages`-page device pool together (so the scheduler preempts), on two
    engines, without and with a host tier, alternating for `rounds` rounds of fresh prompts: wall time, preemptions,
    prompt tokens served from the host tier, and whether the tokens agree."""
    rng = np.random.default_rng(1)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engines = {name: LLM('models/tiny/target', warmup=False, num_pages=num_pages, page_size=16, host_kv_cache_gb=gb,
                         max_num_batched_tokens=256, max_num_seqs=requests)
               for name, gb in (("recompute", 0.0), ("host tier", 0.05))}
    warm = [[int(t) for t in rng.integers(3, 8000, prompt_len)] for _ in range(requests)]
    for llm in engines.values():
        llm.generate(warm, sp)  # compile
    walls = {name: [] for name in engines}
    for r in range(rounds):
        prompts = [[int(t) for t in rng.integers(3, 8000, prompt_len)] for _ in range(requests)]
        tokens = {}
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            llm = engines[name]
            e = llm.engine
            s0 = dict(e.scheduler.stats(), **e.host_kv_stats())
            t = time.perf_counter()
            outs = llm.generate(prompts, sp)
            walls[name].append(time.perf_counter() - t)
            s1 = dict(e.scheduler.stats(), **e.host_kv_stats())
            tokens[name] = [o.outputs[0].token_ids for o in outs]
            print(f"round {r} {name:9s}: {walls[name][-1]:6.2f} s, "
                  f"{s1['num_preemptions'] - s0['num_preemptions']} preemptions, prefix hits "
                  f"{s1['prefix_cache_hits'] - s0['prefix_cache_hits']} tokens (host tier "
                  f"{s1.get('host_prefix_cache_hits', 0) - s0.get('host_prefix_cache_hits', 0)}), load wait "
                  f"{s1.get('kv_offload_load_seconds', 0) - s0.get('kv_offload_load_seconds', 0):.3f} s", flush=True)
        print("  same tokens:", tokens["recompute"] == tokens["host tier"], flush=True)
    print({name: f"median {np.median(w):.2f} s" for name, w in walls.items()})


if __name__ == "__main__":
    {"multiturn": multiturn, "preemption": preemption}.get(sys.argv[1] if sys.argv[1:] else "", main)()
