"""TPU backend of latent (multi-head latent attention) paged attention: a Pallas Mosaic kernel
(`latent_attention_tpu`) as `tpu.py`'s: one grid step per query block, the sequence's latent rows streamed from HBM
into VMEM a chunk of pages at a time by double-buffered DMA, every head block of the step reading the same chunk
(one HBM read of each latent row per query block). Scores take one dot over the whole row (latent and RoPE key);
the values are the row's first value_dim lanes (the dot runs over the whole row, sliced after the kernel: no
unaligned lane slice inside it). A quantized cache is dequantised a chunk at a time in VMEM. Details:
docs/attention.md."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import kv_quant, mla
from pallas_kernels import plan as plan_lib
from pallas_kernels.kv_quant import QuantizedKV
from pallas_kernels.mla_gpu import heads_per_program

_NEG = -1e30


def _kernel(*refs, quantized, rows_per_token, chunk_pages, page_size, max_pages, sm_scale):
    # SMEM scalar prefetch: the plan's arrays and the block table; inputs: q [1, blocks, R, D] in VMEM, the cache in
    # HBM [P, page_size, D] (+ scales [P, page_size, 1]); output [1, blocks, R, D]; scratch: chunk buffers
    # [2, chunk, D] (+ scales [2, chunk, 1]) and DMA semaphores [2].
    item_seq_ref, item_first_pos_ref, item_q_len_ref, kv_lens_ref, page_indices_ref, q_ref, kv_hbm_ref = refs[:7]
    if quantized:
        scales_hbm_ref, o_ref, kv_buf, scales_buf, sems = refs[7:]
    else:
        o_ref, kv_buf, sems = refs[7:]
    i = pl.program_id(0)
    seq = item_seq_ref[i]
    first_pos = item_first_pos_ref[i]
    q_len = item_q_len_ref[i]
    kv_len = kv_lens_ref[seq]
    _, blocks, r, d = q_ref.shape
    chunk = chunk_pages * page_size
    hi = jnp.minimum(first_pos + q_len, kv_len)
    c_hi = jnp.where(q_len > 0, lax.div(hi + chunk - 1, chunk), 0)

    def chunk_copies(c, slot):
        copies = []
        for j in range(chunk_pages):
            page = page_indices_ref[seq * max_pages + c * chunk_pages + j]
            copies.append(pltpu.make_async_copy(kv_hbm_ref.at[page], kv_buf.at[slot, pl.ds(j * page_size, page_size)],
                                                sems.at[slot]))
            if quantized:
                copies.append(pltpu.make_async_copy(scales_hbm_ref.at[page],
                                                    scales_buf.at[slot, pl.ds(j * page_size, page_size)],
                                                    sems.at[slot]))
        return copies

    @pl.when(c_hi > 0)
    def _():
        for cp in chunk_copies(0, 0):
            cp.start()

    row_tok = lax.div(lax.broadcasted_iota(jnp.int32, (r, chunk), 0), rows_per_token)
    row_pos = first_pos + row_tok

    def body(c, carry):
        slot = lax.rem(c, 2)

        @pl.when(c + 1 < c_hi)
        def _():
            for cp in chunk_copies(c + 1, 1 - slot):
                cp.start()

        for cp in chunk_copies(c, slot):
            cp.wait()
        kv_pos = c * chunk + lax.broadcasted_iota(jnp.int32, (r, chunk), 1)
        mask = (kv_pos <= row_pos) & (kv_pos < kv_len) & (row_tok < q_len)
        rows = kv_buf[slot]  # [chunk, D]
        dtype = q_ref.dtype
        if quantized:
            rows = (kv_quant.widen(rows) * scales_buf[slot]).astype(dtype)
        precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
        new = []
        for b in range(blocks):
            m, l, acc = carry[b]
            s = lax.dot_general(q_ref[0, b], rows, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32) * sm_scale
            s = jnp.where(mask, s, _NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
            alpha = jnp.exp(m - m_new)
            l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
            pv = lax.dot_general(p.astype(rows.dtype), rows, (((1,), (0,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)
            new.append((m_new, l, alpha * acc + pv))
        return tuple(new)

    init = tuple((jnp.full((r, 1), _NEG, jnp.float32), jnp.zeros((r, 1), jnp.float32),
                  jnp.zeros((r, d), jnp.float32)) for _ in range(blocks))
    final = lax.fori_loop(0, c_hi, body, init)
    for b in range(blocks):
        _, l, acc = final[b]
        o_ref[0, b] = (acc / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


def latent_attention_tpu(q, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, value_dim,
                         block_rows=128, chunk_tokens=128, interpret=False, debug=False):
    """Pure. Same contract as `mla.latent_attention_reference`, as a Mosaic TPU Pallas kernel. `interpret`: False
    compiles for TPU, True runs Pallas's Mosaic interpreter. `debug` prints the Mosaic module."""
    mla.check_latent_shapes(q, latent_pages, value_dim)
    t, h, d = q.shape
    num_pages, page_size = latent_pages.shape[:2]
    quantized = isinstance(latent_pages, QuantizedKV)
    values = latent_pages.values if quantized else latent_pages
    hp = heads_per_program(h, block_rows)
    blocks = h // hp
    bt = plan_lib.choose_block_tokens(t, kv_lens.shape[0], hp, block_rows)
    sublanes = 8 * (4 // jnp.dtype(q.dtype).itemsize)
    plan = plan_lib.make_plan(cu_q_lens, kv_lens, num_seqs, t, bt)
    q_items = plan_lib.gather_queries(q, plan, blocks)  # [I, blocks, Bt*hp, D]
    if not quantized:
        q_items = q_items.astype(values.dtype)
    rows = -(-bt * hp // sublanes) * sublanes
    q_items = jnp.pad(q_items, ((0, 0), (0, 0), (0, rows - bt * hp), (0, 0)))
    chunk_pages = max(1, min(chunk_tokens // page_size, page_indices.shape[1]))
    pages = plan_lib.pad_page_indices(page_indices.astype(jnp.int32), chunk_pages)
    cache = [values.reshape(num_pages, page_size, d)]  # free: drops the one-row axis
    scratch = [pltpu.VMEM((2, chunk_pages * page_size, d), values.dtype)]
    if quantized:
        cache.append(latent_pages.scales)
        scratch.append(pltpu.VMEM((2, chunk_pages * page_size, 1), jnp.float32))
    kernel = functools.partial(_kernel, quantized=quantized, rows_per_token=hp, chunk_pages=chunk_pages,
                               page_size=page_size, max_pages=pages.shape[1], sm_scale=sm_scale)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(plan.max_items,),
        in_specs=[pl.BlockSpec((1, blocks, rows, d), lambda i, *_: (i, 0, 0, 0))]
        + [pl.BlockSpec(memory_space=pl.ANY)] * len(cache),
        out_specs=pl.BlockSpec((1, blocks, rows, d), lambda i, *_: (i, 0, 0, 0)),
        scratch_shapes=scratch + [pltpu.SemaphoreType.DMA((2,))],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((plan.max_items, blocks, rows, d), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        debug=debug,
        name="latent_attention_mosaic",
    )(plan.item_seq, plan.item_first_pos, plan.item_q_len, kv_lens.astype(jnp.int32), pages.reshape(-1),
      q_items, *cache)
    return plan_lib.scatter_outputs(out[:, :, :bt * hp, :value_dim], plan, h)
