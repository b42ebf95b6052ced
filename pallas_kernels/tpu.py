"""TPU backend: ragged paged attention as a Pallas Mosaic kernel (`ragged_paged_attention_tpu`: KV pages streamed from
HBM into VMEM by double-buffered DMA, one grid step per query block) and the in-place KV write as an aliased DMA
kernel (`write_kv_tpu`). Details: docs/attention.md."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import plan as plan_lib

_NEG = -1e30


def _head_kv(buf, h, hkv, chunk, *, ref_bitcast=True):
    """K and V of KV head `h` from a VMEM ref `[chunk * 2Hkv, D]` of whole pages (token t's K at row 2Hkv*t + 2h,
    its V at the next row). Mosaic's strided load takes 32-bit data only: f32 rows are loaded strided as they are;
    for 16-bit data, rows 2h and 2h+1 of a token are one 32-bit sublane row of the packed layout, so the buffer is
    viewed as uint32 `[chunk * Hkv, D]` (K in the low half, V in the high half, as JAX's bitcast defines it), loaded
    with a 32-bit strided load and split, as JAX's ragged paged attention v1 and tpu-inference's v3 do.
    `ref_bitcast=False` (the Mosaic interpreter, which takes no ref bitcast) builds the same uint32 pairs from two
    16-bit strided loads instead."""
    dtype = buf.dtype
    h2 = 2 * hkv
    if dtype.itemsize == 4:
        return buf[pl.ds(2 * h, chunk, stride=h2), :], buf[pl.ds(2 * h + 1, chunk, stride=h2), :]
    if dtype.itemsize != 2:
        raise ValueError(f"the TPU attention kernel takes a 32- or 16-bit KV cache, got {dtype}")
    if ref_bitcast:
        pair = buf.bitcast(jnp.uint32)[pl.ds(h, chunk, stride=hkv), :]  # [chunk, D]: K | V << 16
    else:
        bits = [lax.bitcast_convert_type(buf[pl.ds(r, chunk, stride=h2), :], jnp.uint16).astype(jnp.uint32)
                for r in (2 * h, 2 * h + 1)]
        pair = bits[0] | (bits[1] << 16)
    if dtype == jnp.bfloat16:  # a bf16 is the top half of an f32: shift / mask into place, convert exactly
        k = pltpu.bitcast(pair << 16, jnp.float32).astype(dtype)
        v = pltpu.bitcast(pair & jnp.uint32(0xFFFF0000), jnp.float32).astype(dtype)
        return k, v
    return (pltpu.bitcast((pair & jnp.uint32(0xFFFF)).astype(jnp.uint16), dtype),
            pltpu.bitcast((pair >> 16).astype(jnp.uint16), dtype))


def _kernel(item_seq_ref, item_first_pos_ref, item_q_len_ref, kv_lens_ref, page_indices_ref,  # SMEM
            q_ref, kv_hbm_ref,  # inputs: VMEM block [1, Hkv, R, D]; HBM [P, page_size * 2Hkv, D]
            o_ref,  # output: VMEM block [1, Hkv, R, D]
            kv_buf, sems,  # scratch: VMEM [2, chunk * 2Hkv, D]; DMA semaphores [2]
            *, rows_per_token, chunk_pages, page_size, max_pages, sm_scale, sliding_window, logit_soft_cap,
            ref_bitcast):
    i = pl.program_id(0)
    seq = item_seq_ref[i]
    first_pos = item_first_pos_ref[i]
    q_len = item_q_len_ref[i]
    kv_len = kv_lens_ref[seq]
    _, hkv, r, d = q_ref.shape
    h2 = 2 * hkv
    chunk = chunk_pages * page_size
    page_rows = page_size * h2
    hi = jnp.minimum(first_pos + q_len, kv_len)
    lo = jnp.maximum(first_pos - sliding_window + 1, 0) if sliding_window is not None else jnp.int32(0)
    c_lo = lax.div(lo, chunk)  # lax.div, not //: operands are >= 0 and floor division lowers through sign
    c_hi = jnp.where(q_len > 0, lax.div(hi + chunk - 1, chunk), c_lo)

    def chunk_copies(c, slot):
        copies = []
        for j in range(chunk_pages):
            page = page_indices_ref[seq * max_pages + c * chunk_pages + j]
            copies.append(pltpu.make_async_copy(kv_hbm_ref.at[page],
                                                kv_buf.at[slot, pl.ds(j * page_rows, page_rows)],
                                                sems.at[slot]))
        return copies

    @pl.when(c_hi > c_lo)
    def _():
        for cp in chunk_copies(c_lo, 0):
            cp.start()

    row_tok = lax.div(lax.broadcasted_iota(jnp.int32, (r, chunk), 0), rows_per_token)
    row_pos = first_pos + row_tok

    def body(c, carry):
        slot = lax.rem(c - c_lo, 2)

        @pl.when(c + 1 < c_hi)
        def _():
            for cp in chunk_copies(c + 1, 1 - slot):
                cp.start()

        for cp in chunk_copies(c, slot):
            cp.wait()
        kv_pos = c * chunk + lax.broadcasted_iota(jnp.int32, (r, chunk), 1)
        mask = (kv_pos <= row_pos) & (kv_pos < kv_len) & (row_tok < q_len)
        if sliding_window is not None:
            mask &= kv_pos > row_pos - sliding_window
        new = []
        for h in range(hkv):
            m, l, acc = carry[h]
            q = q_ref[0, h]  # [R, D]
            k, v = _head_kv(kv_buf.at[slot], h, hkv, chunk, ref_bitcast=ref_bitcast)  # [chunk, D] each
            # float32 operands: full-precision passes (the MXU would otherwise round them to bf16, as gpu.py avoids)
            precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32) * sm_scale
            if logit_soft_cap is not None:
                s = logit_soft_cap * jnp.tanh(s / logit_soft_cap)
            s = jnp.where(mask, s, _NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
            alpha = jnp.exp(m - m_new)
            l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)
            new.append((m_new, l, alpha * acc + pv))
        return tuple(new)

    init = tuple((jnp.full((r, 1), _NEG, jnp.float32), jnp.zeros((r, 1), jnp.float32),
                  jnp.zeros((r, d), jnp.float32)) for _ in range(hkv))
    final = lax.fori_loop(c_lo, c_hi, body, init)
    for h in range(hkv):
        _, l, acc = final[h]
        o_ref[0, h] = (acc / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


def ragged_paged_attention_tpu(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                               sliding_window=None, logit_soft_cap=None, block_rows=128, chunk_tokens=128,
                               interpret=False, debug=False):
    """Pure. Same contract as `ragged_paged_attention_reference`, as a Mosaic TPU Pallas kernel.

    `interpret`: False compiles for TPU; True runs Pallas's Mosaic interpreter (DMAs land at their wait, scratch
    starts as NaN; 16-bit K/V are read as `_head_kv(ref_bitcast=False)`); "generic" runs JAX's generic
    interpreter, which takes the compiled kernel's ref bitcast as it is. `debug` prints the Mosaic module."""
    if interpret not in (False, True, "generic"):
        raise ValueError(f"interpret must be False, True or 'generic', got {interpret!r}")
    t, hq, d = q.shape
    num_pages, page_size, h2, _ = kv_pages.shape
    hkv = h2 // 2
    g = hq // hkv
    bt = plan_lib.choose_block_tokens(t, kv_lens.shape[0], g, block_rows)
    sublanes = 8 * (4 // jnp.dtype(q.dtype).itemsize)  # the sublane tile: 8 rows of f32, 16 of bf16
    plan = plan_lib.make_plan(cu_q_lens, kv_lens, num_seqs, t, bt)
    q_items = plan_lib.gather_queries(q, plan, hkv).astype(kv_pages.dtype)
    rows = -(-bt * g // sublanes) * sublanes
    q_items = jnp.pad(q_items, ((0, 0), (0, 0), (0, rows - bt * g), (0, 0)))
    chunk_pages = max(1, min(chunk_tokens // page_size, page_indices.shape[1]))
    pages = plan_lib.pad_page_indices(page_indices.astype(jnp.int32), chunk_pages)
    max_pages = pages.shape[1]
    kv_flat = kv_pages.reshape(num_pages, page_size * h2, d)  # free: merges two leading dims
    kernel = functools.partial(_kernel, rows_per_token=g, chunk_pages=chunk_pages, page_size=page_size,
                               max_pages=max_pages, sm_scale=sm_scale, sliding_window=sliding_window,
                               logit_soft_cap=logit_soft_cap, ref_bitcast=interpret is not True)
    n_items = plan.max_items
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(n_items,),
        in_specs=[pl.BlockSpec((1, hkv, rows, d), lambda i, *_: (i, 0, 0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((1, hkv, rows, d), lambda i, *_: (i, 0, 0, 0)),
        scratch_shapes=[pltpu.VMEM((2, chunk_pages * page_size * h2, d), kv_pages.dtype),
                        pltpu.SemaphoreType.DMA((2,))],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((n_items, hkv, rows, d), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams() if interpret is True else bool(interpret),
        debug=debug,  # True: print the kernel's jaxpr and Mosaic module when it lowers
        name="ragged_paged_attention_mosaic",
    )(plan.item_seq, plan.item_first_pos, plan.item_q_len, kv_lens.astype(jnp.int32), pages.reshape(-1),
      q_items, kv_flat)
    return plan_lib.scatter_outputs(out[:, :, :bt * g], plan, hq)


def _write_kernel(slot_ref, new_kv_ref, cache_in_ref, cache_ref, sem, *, page_size):
    del cache_in_ref  # aliased to cache_ref: the cache is updated in place
    num_tokens = new_kv_ref.shape[0]

    def copy(t):
        slot = jnp.maximum(slot_ref[t], 0)
        page, offset = lax.div(slot, page_size), lax.rem(slot, page_size)
        return pltpu.make_async_copy(new_kv_ref.at[t], cache_ref.at[page, offset], sem.at[0])

    def start(t, _):
        @pl.when(slot_ref[t] >= 0)
        def _():
            copy(t).start()

    def wait(t, _):
        @pl.when(slot_ref[t] >= 0)
        def _():
            copy(t).wait()

    lax.fori_loop(0, num_tokens, start, None)  # all copies in flight at once, then drain
    lax.fori_loop(0, num_tokens, wait, None)


def write_kv_tpu(kv_pages, k, v, slot_mapping, *, interpret=False):
    """Pure. `write_kv` as one Mosaic kernel: a DMA per token straight into its slot, the cache aliased."""
    num_pages, page_size, h2, d = kv_pages.shape
    t = k.shape[0]
    new_kv = jnp.stack([k, v], axis=2).reshape(t, h2, d).astype(kv_pages.dtype)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(1,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.SemaphoreType.DMA((1,))])
    return pl.pallas_call(
        functools.partial(_write_kernel, page_size=page_size),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype),
        input_output_aliases={2: 0},  # operand 2 (after the prefetched slots and new_kv) is the cache
        compiler_params=pltpu.CompilerParams(has_side_effects=True),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="write_kv_mosaic",
    )(slot_mapping.astype(jnp.int32), new_kv, kv_pages)
