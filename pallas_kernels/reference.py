"""Pure-JAX reference ragged paged attention (`ragged_paged_attention_reference`: the test oracle), the KV-cache write
of every backend but tpu (`write_kv`), and the KV page layout and storage dtype (`kv_storage_dtype`, `kv_values`).
Details: docs/attention.md."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def write_kv(kv_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Pure. Writes k/v `[T, kv_heads, D]` into flat slots `slot_mapping[T]`; slots < 0 are dropped.

    A cache stored as uint16 bits (`kv_storage_dtype`: 16-bit floats on CPU) receives k/v's bits; k/v must then
    be in the cache's logical 16-bit float dtype."""
    num_pages, page_size, h2, d = kv_pages.shape
    t = k.shape[0]
    kv = jnp.stack([k, v], axis=2).reshape(t, h2, d)
    if kv_pages.dtype == jnp.uint16:
        if kv.dtype.itemsize != 2 or not jnp.issubdtype(kv.dtype, jnp.floating):
            raise TypeError(f"write_kv: a uint16-stored cache takes 16-bit float K/V, got {kv.dtype}")
        kv = jax.lax.bitcast_convert_type(kv, jnp.uint16)
    else:
        kv = kv.astype(kv_pages.dtype)
    flat = kv_pages.reshape(num_pages * page_size, h2, d)
    idx = jnp.where(slot_mapping < 0, num_pages * page_size, slot_mapping)
    flat = flat.at[idx].set(kv, mode="drop", unique_indices=False)
    return flat.reshape(num_pages, page_size, h2, d)


def kv_storage_dtype(dtype, backend: str):
    """The dtype a KV cache of logical `dtype` is stored in for `backend`. XLA:CPU has no in-place 16-bit float
    gather/scatter: on a bf16/f16 array it converts (or, bitcast, copies) the whole cache on every call, so the
    CPU backend stores 16-bit float caches as uint16 bits and the kernels bitcast only the pages they touch."""
    dtype = jnp.dtype(dtype)
    if backend == "cpu" and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2:
        return jnp.dtype(jnp.uint16)
    return dtype


def kv_values(kv: jax.Array, dtype) -> jax.Array:
    """Pure. KV data read from a cache, in the logical `dtype` (bitcast when the cache stores uint16 bits)."""
    return jax.lax.bitcast_convert_type(kv, dtype) if kv.dtype == jnp.uint16 else kv


def token_positions(cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, num_tokens: int):
    """Pure. For each of `num_tokens` tokens: (sequence index, absolute position, is-real-token)."""
    s = kv_lens.shape[0]
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], tok, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, s - 1)
    valid = tok < cu_q_lens[jnp.reshape(num_seqs, ())]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (tok - cu_q_lens[seq])
    return seq, pos, valid


def ragged_paged_attention_reference(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
) -> jax.Array:
    """Pure. Causal attention of `q[T, Hq, D]` over each token's own sequence's KV pages -> `[T, Hq, D]`.

    Simple and memory-hungry (gathers each token's whole KV range); rows of padding tokens are zero.
    """
    t, hq, d = q.shape
    _, page_size, h2, _ = kv_pages.shape
    hkv = h2 // 2
    s, max_pages = page_indices.shape
    seq, pos, valid = token_positions(cu_q_lens, kv_lens, num_seqs, t)
    kv = kv_values(kv_pages[page_indices], q.dtype).reshape(s, max_pages * page_size, hkv, 2, d)
    k = kv[seq, :, :, 0].astype(jnp.float32)  # [T, L, Hkv, D]
    v = kv[seq, :, :, 1].astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(t, hkv, hq // hkv, d)
    scores = jnp.einsum("thgd,tlhd->thgl", qg, k) * sm_scale
    if logit_soft_cap is not None:
        scores = logit_soft_cap * jnp.tanh(scores / logit_soft_cap)
    kv_pos = jnp.arange(max_pages * page_size, dtype=jnp.int32)
    mask = (kv_pos[None, :] <= pos[:, None]) & (kv_pos[None, :] < kv_lens[seq][:, None]) & valid[:, None]
    if sliding_window is not None:
        mask &= kv_pos[None, :] > pos[:, None] - sliding_window
    mask = mask[:, None, None, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(scores - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("thgl,tlhd->thgd", p / jnp.where(denom == 0, 1.0, denom), v)
    return out.reshape(t, hq, d).astype(q.dtype)
