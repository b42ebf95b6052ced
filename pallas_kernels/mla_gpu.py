"""GPU backend of latent (multi-head latent attention) paged attention: a Pallas kernel on the Triton lowering
(`latent_attention_gpu`), flash-decoding style as `gpu.py`'s: one program per (query block, block of heads, KV split),
the splits merged by a JAX epilogue. Each step loads a tile of latent rows once for the program's heads, as two
power-of-two tiles (the latent c, R values, which is also the value, and the RoPE key, Dr values); a quantized
cache's rows are dequantised as they are loaded. Details: docs/attention.md."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import gpu, kv_quant, mla
from pallas_kernels import plan as plan_lib
from pallas_kernels.kv_quant import QuantizedKV

_NEG = -1e30


def unsupported_reason(kv_lora_rank: int, rope_dim: int, page_size: int) -> str | None:
    """Static. Why the Triton latent kernel cannot take these shapes (None: it can): its two tiles must be powers of
    two of at least 16 values (Triton's dot)."""
    for name, n in (("kv_lora_rank", kv_lora_rank), ("qk_rope_head_dim", rope_dim)):
        if not gpu._is_pow2(n) or n < gpu._MIN_DOT:
            return (f"the GPU (Triton) latent attention kernel needs a power-of-two {name} >= {gpu._MIN_DOT}, "
                    f"got {n} (Triton tiles are powers of two)")
    if not gpu._is_pow2(page_size):
        return f"the GPU (Triton) attention kernel needs a power-of-two page_size, got {page_size}"
    return None


def heads_per_program(num_heads: int, block_rows: int) -> int:
    """Static. Heads one program takes: the largest divisor of num_heads within block_rows (its accumulator is
    rows x kv_lora_rank float32, e.g. 32 x 512)."""
    return max(h for h in range(1, min(num_heads, block_rows) + 1) if num_heads % h == 0)


def _kernel(*refs, quantized, rows_per_token, value_dim, block_k, num_splits, min_split_steps, page_size, sm_scale,
            precision):
    # refs: the plan's arrays, the queries' latent and RoPE parts, the cache (+ scales [P, page_size, 1]), outputs
    item_seq_ref, item_first_pos_ref, item_q_len_ref, kv_lens_ref, page_indices_ref, qc_ref, qr_ref, kv_ref = refs[:8]
    scales_ref = refs[8] if quantized else None
    o_ref, lse_ref = refs[-2:]
    i, split = pl.program_id(0), pl.program_id(2)
    seq = item_seq_ref[i]
    first_pos = item_first_pos_ref[i]
    q_len = item_q_len_ref[i]
    kv_len = kv_lens_ref[seq]
    qc, qr = qc_ref[0, 0], qr_ref[0, 0]  # [R, Dc], [R, Dr]
    r = qc.shape[0]
    dr = qr.shape[1]
    pages_per_step = max(1, block_k // page_size)
    row_tok = lax.broadcasted_iota(jnp.int32, (r, block_k), 0) // rows_per_token
    row_pos = first_pos + row_tok
    hi = jnp.minimum(first_pos + q_len, kv_len)
    s_begin, s_end = gpu.split_steps(0, jnp.where(q_len > 0, hi, 0), split, block_k=block_k, num_splits=num_splits,
                                     min_split_steps=min_split_steps)

    def dot_t(a, b):  # a [R, K] . b [N, K]^T
        return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)

    def load(step):
        """The step's latent c [block_k, Dc] and RoPE key [block_k, Dr], in q's dtype."""
        if block_k < page_size:
            sub = page_size // block_k
            where = (page_indices_ref[seq, step // sub], pl.ds((step % sub) * block_k, block_k))
        elif pages_per_step == 1:
            where = (page_indices_ref[seq, step], slice(None))
        else:
            where = (page_indices_ref[seq, pl.ds(step * pages_per_step, pages_per_step)], slice(None))
        c = kv_ref[(*where, 0, pl.ds(0, value_dim))].reshape(block_k, value_dim)
        k_pe = kv_ref[(*where, 0, pl.ds(value_dim, dr))].reshape(block_k, dr)
        if scales_ref is None:
            return c, k_pe
        scale = scales_ref[(*where, 0)].reshape(block_k, 1)
        return ((kv_quant.widen(c) * scale).astype(qc.dtype), (kv_quant.widen(k_pe) * scale).astype(qc.dtype))

    def body(step, carry):
        m, l, acc = carry
        c, k_pe = load(step)
        s = (dot_t(qc, c) + dot_t(qr, k_pe)) * sm_scale
        kv_pos = step * block_k + lax.broadcasted_iota(jnp.int32, (r, block_k), 1)
        mask = (kv_pos <= row_pos) & (kv_pos < kv_len) & (row_tok < q_len)
        s = jnp.where(mask, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        prob = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(prob, axis=1)
        pv = lax.dot_general(prob.astype(c.dtype), c, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
        return m_new, l, alpha[:, None] * acc + pv

    init = (jnp.full((r,), _NEG, jnp.float32), jnp.zeros((r,), jnp.float32), jnp.zeros((r, value_dim), jnp.float32))
    m, l, acc = lax.fori_loop(s_begin, s_end, body, init)
    empty = l == 0.0
    o_ref[0, 0, 0] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[0, 0, 0] = jnp.where(empty, _NEG, m + jnp.log(jnp.where(empty, 1.0, l)))


def latent_attention_gpu(q, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, value_dim,
                         block_rows=32, num_splits=None, step_tokens=None, num_warps=None, num_stages=2,
                         interpret=False, debug=False):
    """Pure. Same contract as `mla.latent_attention_reference`, as a Triton Pallas kernel: q [T, H, Dc + Dr]
    (Dc = value_dim) over pages [P, page_size, 1, Dc + Dr] -> [T, H, Dc]. Raises ValueError (`unsupported_reason`)
    for shapes Triton cannot tile."""
    mla.check_latent_shapes(q, latent_pages, value_dim)
    t, h, d = q.shape
    page_size = latent_pages.shape[1]
    if (reason := unsupported_reason(value_dim, d - value_dim, page_size)) is not None:
        raise ValueError(reason)
    s_slots, max_pages = page_indices.shape
    hp = heads_per_program(h, block_rows)
    blocks = h // hp  # head blocks: the plan's "KV heads", each a program reading the same latent rows
    bt = plan_lib.choose_block_tokens(t, kv_lens.shape[0], hp, block_rows)
    plan = plan_lib.make_plan(cu_q_lens, kv_lens, num_seqs, t, bt)
    q_items = plan_lib.gather_queries(q, plan, blocks)  # [I, blocks, Bt*hp, D]
    rows = gpu._pow2_at_least(bt * hp, gpu._MIN_DOT)
    q_items = jnp.pad(q_items, ((0, 0), (0, 0), (0, rows - bt * hp), (0, 0)))
    q_latent, q_rope = q_items[..., :value_dim], q_items[..., value_dim:]
    n_items = plan.max_items
    quantized = isinstance(latent_pages, QuantizedKV)
    if step_tokens is None:  # a step's rows within 64 KiB (two pipeline stages in shared memory), a power of two
        itemsize = (q if quantized else latent_pages).dtype.itemsize
        fit = max(gpu._MIN_DOT, 64 * 1024 // (d * itemsize))
        step_tokens = min(128, 1 << (fit.bit_length() - 1), gpu._pow2_at_least(max_pages, 1) * page_size)
    if not gpu._is_pow2(step_tokens):
        raise ValueError(f"step_tokens must be a power of two, got {step_tokens}")
    block_k = step_tokens
    pages_per_step = max(1, block_k // page_size)
    pages = plan_lib.pad_page_indices(page_indices.astype(jnp.int32), pages_per_step)
    max_steps = pages.shape[1] * page_size // block_k
    min_split_steps = max(1, 256 // block_k)
    if num_splits is None:
        num_splits = max(1, min(-(-512 // (n_items * blocks)), -(-max_steps // min_split_steps)))
    num_warps = (4 if value_dim <= 64 else 8) if num_warps is None else num_warps
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    cache = (latent_pages.values, latent_pages.scales) if quantized else (latent_pages,)
    kernel = functools.partial(_kernel, quantized=quantized, rows_per_token=hp, value_dim=value_dim, block_k=block_k,
                               num_splits=num_splits, min_split_steps=min_split_steps, page_size=page_size,
                               sm_scale=sm_scale, precision=precision)
    dr = d - value_dim
    out_o, out_lse = pl.pallas_call(
        kernel,
        grid=(n_items, blocks, num_splits),
        in_specs=[pl.no_block_spec] * 5
        + [pl.BlockSpec((1, 1, rows, value_dim), lambda i, b, k: (i, b, 0, 0)),
           pl.BlockSpec((1, 1, rows, dr), lambda i, b, k: (i, b, 0, 0))]
        + [pl.no_block_spec] * len(cache),
        out_specs=[pl.BlockSpec((1, 1, 1, rows, value_dim), lambda i, b, k: (i, b, k, 0, 0)),
                   pl.BlockSpec((1, 1, 1, rows), lambda i, b, k: (i, b, k, 0))],
        out_shape=[jax.ShapeDtypeStruct((n_items, blocks, num_splits, rows, value_dim),
                                        q.dtype if num_splits == 1 else jnp.float32),
                   jax.ShapeDtypeStruct((n_items, blocks, num_splits, rows), jnp.float32)],
        compiler_params=gpu._triton_params(num_warps, num_stages),
        interpret=interpret,
        debug=debug,
        name="latent_attention_triton",
    )(plan.item_seq, plan.item_first_pos, plan.item_q_len, kv_lens.astype(jnp.int32), pages, q_latent, q_rope, *cache)
    if num_splits == 1:
        return plan_lib.scatter_outputs(out_o[:, :, 0, :bt * hp], plan, h)
    lse_max = jnp.max(out_lse, axis=2, keepdims=True)
    w = jnp.exp(out_lse - lse_max)
    denom = jnp.sum(w, axis=2)
    merged = jnp.sum(w[..., None] * out_o, axis=2) / jnp.where(denom == 0, 1.0, denom)[..., None]
    return plan_lib.scatter_outputs(merged[:, :, :bt * hp].astype(q.dtype), plan, h)
