"""Microbenchmark of ragged paged attention: `python -m pallas_kernels.bench [--backend=cpu] [--quick]`.

Decode-only, prefill-only and mixed batches at several batch sizes and context lengths. Per case: time per
call, bytes of KV read, achieved bandwidth, its ratio to the memory-bandwidth roofline (a read-only stream
measured now, on this device) and the speed ratio to a dense (non-paged, contiguous K/V) attention run in the same
process on the same batch.
"""
from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import attention
from pallas_kernels.testing import make_case


def _time(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def read_bandwidth(nbytes: int = 1 << 29, repeats: int = 5, *, huge_pages: bool | None = None) -> float:
    """Bytes/s at which a jitted program streams a buffer it only reads (a reduction), measured now on the
    default device: what attention does with the KV pages and a decode step with the weights. (A copy into a
    fresh output measures page faults on CPU, not the memory.) On CPU the buffer is backed by transparent huge
    pages by default, as the engine's packed weights are (`native.pack_weights`); 4 KiB pages read slower."""
    if huge_pages is None:
        huge_pages = jax.default_backend() == "cpu"
    if huge_pages:
        from pallas_kernels import native
        host = np.frombuffer(native.huge_page_buffer(nbytes), np.float32)
        host[...] = 1.0
        x = jax.device_put(host, jax.devices("cpu")[0])
    else:
        x = jnp.ones((nbytes // 4,), jnp.float32)
    fn = jax.jit(lambda a: jnp.sum(a))
    jax.block_until_ready(fn(x))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def dense_attention(q, k, v, q_pos, kv_len, *, sm_scale):
    """Pure. Non-paged baseline: q `[S, Q, Hq, D]` against contiguous k/v `[S, L, Hkv, D]`, causal."""
    s, qn, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(s, qn, hkv, hq // hkv, d).astype(jnp.float32)
    scores = jnp.einsum("sqhgd,slhd->shgql", qg, k.astype(jnp.float32)) * sm_scale
    kv_pos = jnp.arange(k.shape[1])
    mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < kv_len[:, None, None])
    scores = jnp.where(mask[:, None, None], scores, -1e30)
    p = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("shgql,slhd->sqhgd", p, v.astype(jnp.float32))
    return out.reshape(s, qn, hq, d).astype(q.dtype)


def _dense_inputs(case):
    qn = max(case.q_lens)
    ln = max(case.kv_lens)
    s = len(case.q_lens)
    _, hq, d = case.q.shape
    hkv = case.k_dense[0].shape[1]
    dtype = case.kv_pages.dtype
    q = np.zeros((s, qn, hq, d), dtype)
    k = np.zeros((s, ln, hkv, d), dtype)
    v = np.zeros((s, ln, hkv, d), dtype)
    q_pos = np.full((s, qn), -1, np.int32)
    start = 0
    for i, (ql, kl) in enumerate(zip(case.q_lens, case.kv_lens)):
        q[i, :ql] = case.q[start:start + ql]
        k[i, :kl] = case.k_dense[i]
        v[i, :kl] = case.v_dense[i]
        q_pos[i, :ql] = np.arange(kl - ql, kl)
        start += ql
    return q, k, v, q_pos, np.asarray(case.kv_lens, np.int32)


def scenarios(quick: bool):
    """(kind, label, seqs as (q_len, kv_len)) cases."""
    decode_batches, contexts = ([1, 16], [512]) if quick else ([1, 16, 64, 256], [512, 2048])
    for b in decode_batches:
        for ctx in contexts:
            if b * ctx <= 64 * 2048:
                yield "decode", f"b={b} ctx={ctx}", [(1, ctx)] * b
    for chunk in ([128] if quick else [128, 512]):
        for ctx in ([512] if quick else [512, 2048]):
            yield "prefill", f"chunk={chunk} ctx={ctx}", [(chunk, ctx)]
    mixes = [(16, 512, 128)] if quick else [(16, 512, 128), (32, 1024, 256)]  # the dense baseline pads every
    # sequence to the longest chunk, so bigger mixes would need tens of GB for it
    for b, ctx, chunk in mixes:
        yield "mixed", f"{b}x dec@{ctx} + {chunk}@{ctx}", [(1, ctx)] * b + [(chunk, ctx)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="", help="cpu|gpu|tpu|reference; default: the platform's own")
    parser.add_argument("--q_heads", type=int, default=32)
    parser.add_argument("--kv_heads", type=int, default=8)
    parser.add_argument("--head_dim", type=int, default=128)
    parser.add_argument("--page_size", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a few small cases only")
    args = parser.parse_args(argv)
    if args.backend:
        import os
        os.environ[attention.ENV_VAR] = args.backend
    backend = attention.attention_backend()
    dtype = jnp.dtype(args.dtype)
    roofline = read_bandwidth()
    print(f"platform={jax.default_backend()} device={jax.devices()[0].device_kind} backend={backend} "
          f"Hq={args.q_heads} Hkv={args.kv_heads} D={args.head_dim} page={args.page_size} dtype={args.dtype}")
    print(f"read-bandwidth roofline: {roofline / 1e9:.2f} GB/s")
    header = f"{'kind':8} {'case':28} {'ms/call':>9} {'KV MB':>8} {'GB/s':>7} {'roofline':>8} " \
             f"{'dense ms':>9} {'dense/paged':>11}"
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(0)
    sm_scale = args.head_dim ** -0.5
    paged = jax.jit(functools.partial(attention.ragged_paged_attention, sm_scale=sm_scale))
    dense = jax.jit(functools.partial(dense_attention, sm_scale=sm_scale))
    for kind, label, seqs in scenarios(args.quick):
        case = make_case(rng, seqs, num_q_heads=args.q_heads, num_kv_heads=args.kv_heads,
                         head_dim=args.head_dim, page_size=args.page_size, dtype=dtype, extra_pages=1)
        t_paged = _time(paged, [jnp.asarray(a) for a in case.attention_args()], args.repeats)
        t_dense = _time(dense, [jnp.asarray(a) for a in _dense_inputs(case)], args.repeats)
        kv_bytes = sum(case.kv_lens) * 2 * args.kv_heads * args.head_dim * dtype.itemsize
        bw = kv_bytes / t_paged
        print(f"{kind:8} {label:28} {t_paged * 1e3:9.2f} {kv_bytes / 1e6:8.1f} {bw / 1e9:7.2f} "
              f"{bw / roofline:8.2f} {t_dense * 1e3:9.2f} {t_dense / t_paged:11.2f}", flush=True)


if __name__ == "__main__":
    main()
