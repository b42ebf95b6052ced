"""TPU backend: ragged paged attention as a Pallas Mosaic kernel (`ragged_paged_attention_tpu`: KV pages streamed from
HBM into VMEM by double-buffered DMA, one grid step per query block; a quantized cache dequantised a chunk at a time in
VMEM) and the in-place KV write as an aliased DMA kernel (`write_kv_tpu`). Details: docs/attention.md."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import kv_quant
from pallas_kernels import plan as plan_lib
from pallas_kernels.kv_quant import QuantizedKV

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


def _head_scales(scales, h):
    """The K and V scales `[chunk, 1]` of KV head `h` from a chunk's scales `[chunk, 2Hkv]` (lanes 2h and 2h+1),
    picked by a masked lane sum rather than a one-lane slice."""
    lane = lax.broadcasted_iota(jnp.int32, scales.shape, 1)
    return tuple(jnp.sum(jnp.where(lane == j, scales, 0.0), axis=1, keepdims=True) for j in (2 * h, 2 * h + 1))


def _kernel(*refs, quantized, rows_per_token, chunk_pages, page_size, max_pages, sm_scale, sliding_window,
            logit_soft_cap, ref_bitcast, with_sinks=False):
    # SMEM scalar prefetch: the plan's arrays and the block table; inputs: q, a VMEM block [1, Hkv, R, D], and the
    # cache in HBM [P, page_size * 2Hkv, D] (+ its scales [P, page_size, 2Hkv] when quantized); output: a VMEM block
    # [1, Hkv, R, D]; scratch: the chunk buffers [2, chunk * 2Hkv, D] (+ scales [2, chunk, 2Hkv] and the chunk
    # dequantised [chunk * 2Hkv, D] float32 when quantized) and DMA semaphores [2].
    item_seq_ref, item_first_pos_ref, item_q_len_ref, kv_lens_ref, page_indices_ref, q_ref, kv_hbm_ref = refs[:7]
    rest = list(refs[7:])
    scales_hbm_ref = rest.pop(0) if quantized else None
    sinks_ref = rest.pop(0) if with_sinks else None  # each row's sink logit [Hkv, R, 1] (`plan.sink_rows`)
    if quantized:
        o_ref, kv_buf, scales_buf, dequantized, sems = rest
    else:
        o_ref, kv_buf, sems = rest
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
            if quantized:
                copies.append(pltpu.make_async_copy(scales_hbm_ref.at[page],
                                                    scales_buf.at[slot, pl.ds(j * page_size, page_size)],
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
        if quantized:  # 8-bit rows widened once per chunk, so each head's K and V are 32-bit strided loads
            dequantized[...] = kv_quant.widen(kv_buf[slot])
            chunk_scales = scales_buf[slot]  # [chunk, 2Hkv]
        new = []
        for h in range(hkv):
            m, l, acc = carry[h]
            q = q_ref[0, h]  # [R, D]
            if quantized:
                k, v = _head_kv(dequantized, h, hkv, chunk)
                k_scale, v_scale = _head_scales(chunk_scales, h)
                k, v = (k * k_scale).astype(q.dtype), (v * v_scale).astype(q.dtype)
            else:
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
        m, l, acc = final[h]
        if sinks_ref is not None:  # the head's sink joins the softmax's denominator
            sink = sinks_ref[h]  # [R, 1]
            m_new = jnp.maximum(m, sink)
            alpha = jnp.exp(m - m_new)
            l = alpha * l + jnp.exp(sink - m_new)
            acc = alpha * acc
        o_ref[0, h] = (acc / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


def ragged_paged_attention_tpu(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                               sliding_window=None, logit_soft_cap=None, block_rows=128, chunk_tokens=128,
                               interpret=False, debug=False, sinks=None):
    """Pure. Same contract as `ragged_paged_attention_reference`, as a Mosaic TPU Pallas kernel. A `QuantizedKV`'s
    pages and scales are DMA'd as they are and dequantised in VMEM, a chunk at a time.

    `interpret`: False compiles for TPU; True runs Pallas's Mosaic interpreter (DMAs land at their wait, scratch
    starts as NaN; 16-bit K/V are read as `_head_kv(ref_bitcast=False)`); "generic" runs JAX's generic
    interpreter, which takes the compiled kernel's ref bitcast as it is. `debug` prints the Mosaic module."""
    if interpret not in (False, True, "generic"):
        raise ValueError(f"interpret must be False, True or 'generic', got {interpret!r}")
    t, hq, d = q.shape
    num_pages, page_size, h2, _ = kv_pages.shape
    hkv = h2 // 2
    g = hq // hkv
    quantized = isinstance(kv_pages, QuantizedKV)
    values = kv_pages.values if quantized else kv_pages
    bt = plan_lib.choose_block_tokens(t, kv_lens.shape[0], g, block_rows)
    sublanes = 8 * (4 // jnp.dtype(q.dtype).itemsize)  # the sublane tile: 8 rows of f32, 16 of bf16
    plan = plan_lib.make_plan(cu_q_lens, kv_lens, num_seqs, t, bt)
    q_items = plan_lib.gather_queries(q, plan, hkv)
    if not quantized:  # dots in the cache's dtype (a quantized cache is dequantised to q's)
        q_items = q_items.astype(values.dtype)
    rows = -(-bt * g // sublanes) * sublanes
    q_items = jnp.pad(q_items, ((0, 0), (0, 0), (0, rows - bt * g), (0, 0)))
    chunk_pages = max(1, min(chunk_tokens // page_size, page_indices.shape[1]))
    pages = plan_lib.pad_page_indices(page_indices.astype(jnp.int32), chunk_pages)
    max_pages = pages.shape[1]
    cache = [values.reshape(num_pages, page_size * h2, d)]  # free: merges two leading dims
    scratch = [pltpu.VMEM((2, chunk_pages * page_size * h2, d), values.dtype)]
    if quantized:
        cache.append(kv_pages.scales)
        scratch += [pltpu.VMEM((2, chunk_pages * page_size, h2), jnp.float32),
                    pltpu.VMEM((chunk_pages * page_size * h2, d), jnp.float32)]
    kernel = functools.partial(_kernel, quantized=quantized, rows_per_token=g, chunk_pages=chunk_pages,
                               page_size=page_size, max_pages=max_pages, sm_scale=sm_scale,
                               sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
                               ref_bitcast=interpret is not True, with_sinks=sinks is not None)
    extra_specs, extra = [], []
    if sinks is not None:  # one whole block: every item reads all heads' rows
        extra = [plan_lib.sink_rows(sinks, hkv, bt, rows)[:, :, None]]
        extra_specs = [pl.BlockSpec((hkv, rows, 1), lambda i, *_: (0, 0, 0))]
    n_items = plan.max_items
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(n_items,),
        in_specs=[pl.BlockSpec((1, hkv, rows, d), lambda i, *_: (i, 0, 0, 0))]
        + [pl.BlockSpec(memory_space=pl.ANY)] * len(cache) + extra_specs,
        out_specs=pl.BlockSpec((1, hkv, rows, d), lambda i, *_: (i, 0, 0, 0)),
        scratch_shapes=scratch + [pltpu.SemaphoreType.DMA((2,))],
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
      q_items, *cache, *extra)
    return plan_lib.scatter_outputs(out[:, :, :bt * g], plan, hq)


def _write_kernel(slot_ref, *refs, page_size, parts):
    # refs: the new rows of each part (the pages, + the scales of a quantized cache), the cache's parts as inputs
    # (aliased to the outputs: updated in place), the outputs, a DMA semaphore
    new, caches, sem = refs[:parts], refs[2 * parts:3 * parts], refs[3 * parts]
    num_tokens = new[0].shape[0]

    def copies(t):
        slot = jnp.maximum(slot_ref[t], 0)
        page, offset = lax.div(slot, page_size), lax.rem(slot, page_size)
        return [pltpu.make_async_copy(n.at[t], c.at[page, offset], sem.at[0]) for n, c in zip(new, caches)]

    def start(t, _):
        @pl.when(slot_ref[t] >= 0)
        def _():
            for cp in copies(t):
                cp.start()

    def wait(t, _):
        @pl.when(slot_ref[t] >= 0)
        def _():
            for cp in copies(t):
                cp.wait()

    lax.fori_loop(0, num_tokens, start, None)  # all copies in flight at once, then drain
    lax.fori_loop(0, num_tokens, wait, None)


def write_kv_tpu(kv_pages, k, v, slot_mapping, *, interpret=False):
    """Pure. `write_kv` as one Mosaic kernel: a DMA per token straight into its slot, the cache aliased. A
    `QuantizedKV` gets the rows quantised (`kv_quant.quantize`, in XLA) and a second DMA per token for the scales."""
    _, _, h2, d = kv_pages.shape
    return write_rows_tpu(kv_pages, jnp.stack([k, v], axis=2).reshape(k.shape[0], h2, d), slot_mapping,
                          interpret=interpret)


def write_rows_tpu(kv_pages, new_kv, slot_mapping, *, interpret=False):
    """Pure. `reference.write_rows` (each token's page row `new_kv[T, rows, D]`: K/V interleaved, or a latent
    cache's one row) as `write_kv_tpu`'s aliased DMA kernel."""
    _, page_size, _, _ = kv_pages.shape
    quantized = isinstance(kv_pages, QuantizedKV)
    if quantized:
        new = list(kv_quant.quantize(new_kv, kv_pages.values.dtype))
        caches = [kv_pages.values, kv_pages.scales]
    else:
        new, caches = [new_kv.astype(kv_pages.dtype)], [kv_pages]
    parts = len(caches)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(1,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * (2 * parts),
        out_specs=[pl.BlockSpec(memory_space=pl.ANY)] * parts,
        scratch_shapes=[pltpu.SemaphoreType.DMA((1,))])
    out = pl.pallas_call(
        functools.partial(_write_kernel, page_size=page_size, parts=parts),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches],
        # operand 1 + parts + j (after the prefetched slots and the new rows) is the cache's part j
        input_output_aliases={1 + parts + j: j for j in range(parts)},
        compiler_params=pltpu.CompilerParams(has_side_effects=True),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="write_kv_mosaic",
    )(slot_mapping.astype(jnp.int32), *new, *caches)
    return QuantizedKV(*out) if quantized else out[0]
