"""GPU backend: ragged paged attention as a Pallas kernel on the Triton lowering, flash-decoding style
(`ragged_paged_attention_gpu`): one program per (query block, KV head, KV split), the splits merged by a JAX epilogue;
a quantized cache is dequantised tile by tile as it is loaded. Details: docs/attention.md."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

import jax_compat
from pallas_kernels import kv_quant
from pallas_kernels import plan as plan_lib
from pallas_kernels.kv_quant import QuantizedKV

_NEG = -1e30
_MIN_DOT = 16  # Triton's smallest dot dimension


def _kernel(*refs, quantized, rows_per_token, block_k, num_splits, min_split_steps, page_size, sm_scale,
            sliding_window, logit_soft_cap, precision):
    # refs: the plan's arrays, q and the cache (plus its scales [P, page_size, 2Hkv] when quantized), then outputs
    item_seq_ref, item_first_pos_ref, item_q_len_ref, kv_lens_ref, page_indices_ref, q_ref, kv_ref = refs[:7]
    scales_ref = refs[7] if quantized else None
    o_ref, lse_ref = refs[-2:]
    i, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq = item_seq_ref[i]
    first_pos = item_first_pos_ref[i]
    q_len = item_q_len_ref[i]
    kv_len = kv_lens_ref[seq]
    q = q_ref[0, 0]  # [R, D]
    r, d = q.shape
    pages_per_step = max(1, block_k // page_size)  # block_k: KV tokens per loop step (pages, or part of one)
    row_tok = lax.broadcasted_iota(jnp.int32, (r, block_k), 0) // rows_per_token
    row_pos = first_pos + row_tok
    hi = jnp.minimum(first_pos + q_len, kv_len)
    lo = jnp.maximum(first_pos - sliding_window + 1, 0) if sliding_window is not None else 0
    s_begin, s_end = split_steps(lo, jnp.where(q_len > 0, hi, 0), split, block_k=block_k, num_splits=num_splits,
                                 min_split_steps=min_split_steps)

    def scores_of(k):
        if block_k >= _MIN_DOT:
            return lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)
        return jnp.sum(q.astype(jnp.float32)[:, None, :] * k.astype(jnp.float32)[None, :, :], axis=-1)

    def weighted_values(p, v):
        if block_k >= _MIN_DOT:
            return lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)
        return jnp.sum(p[:, :, None] * v.astype(jnp.float32)[None, :, :], axis=1)

    def load_kv(step):
        """K and V `[block_k, D]` of this step's tokens, a quantized cache's dequantised to q's dtype."""
        if block_k < page_size:  # part of a page per step (head_dim 256 with 128-token pages)
            sub = page_size // block_k
            where = (page_indices_ref[seq, step // sub], pl.ds((step % sub) * block_k, block_k))
        elif pages_per_step == 1:
            where = (page_indices_ref[seq, step], slice(None))
        else:
            # several pages per step, gathered by their block-table entries (as JAX's paged_attention does); entries
            # past the sequence's pages are valid page ids (0) whose tokens the mask drops
            where = (page_indices_ref[seq, pl.ds(step * pages_per_step, pages_per_step)], slice(None))
        k = kv_ref[(*where, 2 * h, slice(None))].reshape(block_k, d)
        v = kv_ref[(*where, 2 * h + 1, slice(None))].reshape(block_k, d)
        if scales_ref is None:
            return k, v
        k_scale = scales_ref[(*where, 2 * h)].reshape(block_k, 1)
        v_scale = scales_ref[(*where, 2 * h + 1)].reshape(block_k, 1)
        return ((kv_quant.widen(k) * k_scale).astype(q.dtype), (kv_quant.widen(v) * v_scale).astype(q.dtype))

    def body(step, carry):
        m, l, acc = carry
        k, v = load_kv(step)
        s = scores_of(k) * sm_scale
        if logit_soft_cap is not None:
            s = logit_soft_cap * jnp.tanh(s / logit_soft_cap)
        kv_pos = step * block_k + lax.broadcasted_iota(jnp.int32, (r, block_k), 1)
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
    m, l, acc = lax.fori_loop(s_begin, s_end, body, init)
    empty = l == 0.0
    o_ref[0, 0, 0] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[0, 0, 0] = jnp.where(empty, _NEG, m + jnp.log(jnp.where(empty, 1.0, l)))


def split_steps(lo, hi, split, *, block_k: int, num_splits: int, min_split_steps: int):
    """Pure (traced ints in and out). The loop steps [begin, end) of split `split` for an item whose KV range is
    tokens [lo, hi) (hi <= lo: no work): the steps of `block_k` tokens that the range really has, from kv_len at run
    time, not from the block table's width, cut into `num_splits` near-equal shares of >= `min_split_steps` each,
    so a short context in a wide table still spreads over the splits (late splits may get none)."""
    s_lo = lo // block_k
    s_hi = jnp.maximum((hi + block_k - 1) // block_k, s_lo)
    per_split = jnp.maximum((s_hi - s_lo + num_splits - 1) // num_splits, min_split_steps)
    begin = jnp.minimum(s_lo + split * per_split, s_hi)
    return begin, jnp.minimum(begin + per_split, s_hi)


def _pow2_at_least(x: int, floor: int) -> int:
    return max(floor, 1 << max(0, (x - 1).bit_length()))


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def unsupported_reason(head_dim: int, page_size: int) -> str | None:
    """Static. Why the Triton kernel cannot take these shapes (None: it can). Triton tiles must be powers of two
    and its dot needs >= 16 along the contraction, so head_dim 80/96/... cannot run; a model loader can ask this
    before it builds caches instead of meeting a Triton lowering error at the first jit."""
    if not _is_pow2(head_dim) or head_dim < _MIN_DOT:
        return (f"the GPU (Triton) attention kernel needs a power-of-two head_dim >= {_MIN_DOT}, got {head_dim}"
                " (Triton tiles are powers of two)")
    if not _is_pow2(page_size):
        return f"the GPU (Triton) attention kernel needs a power-of-two page_size, got {page_size}"
    return None


def default_step_tokens(head_dim: int, itemsize: int) -> int:
    """Static. KV tokens per loop step: 128 (JAX's paged_attention: 8 pages of 16), fewer where one step's K and V
    tiles would pass 64 KiB (so two pipeline stages fit in shared memory: 64 for bf16 head_dim 256 and f32 head_dim
    128, also when a page is longer, e.g. 128-token pages)."""
    return max(_MIN_DOT, min(128, 64 * 1024 // (2 * head_dim * itemsize)))


def default_num_warps(head_dim: int) -> int:
    """Static. 4 warps for head_dim <= 64, 8 above (JAX's paged_attention default) for the larger tiles."""
    return 4 if head_dim <= 64 else 8


def ragged_paged_attention_gpu(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                               sliding_window=None, logit_soft_cap=None, block_rows=64, num_splits=None,
                               step_tokens=None, num_warps=None, num_stages=2, interpret=False, debug=False,
                               sinks=None):
    """Pure. Same contract as `ragged_paged_attention_reference`, as a Triton Pallas kernel (a `QuantizedKV` is
    dequantised to q's dtype as each step's tiles are loaded). Raises ValueError (`unsupported_reason`) for shapes
    Triton cannot tile. `debug` prints the kernel's Triton module as it lowers. `sinks[Hq]`: applied after the kernel
    from its log-sum-exp, out * sigmoid(lse - sink) (= sum / (sum + exp(sink)))."""
    t, hq, d = q.shape
    _, page_size, h2, _ = kv_pages.shape
    if (reason := unsupported_reason(d, page_size)) is not None:
        raise ValueError(reason)
    hkv = h2 // 2
    g = hq // hkv
    s_slots, max_pages = page_indices.shape
    bt = plan_lib.choose_block_tokens(t, kv_lens.shape[0], g, block_rows)
    plan = plan_lib.make_plan(cu_q_lens, kv_lens, num_seqs, t, bt)
    q_items = plan_lib.gather_queries(q, plan, hkv)  # [I, Hkv, Bt*G, D]
    rows = _pow2_at_least(bt * g, _MIN_DOT)
    q_items = jnp.pad(q_items, ((0, 0), (0, 0), (0, rows - bt * g), (0, 0)))
    n_items = plan.max_items
    quantized = isinstance(kv_pages, QuantizedKV)
    if step_tokens is None:  # no more pages than the block table has (rounded up to a power of two)
        # a quantized cache's tiles are dequantised to q's dtype: size the step by that
        tile_itemsize = (q if quantized else kv_pages).dtype.itemsize
        step_tokens = min(default_step_tokens(d, tile_itemsize),
                          _pow2_at_least(max_pages, 1) * page_size)
    if not _is_pow2(step_tokens):
        raise ValueError(f"step_tokens must be a power of two, got {step_tokens}")
    block_k = step_tokens
    pages_per_step = max(1, block_k // page_size)
    pages = plan_lib.pad_page_indices(page_indices.astype(jnp.int32), pages_per_step)  # whole steps stay inside
    max_steps = pages.shape[1] * page_size // block_k
    min_split_steps = max(1, 256 // block_k)  # no split shorter than ~256 tokens
    if num_splits is None:  # enough programs to fill a large GPU; static, sized for the widest context
        num_splits = max(1, min(-(-512 // (n_items * hkv)), -(-max_steps // min_split_steps)))
    num_warps = default_num_warps(d) if num_warps is None else num_warps
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    cache = (kv_pages.values, kv_pages.scales) if quantized else (kv_pages,)
    kernel = functools.partial(_kernel, quantized=quantized, rows_per_token=g, block_k=block_k, num_splits=num_splits,
                               min_split_steps=min_split_steps, page_size=page_size, sm_scale=sm_scale,
                               sliding_window=sliding_window, logit_soft_cap=logit_soft_cap, precision=precision)
    out_o, out_lse = pl.pallas_call(
        kernel,
        grid=(n_items, hkv, num_splits),
        in_specs=[pl.no_block_spec] * 5 + [pl.BlockSpec((1, 1, rows, d), lambda i, h, k: (i, h, 0, 0))]
        + [pl.no_block_spec] * len(cache),
        out_specs=[pl.BlockSpec((1, 1, 1, rows, d), lambda i, h, k: (i, h, k, 0, 0)),
                   pl.BlockSpec((1, 1, 1, rows), lambda i, h, k: (i, h, k, 0))],
        # one split: the kernel's output is final (no merge), so it is written in q's dtype
        out_shape=[jax.ShapeDtypeStruct((n_items, hkv, num_splits, rows, d), q.dtype if num_splits == 1 else
                                        jnp.float32),
                   jax.ShapeDtypeStruct((n_items, hkv, num_splits, rows), jnp.float32)],
        compiler_params=_triton_params(num_warps, num_stages),
        interpret=interpret,
        debug=debug,
        name="ragged_paged_attention_triton",
    )(plan.item_seq, plan.item_first_pos, plan.item_q_len, kv_lens.astype(jnp.int32), pages, q_items, *cache)
    if num_splits == 1:
        merged, lse = out_o[:, :, 0], out_lse[:, :, 0]
    else:  # Merge the splits' partial softmaxes (flash-decoding epilogue).
        lse_max = jnp.max(out_lse, axis=2, keepdims=True)
        w = jnp.exp(out_lse - lse_max)  # [I, Hkv, K, R]
        denom = jnp.sum(w, axis=2)
        merged = jnp.sum(w[..., None] * out_o, axis=2) / jnp.where(denom == 0, 1.0, denom)[..., None]
        lse = lse_max[:, :, 0] + jnp.log(denom)
    if sinks is not None:  # [I, Hkv, R] rows' share of the softmax once each head's sink joins it
        keep = jax.nn.sigmoid(lse - plan_lib.sink_rows(sinks, hkv, bt, rows)[None])
        merged = merged.astype(jnp.float32) * keep[..., None]
    return plan_lib.scatter_outputs(merged[:, :, :bt * g].astype(q.dtype), plan, hq)


def _triton_params(num_warps: int, num_stages: int):
    from jax.experimental.pallas import triton as pl_triton
    jax_compat.allow_gpu_lowering_without_gpu()  # lowered from a CPU host (JAX >= 0.11 asks for the GPU model)
    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
