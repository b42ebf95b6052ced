"""CPU backend in pure JAX, written for XLA:CPU (`ragged_paged_attention_cpu`): what runs on CPU where the native
kernel cannot. Query blocks of one sequence each stream only the pages they need, in chunks, with an online softmax.
Details: docs/attention.md."""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from pallas_kernels import plan as plan_lib
from pallas_kernels import reference
from pallas_kernels.kv_quant import QuantizedKV

_NEG = -1e30  # finite "minus infinity": keeps exp(m_old - m_new) free of inf - inf


def _attend_block(q_blk, kv_pages, pages_row, kv_len, first_pos, q_len, *, kv_dtype, rows_per_token,
                  chunk_pages, sm_scale, sliding_window, logit_soft_cap, value_dim=None, sinks=None):
    """Pure. One query block `[Hkv, R, D]` (rows token*G+g) against its sequence's pages -> `[Hkv, R, Dv]`; a latent
    cache (`value_dim`: one row per token, its first `value_dim` values the value) has Hkv = 1. `sinks [Hkv, G]`:
    each query head's sink logit, added to the softmax's denominator at the end."""
    hkv, r, d = q_blk.shape
    dv = d if value_dim is None else value_dim
    _, page_size, _, _ = kv_pages.shape
    chunk = chunk_pages * page_size
    q_blk = q_blk.astype(kv_dtype)  # dots in the cache's dtype (q's for a quantized cache), accumulated in f32
    row_pos = first_pos + jnp.arange(r, dtype=jnp.int32) // rows_per_token  # [R]
    row_ok = jnp.arange(r, dtype=jnp.int32) // rows_per_token < q_len
    hi = jnp.minimum(first_pos + q_len, kv_len)  # one past the last KV position any row may see
    lo = jnp.maximum(first_pos - sliding_window + 1, 0) if sliding_window is not None else jnp.int32(0)
    c_lo = lo // chunk
    c_hi = (hi + chunk - 1) // chunk

    def body(c, carry):
        m, l, acc = carry
        pages = lax.dynamic_slice_in_dim(pages_row, c * chunk_pages, chunk_pages)
        # a 16-bit float cache stored as uint16 bits (`reference.kv_storage_dtype`) is bitcast, a QuantizedKV
        # dequantised, only in the pages gathered here
        if value_dim is None:
            kv = reference.read_pages(kv_pages, pages, kv_dtype).reshape(chunk, hkv, 2, d)
            k, v = kv[:, :, 0], kv[:, :, 1]
        else:
            k = reference.read_pages(kv_pages, pages, kv_dtype).reshape(chunk, 1, d)
            v = k[:, :, :value_dim]
        s = jnp.einsum("hrd,chd->hrc", q_blk, k, preferred_element_type=jnp.float32) * sm_scale
        if logit_soft_cap is not None:
            s = logit_soft_cap * jnp.tanh(s / logit_soft_cap)
        kv_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        mask = (kv_pos[None, :] <= row_pos[:, None]) & (kv_pos[None, :] < kv_len) & row_ok[:, None]
        if sliding_window is not None:
            mask &= kv_pos[None, :] > row_pos[:, None] - sliding_window
        s = jnp.where(mask[None], s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(mask[None], jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("hrc,chd->hrd", p.astype(v.dtype), v,
                                                  preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((hkv, r), _NEG, jnp.float32), jnp.zeros((hkv, r), jnp.float32),
            jnp.zeros((hkv, r, dv), jnp.float32))
    m, l, acc = lax.fori_loop(c_lo, c_hi, body, init)
    if sinks is not None:
        sink = jnp.tile(sinks.astype(jnp.float32), (1, r // rows_per_token))  # [Hkv, R]: row token*G+g -> g
        m_new = jnp.maximum(m, sink)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.exp(sink - m_new)
        acc = alpha[..., None] * acc
    return acc / jnp.where(l == 0, 1.0, l)[..., None]


def ragged_paged_attention_cpu(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                               sliding_window=None, logit_soft_cap=None, block_tokens=64, chunk_tokens=128,
                               value_dim=None, sinks=None):
    """Pure. Same contract as `ragged_paged_attention_reference` (a `QuantizedKV` is dequantised to q's dtype a chunk
    of pages at a time); fast and memory-sane on XLA:CPU. `value_dim`: a latent cache [P, page, 1, D] read by every
    query head, its rows' first `value_dim` values the values (`pallas_kernels.mla`): out [T, Hq, value_dim]."""
    t, hq, d = q.shape
    _, page_size, h2, _ = kv_pages.shape
    hkv = 1 if value_dim is not None else h2 // 2
    dv = d if value_dim is None else value_dim
    g = hq // hkv
    bt = max(1, min(block_tokens, t))
    chunk_pages = max(1, min(chunk_tokens // page_size, page_indices.shape[1]))
    plan = plan_lib.make_plan(cu_q_lens, kv_lens, num_seqs, t, bt)
    pages = plan_lib.pad_page_indices(page_indices, chunk_pages)
    kv_dtype = q.dtype if isinstance(kv_pages, QuantizedKV) or kv_pages.dtype == jnp.uint16 else kv_pages.dtype
    attend = functools.partial(_attend_block, kv_dtype=kv_dtype, rows_per_token=g, chunk_pages=chunk_pages,
                               sm_scale=sm_scale, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
                               value_dim=value_dim,
                               sinks=None if sinks is None else sinks.reshape(hkv, g))
    q_pad = jnp.pad(q, ((0, bt), (0, 0), (0, 0)))  # so a block-sized window never runs off the end

    sizes = sorted({1, min(8, bt), bt})  # query-block widths: decodes, short (speculative) chunks, prefill

    def run_block(width, out, start, q_len, args):
        q_blk = lax.dynamic_slice_in_dim(q_pad, start, width).reshape(width, hkv, g, d)
        q_blk = q_blk.transpose(1, 0, 2, 3).reshape(hkv, width * g, d)
        o = attend(q_blk, *args).reshape(hkv, width, g, dv).transpose(1, 0, 2, 3).reshape(width, hq, dv)
        o = o.astype(out.dtype)
        if width > 1:  # rows past the item belong to later items: keep what is there
            keep = jnp.arange(width)[:, None, None] < q_len
            o = jnp.where(keep, o, lax.dynamic_slice_in_dim(out, start, width))
        return lax.dynamic_update_slice_in_dim(out, o, start, 0)

    def item(i, out):
        s = plan.item_seq[i]
        start = plan.item_q_start[i]
        q_len = plan.item_q_len[i]
        args = (kv_pages, pages[s], kv_lens[s], plan.item_first_pos[i], q_len)
        branches = [functools.partial(run_block, w, start=start, q_len=q_len, args=args) for w in sizes]
        if len(branches) == 1:
            return branches[0](out)
        which = sum((q_len > w).astype(jnp.int32) for w in sizes[:-1])
        return lax.switch(which, branches, out)

    out = lax.fori_loop(0, plan.num_items, item, jnp.zeros(q_pad.shape[:2] + (dv,), q.dtype))
    return out[:t]
