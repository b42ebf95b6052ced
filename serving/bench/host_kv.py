"""A short measurement of the host KV tier (issue 39): time to first token of a 241-token prompt recomputed, hit in
the device pool and hit in the host tier, and the tier's copy bandwidth each way against numpy's memcpy, on the shipped
tiny model (page_size 16). Run: `python -m serving.bench.host_kv` (figures: docs/engine.md)."""
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
    for _ in range(3):
        pool._offload(list(range(n)), list(range(n)))
        pool.flush()
        pool._load(list(range(n)), list(range(n)))
    jax.block_until_ready(e.runner.kv_caches)
    t = time.perf_counter()
    for _ in range(20):
        pool._offload(list(range(n)), list(range(n)))
        pool.flush()
    d2h = (time.perf_counter() - t) / 20
    t = time.perf_counter()
    for _ in range(20):
        pool._load(list(range(n)), list(range(n)))
        jax.block_until_ready(e.runner.kv_caches)
    h2d = (time.perf_counter() - t) / 20
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    t = time.perf_counter()
    for _ in range(200):
        np.copyto(dst, src)
    mc = (time.perf_counter() - t) / 200
    print(f"page {pool.page_bytes} B; {n} pages = {nbytes / 1e6:.2f} MB: device->host {nbytes / d2h / 1e9:.2f} GB/s, "
          f"host->device {nbytes / h2d / 1e9:.2f} GB/s, numpy memcpy {nbytes / mc / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
