"""GPU backend: ragged paged attention as a Pallas kernel on the Triton lowering, flash-decoding style
(`ragged_paged_attention_gpu`): one program per (query block, KV head, KV split), the splits merged by a JAX epilogue.
Details: docs/attention.md."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import plan as plan_lib

_NEG = -1e30
_MIN_DOT = 16  # Triton's smallest dot dimension


def _kernel(item_seq_ref, item_first_pos_ref, item_q_len_ref, kv_lens_ref, page_indices_ref, q_ref, kv_ref,
            o_ref, lse_ref, *, rows_per_token, pages_per_split, page_size, sm_scale, sliding_window,
            logit_soft_cap, precision):
    i, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq = item_seq_ref[i]
    first_pos = item_first_pos_ref[i]
    q_len = item_q_len_ref[i]
    kv_len = kv_lens_ref[seq]
    q = q_ref[0, 0]  # [R, D]
    r, d = q.shape
    row_tok = lax.broadcasted_iota(jnp.int32, (r, page_size), 0) // rows_per_token
    row_pos = first_pos + row_tok
    hi = jnp.minimum(first_pos + q_len, kv_len)
    lo = jnp.maximum(first_pos - sliding_window + 1, 0) if sliding_window is not None else 0
    p_begin = jnp.maximum(split * pages_per_split, lo // page_size)
    p_end = jnp.minimum((split + 1) * pages_per_split, (hi + page_size - 1) // page_size)
    p_end = jnp.where(q_len > 0, p_end, p_begin)

    def scores_of(k):
        if page_size >= _MIN_DOT:
            return lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)
        return jnp.sum(q.astype(jnp.float32)[:, None, :] * k.astype(jnp.float32)[None, :, :], axis=-1)

    def weighted_values(p, v):
        if page_size >= _MIN_DOT:
            return lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)
        return jnp.sum(p[:, :, None] * v.astype(jnp.float32)[None, :, :], axis=1)

    def body(p, carry):
        m, l, acc = carry
        page = page_indices_ref[seq, p]
        k = kv_ref[page, :, 2 * h, :]  # [page_size, D]
        v = kv_ref[page, :, 2 * h + 1, :]
        s = scores_of(k) * sm_scale
        if logit_soft_cap is not None:
            s = logit_soft_cap * jnp.tanh(s / logit_soft_cap)
        kv_pos = p * page_size + lax.broadcasted_iota(jnp.int32, (r, page_size), 1)
        mask = (kv_pos <= row_pos) & (kv_pos < kv_len) & (row_tok < q_len)
        if sliding_window is not None:
            mask &= kv_pos > row_pos - sliding_window
        s = jnp.where(mask, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        prob = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(prob, axis=1)
        acc = alpha[:, None] * acc + weighted_values(prob, v)
        return m_new, l, acc

    init = (jnp.full((r,), _NEG, jnp.float32), jnp.zeros((r,), jnp.float32), jnp.zeros((r, d), jnp.float32))
    m, l, acc = lax.fori_loop(p_begin, p_end, body, init)
    empty = l == 0.0
    o_ref[0, 0, 0] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[0, 0, 0] = jnp.where(empty, _NEG, m + jnp.log(jnp.where(empty, 1.0, l)))


def _pow2_at_least(x: int, floor: int) -> int:
    return max(floor, 1 << max(0, (x - 1).bit_length()))


def ragged_paged_attention_gpu(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                               sliding_window=None, logit_soft_cap=None, block_rows=64, num_splits=None,
                               num_warps=4, num_stages=2, interpret=False):
    """Pure. Same contract as `ragged_paged_attention_reference`, as a Triton Pallas kernel."""
    t, hq, d = q.shape
    _, page_size, h2, _ = kv_pages.shape
    hkv = h2 // 2
    g = hq // hkv
    s_slots, max_pages = page_indices.shape
    bt = plan_lib.choose_block_tokens(t, kv_lens.shape[0], g, block_rows)
    plan = plan_lib.make_plan(cu_q_lens, kv_lens, num_seqs, t, bt)
    q_items = plan_lib.gather_queries(q, plan, hkv)  # [I, Hkv, Bt*G, D]
    rows = _pow2_at_least(bt * g, _MIN_DOT)
    q_items = jnp.pad(q_items, ((0, 0), (0, 0), (0, rows - bt * g), (0, 0)))
    n_items = plan.max_items
    if num_splits is None:  # enough programs to fill a large GPU, but no split shorter than ~256 tokens
        num_splits = max(1, min(-(-512 // (n_items * hkv)), -(-max_pages * page_size // 256)))
    pages_per_split = -(-max_pages // num_splits)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, rows_per_token=g, pages_per_split=pages_per_split, page_size=page_size,
                               sm_scale=sm_scale, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
                               precision=precision)
    out_o, out_lse = pl.pallas_call(
        kernel,
        grid=(n_items, hkv, num_splits),
        in_specs=[pl.no_block_spec] * 5 + [
            pl.BlockSpec((1, 1, rows, d), lambda i, h, k: (i, h, 0, 0)),
            pl.no_block_spec,
        ],
        out_specs=[pl.BlockSpec((1, 1, 1, rows, d), lambda i, h, k: (i, h, k, 0, 0)),
                   pl.BlockSpec((1, 1, 1, rows), lambda i, h, k: (i, h, k, 0))],
        out_shape=[jax.ShapeDtypeStruct((n_items, hkv, num_splits, rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((n_items, hkv, num_splits, rows), jnp.float32)],
        compiler_params=_triton_params(num_warps, num_stages),
        interpret=interpret,
        name="ragged_paged_attention_triton",
    )(plan.item_seq, plan.item_first_pos, plan.item_q_len, kv_lens.astype(jnp.int32),
      page_indices.astype(jnp.int32), q_items, kv_pages)
    # Merge the splits' partial softmaxes (flash-decoding epilogue).
    lse_max = jnp.max(out_lse, axis=2, keepdims=True)
    w = jnp.exp(out_lse - lse_max)  # [I, Hkv, K, R]
    denom = jnp.sum(w, axis=2)
    merged = jnp.sum(w[..., None] * out_o, axis=2) / jnp.where(denom == 0, 1.0, denom)[..., None]
    merged = merged[:, :, :bt * g].astype(q.dtype)
    return plan_lib.scatter_outputs(merged, plan, hq)


def _triton_params(num_warps: int, num_stages: int):
    from jax.experimental.pallas import triton as pl_triton
    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
