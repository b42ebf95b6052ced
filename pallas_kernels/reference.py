"""Pure-JAX reference ragged paged attention (`ragged_paged_attention_reference`: the test oracle), the KV-cache write
of every backend but tpu (`write_kv`), and the KV page layout and storage dtype (`kv_storage_dtype`, `kv_values`,
`read_pages`). Details: docs/attention.md."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import kv_quant
from pallas_kernels.kv_quant import QuantizedKV


def write_kv(kv_pages, k: jax.Array, v: jax.Array, slot_mapping: jax.Array):
    """Pure. Writes k/v `[T, kv_heads, D]` into flat slots `slot_mapping[T]`; slots < 0 are dropped.

    A cache stored as uint16 bits (`kv_storage_dtype`: 16-bit floats on CPU) receives k/v's bits; k/v must then
    be in the cache's logical 16-bit float dtype. A `QuantizedKV` receives each row quantised (`kv_quant.quantize`)
    and its scale."""
    _, _, h2, d = kv_pages.shape
    return write_rows(kv_pages, jnp.stack([k, v], axis=2).reshape(k.shape[0], h2, d), slot_mapping)


def write_rows(kv_pages, kv: jax.Array, slot_mapping: jax.Array):
    """Pure. Writes each token's page row `kv[T, rows, D]` (K/V interleaved, or a latent cache's one row) into flat
    slots `slot_mapping[T]`; slots < 0 are dropped. Storage as `write_kv`."""
    num_pages, page_size = kv_pages.shape[:2]
    idx = jnp.where(slot_mapping < 0, num_pages * page_size, slot_mapping)
    if isinstance(kv_pages, QuantizedKV):
        values, scales = kv_quant.quantize(kv, kv_pages.values.dtype)
        return QuantizedKV(_scatter_rows(kv_pages.values, idx, values), _scatter_rows(kv_pages.scales, idx, scales))
    if kv_pages.dtype == jnp.uint16:
        if kv.dtype.itemsize != 2 or not jnp.issubdtype(kv.dtype, jnp.floating):
            raise TypeError(f"write_kv: a uint16-stored cache takes 16-bit float K/V, got {kv.dtype}")
        kv = jax.lax.bitcast_convert_type(kv, jnp.uint16)
    else:
        kv = kv.astype(kv_pages.dtype)
    return _scatter_rows(kv_pages, idx, kv)


def _scatter_rows(pages: jax.Array, idx: jax.Array, rows: jax.Array) -> jax.Array:
    """Pure. `pages [P, page_size, ...]` with flat slot idx[t] set to rows[t] (idx past the end: dropped)."""
    flat = pages.reshape(pages.shape[0] * pages.shape[1], *pages.shape[2:])
    return flat.at[idx].set(rows, mode="drop", unique_indices=False).reshape(pages.shape)


def kv_storage_dtype(dtype, backend: str, kv_cache_dtype: str = "auto"):
    """The dtype the pages of a KV cache of logical `dtype` are stored in for `backend`. XLA:CPU has no in-place
    16-bit float gather/scatter: on a bf16/f16 array it converts (or, bitcast, copies) the whole cache on every
    call, so the CPU backend stores 16-bit float caches as uint16 bits and the kernels bitcast only the pages they
    touch. A quantized cache ("int8", "fp8_e4m3") stores its values as `kv_quant.values_dtype` says."""
    if kv_quant.check_kv_cache_dtype(kv_cache_dtype) != "auto":
        return kv_quant.values_dtype(kv_cache_dtype, backend)
    dtype = jnp.dtype(dtype)
    if backend == "cpu" and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2:
        return jnp.dtype(jnp.uint16)
    return dtype


def kv_values(kv: jax.Array, dtype) -> jax.Array:
    """Pure. KV data read from a cache, in the logical `dtype` (bitcast when the cache stores uint16 bits)."""
    return jax.lax.bitcast_convert_type(kv, dtype) if kv.dtype == jnp.uint16 else kv


def read_pages(kv_pages, pages: jax.Array, dtype) -> jax.Array:
    """Pure. `kv_pages[pages]` in `dtype`: the logical dtype of a 16-bit cache stored as uint16 bits (only the
    gathered pages are bitcast), any float dtype for a `QuantizedKV` (only the gathered pages are dequantised)."""
    if isinstance(kv_pages, QuantizedKV):
        return kv_quant.dequantize(kv_pages.values[pages], kv_pages.scales[pages], dtype)
    return kv_values(kv_pages[pages], dtype)


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
    kv_pages,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Pure. Causal attention of `q[T, Hq, D]` over each token's own sequence's KV pages (an array, or a
    `QuantizedKV`) -> `[T, Hq, D]`. `sinks[Hq]` (float32, GPT-OSS): a learned logit per query head that joins the
    softmax's denominator and attends to nothing (`sink_normalise`).

    Simple and memory-hungry (gathers each token's whole KV range); rows of padding tokens are zero.
    """
    t, hq, d = q.shape
    _, page_size, h2, _ = kv_pages.shape
    hkv = h2 // 2
    s, max_pages = page_indices.shape
    seq, pos, valid = token_positions(cu_q_lens, kv_lens, num_seqs, t)
    kv_dtype = jnp.float32 if isinstance(kv_pages, QuantizedKV) else q.dtype
    kv = read_pages(kv_pages, page_indices, kv_dtype).reshape(s, max_pages * page_size, hkv, 2, d)
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
    sink = None
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, hkv, hq // hkv, 1)
        m = jnp.maximum(m, sink)
    p = jnp.where(mask, jnp.exp(scores - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + jnp.exp(sink - m)
    out = jnp.einsum("thgl,tlhd->thgd", p / jnp.where(denom == 0, 1.0, denom), v)
    return out.reshape(t, hq, d).astype(q.dtype)
