"""Microbenchmark of ragged paged attention: decode, prefill and mixed batches, each timed against the read-bandwidth
roofline and a dense (non-paged) attention on the same batch. Details: docs/benchmarks.md.

    python -m serving.bench attention [--backend=cpu] [--quick]
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from pallas_kernels import attention
from pallas_kernels.cases import make_case
from serving.bench.harness import median_time, read_bandwidth, table

_BACKEND = flags.DEFINE_string("backend", "", "cpu|gpu|tpu|reference; default: the platform's own")
_Q_HEADS = flags.DEFINE_integer("q_heads", 32, "query heads")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 8, "KV heads")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "head dimension")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "tokens per KV page")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "query and KV dtype")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed calls per case (the median is reported)")
_QUICK = flags.DEFINE_bool("quick", False, "a few small cases only")


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


def _rows(roofline: float):
    """A table row per case of `scenarios`, as each is measured."""
    rng = np.random.default_rng(0)
    head_dim, kv_heads, dtype = _HEAD_DIM.value, _KV_HEADS.value, jnp.dtype(_DTYPE.value)
    sm_scale = head_dim ** -0.5
    paged = jax.jit(functools.partial(attention.ragged_paged_attention, sm_scale=sm_scale))
    dense = jax.jit(functools.partial(dense_attention, sm_scale=sm_scale))
    for kind, label, seqs in scenarios(_QUICK.value):
        case = make_case(rng, seqs, num_q_heads=_Q_HEADS.value, num_kv_heads=kv_heads, head_dim=head_dim,
                         page_size=_PAGE_SIZE.value, dtype=dtype, extra_pages=1)
        paged_args = [jnp.asarray(a) for a in case.attention_args()]
        dense_args = [jnp.asarray(a) for a in _dense_inputs(case)]
        t_paged = median_time(lambda: jax.block_until_ready(paged(*paged_args)), _REPEATS.value)
        t_dense = median_time(lambda: jax.block_until_ready(dense(*dense_args)), _REPEATS.value)
        kv_bytes = sum(case.kv_lens) * 2 * kv_heads * head_dim * dtype.itemsize
        bw = kv_bytes / t_paged
        yield [kind, label, t_paged * 1e3, kv_bytes / 1e6, bw / 1e9, bw / roofline, t_dense * 1e3, t_dense / t_paged]


def main() -> None:
    if _BACKEND.value:
        os.environ[attention.ENV_VAR] = _BACKEND.value
    roofline = read_bandwidth()
    table(f"Ragged paged attention: {attention.attention_backend()} backend on {jax.default_backend()} "
          f"({jax.devices()[0].device_kind}), Hq={_Q_HEADS.value} Hkv={_KV_HEADS.value} D={_HEAD_DIM.value} "
          f"page={_PAGE_SIZE.value} {_DTYPE.value}; roofline: read bandwidth {roofline / 1e9:.2f} GB/s",
          ["kind", "case", "ms/call", "KV MB", "GB/s", "of roofline", "dense ms", "dense/paged"],
          _rows(roofline))
