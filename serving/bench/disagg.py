"""A short measurement of the prefill/decode KV transfer (issue 40), in one process on the shipped tiny model: per
1,000 prompt tokens, the bytes a transfer moves and its time (read the held pages out, to bytes as PullKV sends them,
back to arrays, written into a second engine's pages), against the time to recompute them (the prompt's prefill).
The gRPC hop itself is not in it. Run: `python -m serving.bench.disagg` (figures: docs/disaggregation.md)."""
import time

import numpy as np

from serving.core.kv_transfer import KVTransfers
from serving.core.llm import LLM
from serving.core.sampling_params import SamplingParams

PROMPT_TOKENS = 240  # the tiny model's context is 256
OPTS = dict(warmup=False, num_pages=64, page_size=16, max_num_batched_tokens=256, max_num_seqs=4)


def main() -> None:
    a, b = LLM("models/tiny/target", **OPTS), LLM("models/tiny/target", **OPTS)
    out, into = KVTransfers(a.engine), KVTransfers(b.engine)
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rows = []
    for trial in range(4):  # the first compiles
        prompt = [int(t) for t in rng.integers(3, 8000, PROMPT_TOKENS)]
        req = a.engine.make_request(f"p{trial}", prompt, sp)
        t = time.perf_counter()
        a.engine.add_request(req)
        a.engine.run_until_idle()
        prefill_s = time.perf_counter() - t
        tid, n = out.hold(req)
        t = time.perf_counter()
        chunks = [[d.tobytes() for d in out.read(tid, k, min(16, n - k))] for k in range(0, n, 16)]
        read_s = time.perf_counter() - t
        nbytes = sum(len(x) for c in chunks for x in c)
        t = time.perf_counter()
        data = [np.frombuffer(b"".join(c[i] for c in chunks), h.dtype).reshape((-1,) + h.row_shape)
                for i, h in enumerate(into.mover.leaves)]
        dreq = b.engine.make_request(f"d{trial}", prompt + list(req.output_token_ids), sp)
        assert into.write(dreq, data) == n
        write_s = time.perf_counter() - t
        out.release(tid)
        for e in (a.engine, b.engine):
            e.scheduler.block_manager.reset_prefix_cache()
        if trial:
            rows.append((prefill_s, read_s, write_s, nbytes, n))
    k = 1000 / PROMPT_TOKENS
    prefill_s, read_s, write_s, nbytes, n = (float(np.median([r[i] for r in rows])) for i in range(5))
    print(f"tiny model, {PROMPT_TOKENS}-token prompt, {int(n)} pages of 16 tokens; per 1,000 prompt tokens "
          f"(median of {len(rows)}):")
    print(f"  KV bytes moved      {nbytes * k / 1e6:8.2f} MB")
    print(f"  transfer (out+in)   {(read_s + write_s) * k * 1e3:8.2f} ms   (read+serialize {read_s * k * 1e3:.2f}, "
          f"deserialize+write {write_s * k * 1e3:.2f})")
    print(f"  recompute (prefill) {prefill_s * k * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
