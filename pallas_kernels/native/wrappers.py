"""The jit-able calls of the native CPU kernels through the XLA FFI, each with its trace-time check of whether it can
run here (`*_supported`): `matmul`, `matmul_packed`, `matmul_int8`, `greedy_head`, `expert_mlp`,
`ragged_paged_attention`, `latent_attention` and `lora`."""
from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_quant import QuantizedKV
from pallas_kernels.names import LORA_INT8_RANK_ROWS, LORA_LAYOUTS
from pallas_kernels.native.library import (_ATTENTION, _EXPERT_MLP, _GREEDY_HEAD, _LATENT_ATTENTION, _LORA,
                                           _LORA_INT8, _MATMUL,
                                           _MATMUL_INT8, _MATMUL_PACKED, _isa_attr, _require, enabled, int8_dot_runs,
                                           isa, runnable_isas)
from pallas_kernels.native.packing import PANELS, _padded_k, is_packed, is_packed_experts, packed_shape

INT8_ENV_VAR = "MESHSERVE_INT8_KERNEL"  # auto (default) | widen | dot: how the int8 matmul multiplies (INT8_METHODS)
INT8_METHODS = ("auto", "widen", "dot")  # the index is the kernel's `method` (native/api.h Int8Method)


def _single_device_context() -> bool:
    """Trace-time. The kernels run on whole local arrays: outside shard_map, only without a multi-device mesh
    (a custom call on GSPMD-sharded operands would gather them)."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or mesh.size == 1 or all(t == jax.sharding.AxisType.Manual for t in mesh.axis_types)


# Most rows the native matmul takes (the decode-sized steps); above, XLA's (packing, AMX for bf16) is faster.
# Measured side by side on the 125M model's weight matmuls (`python -m serving.bench offline --only=floor`).
MAX_MATMUL_ROWS = {jnp.dtype(jnp.float32): 32, jnp.dtype(jnp.bfloat16): 16}


def matmul_supported(x: jax.Array, w: jax.Array, out_dtype) -> bool:
    """Trace-time. Whether `matmul` should run natively for these operands here."""
    if w.ndim != 2 or x.shape[-1] != w.shape[0] or not enabled() or not _single_device_context():
        return False
    dt, out = jnp.dtype(x.dtype), jnp.dtype(out_dtype)
    if dt not in MAX_MATMUL_ROWS or w.dtype != dt or math.prod(x.shape[:-1]) > MAX_MATMUL_ROWS[dt]:
        return False
    return out == dt or out == jnp.float32


def matmul(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """Pure. `x[..., K] @ w[K, N]` accumulated in float32, returned in `out_dtype` (default x's)."""
    _require()
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[1],), out_dtype)
    return jax.ffi.ffi_call(_MATMUL, out)(x, w, isa=_isa_attr())


def packed_supported(x: jax.Array, w: jax.Array, out_dtype) -> bool:
    """Trace-time. Whether `matmul_packed` can run here (else unpack and use XLA's dot)."""
    if not is_packed(w) or not enabled() or not _single_device_context():
        return False
    dt, out = jnp.dtype(x.dtype), jnp.dtype(out_dtype)
    if dt != jnp.dtype(w.dtype) or dt not in PANELS:
        return False
    return out == dt or out == jnp.float32


def matmul_packed(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """Pure. `x[..., K] @ W` for W packed by `pack_weight`, accumulated in float32, any number of rows."""
    _require()
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    _, n = packed_shape(w, x.shape[-1])
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (n,), out_dtype)
    return jax.ffi.ffi_call(_MATMUL_PACKED, out)(x, w, isa=_isa_attr())


# ---------------------------------------------------------------------------------------------------------
# int8 weights with float32 scales (native/matmul_int8.h): x @ (w * scale) with w int8, row-major [K, N] or packed,
# scale [N] (per column) or [G, N] (per group of K/G rows and column), accumulated in float32. Two methods: "widen"
# (exact products: the weights widened in registers, or from many rows each panel once, to bfloat16 where x is
# bfloat16 and the path has pair dot products) and "dot" (x quantised per row to two int8 digits, ~15 bits, and int8
# dot products: vpdpbusd on AVX512_VNNI, sdot on aarch64's dotprod); "auto" takes the dot method for bfloat16 x
# where the path has it, except many rows on the pair paths, and the exact widened products for float32 x
# (docs/native-kernels.md).

# Most rows the int8 matmul on row-major weights takes; above, XLA's (the weight converted, then its dot). Row-major
# int8 streams poorly (short row segments): on the AMD EPYC both ran even at 4-16 rows (768 x 2304, weights from
# memory), XLA ahead from 32. Packed int8 weights take the kernel at any rows (at 256 rows even with XLA's unpack
# and dot, faster below).
MAX_INT8_ROWS = 16



def int8_method() -> str:
    """Trace-time. The int8 matmul's method for programs traced now: MESHSERVE_INT8_KERNEL where set ("dot" must be
    one the path runs), else "auto"."""
    method = os.environ.get(INT8_ENV_VAR, "").strip().lower() or "auto"
    if method not in INT8_METHODS:
        raise ValueError(f"{INT8_ENV_VAR}={method!r}: expected one of {', '.join(INT8_METHODS)}")
    if method == "dot" and not int8_dot_runs(isa()):
        raise RuntimeError(f"{INT8_ENV_VAR}=dot: the {isa()} path has no int8 dot products on this CPU (paths that "
                           f"do: {', '.join(p for p in runnable_isas() if int8_dot_runs(p)) or 'none'})")
    return method


def scale_groups(scale, n: int) -> int:
    """G of a weight scale for N columns: 1 where it holds one per column ([N], or the output dims), else its
    leading dimension ([G, N] or G + the output dims); raises where its size is not a multiple of N."""
    size = math.prod(scale.shape)
    if size == 0 or size % n:
        raise ValueError(f"scale of shape {scale.shape} does not hold per-column or per-group scales of {n} columns")
    return size // n


def matmul_int8_supported(x: jax.Array, w: jax.Array, scale: jax.Array, out_dtype) -> bool:
    """Trace-time. Whether `matmul_int8` can run here: x float32 or bfloat16, w int8 row-major [K, N] (at most
    MAX_INT8_ROWS rows of x) or packed, scale float32 per column or per group (packed: groups of a multiple of 4
    rows), out float32 or bfloat16."""
    if jnp.dtype(w.dtype) != jnp.int8 or not enabled() or not _single_device_context():
        return False
    floats = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
    if jnp.dtype(x.dtype) not in floats or jnp.dtype(out_dtype) not in floats or jnp.dtype(scale.dtype) != jnp.float32:
        return False
    k = x.shape[-1]
    packed = is_packed(w)
    if packed:
        if w.shape[1] * 4 != _padded_k(k, jnp.int8):
            return False
        n = w.shape[0] * w.shape[2]
    elif w.ndim != 2 or w.shape[0] != k or math.prod(x.shape[:-1]) > MAX_INT8_ROWS:
        return False
    else:
        n = w.shape[1]
    size = math.prod(scale.shape)
    if n == 0 or size == 0 or size % n:
        return False
    groups = size // n
    return k % groups == 0 and (not packed or groups == 1 or (k // groups) % 4 == 0)


def matmul_int8(x: jax.Array, w: jax.Array, scale: jax.Array, out_dtype=None) -> jax.Array:
    """Pure. `x[..., K] @ (w * scale)` accumulated in float32, returned in `out_dtype` (default x's), for int8 `w`
    row-major [K, N] or packed (`pack_weight`) and float32 `scale` per column (N values) or per group of K/G rows
    (G x N values, G leading); `matmul_int8_supported` must hold."""
    _require()
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    n = packed_shape(w, x.shape[-1])[1] if is_packed(w) else w.shape[1]
    groups = scale_groups(scale, n)
    scale = scale.reshape((n,) if groups == 1 else (groups, n))
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (n,), out_dtype)
    return jax.ffi.ffi_call(_MATMUL_INT8, out)(x, w, scale, isa=_isa_attr(),
                                               method=np.int32(INT8_METHODS.index(int8_method())))


# ---------------------------------------------------------------------------------------------------------
# Greedy LM head by screening (native/greedy_head.h): the argmax of the exact logits from
# a read of an int8 copy of the head plus the full-precision columns of the few rows its error bounds cannot
# rule out.
HEAD_LAYOUTS = {"packed": 0, "kn": 1, "nk": 2}  # the exact head: packed panels, [K, N], [N, K] (tied table)


def greedy_head_supported(x: jax.Array, w: jax.Array) -> bool:
    """Trace-time. Whether `greedy_head` can run here for hidden states `x` and the exact head `w`."""
    if not enabled() or not _single_device_context() or x.ndim != 2:
        return False
    return jnp.dtype(x.dtype) == jnp.dtype(w.dtype) and jnp.dtype(x.dtype) in PANELS


def greedy_head(x: jax.Array, q: jax.Array, bounds: jax.Array, w: jax.Array, num_rows: jax.Array, *,
                layout: str) -> tuple[jax.Array, jax.Array]:
    """Pure. For hidden states x [M, K]: int32 [M] the argmax of each row's exact logits x @ head (lowest id on
    ties), and int32 [M] how many vocabulary rows each needed at full precision (its candidates). Only the first
    `num_rows[0]` rows are computed (the rest: 0, 0). `q`, `bounds`: `greedy_head_screen` of the head; `w` the
    head itself in `layout` ("packed": `pack_weight` panels, "kn": [K, N], "nk": [N, K])."""
    _require()
    m = x.shape[0]
    out = (jax.ShapeDtypeStruct((m,), jnp.int32), jax.ShapeDtypeStruct((m,), jnp.int32))
    return jax.ffi.ffi_call(_GREEDY_HEAD, out)(x, q, bounds, w, num_rows.astype(jnp.int32).reshape(1),
                                               layout=np.int32(HEAD_LAYOUTS[layout]), isa=_isa_attr())


def expert_mlp_supported(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, scales=None) -> bool:
    """Trace-time. Whether `expert_mlp` can run here: x [T, E] float32 or bfloat16 and row-major gate/up [S, E, I],
    down [S, I, E] in x's dtype (`scales` None), or int8 with float32 `scales` (gate, up, down) per output channel
    and slot: [S, I], [S, I], [S, E] (group-wise scales are not taken); either packed slot by slot
    (`pack_weights`)."""
    if not enabled() or not _single_device_context() or x.ndim != 2:
        return False
    dt = jnp.dtype(x.dtype)
    wdt = dt if scales is None else jnp.dtype(jnp.int8)
    if dt not in PANELS or any(jnp.dtype(w.dtype) != wdt for w in (gate, up, down)):
        return False
    if all(is_packed_experts(w) for w in (gate, up, down)):
        s, e, i = gate.shape[0], x.shape[1], gate.shape[1] * gate.shape[3]
        shapes_ok = (gate.shape[2] * gate.shape[4] == _padded_k(e, wdt) and up.shape == gate.shape
                     and down.shape[:2] == (s, e // gate.shape[3]) and down.shape[3] * down.shape[1] == e
                     and down.shape[2] * down.shape[4] == _padded_k(i, wdt))
    elif gate.ndim == 3:
        s, e, i = gate.shape
        shapes_ok = x.shape[1] == e and up.shape == (s, e, i) and down.shape == (s, i, e)
    else:
        return False
    return shapes_ok and (scales is None or [(tuple(c.shape), jnp.dtype(c.dtype)) for c in scales] == [
        ((s, i), jnp.float32), ((s, i), jnp.float32), ((s, e), jnp.float32)])


def expert_mlp(x: jax.Array, slots: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
               down: jax.Array, scales=None) -> jax.Array:
    """Pure. [T, E] in x's dtype: sum_k weights[t, k] * down_s(silu(x[t] @ gate_s) * (x[t] @ up_s)) with
    s = slots[t, k] (slots < 0 or >= S: no work), accumulated in float32 (native/moe.h). Each selected expert's
    weights are read once for all its tokens; experts no token selected are not read. int8 experts: `scales`
    (gate, up, down) per output channel and slot, [S, I], [S, I], [S, E], float32: the weights are w * scale."""
    _require()
    if scales is None:  # (empty scale operands: weights in x's dtype)
        scales = (jnp.zeros((0,), jnp.float32),) * 3
    call = jax.ffi.ffi_call(_EXPERT_MLP, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return call(x, jnp.asarray(slots, jnp.int32), jnp.asarray(weights, jnp.float32), gate, up, down, *scales,
                isa=_isa_attr())


def attention_supported(q: jax.Array, kv_pages) -> bool:
    """Trace-time. Whether `ragged_paged_attention` can take these operands here: f32 q over an f32 cache, bf16 q
    over a bf16 (or uint16-bits) cache, or f32 / bf16 q over a `QuantizedKV` (int8, float8_e4m3fn or its uint8
    bits)."""
    if not enabled() or q.shape[-1] % 16 or kv_pages.shape[-1] != q.shape[-1]:
        return False
    if isinstance(kv_pages, QuantizedKV):
        return (q.dtype in (jnp.float32, jnp.bfloat16) and kv_pages.scales.dtype == jnp.float32
                and kv_pages.values.dtype in (jnp.int8, jnp.uint8, jnp.float8_e4m3fn))
    if q.dtype == jnp.float32:
        return kv_pages.dtype == jnp.float32
    return q.dtype == jnp.bfloat16 and kv_pages.dtype in (jnp.bfloat16, jnp.uint16)


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                           sliding_window=None, logit_soft_cap=None, sinks=None):
    """Pure. Same contract as `reference.ragged_paged_attention_reference`; a `QuantizedKV` is dequantised row by
    row inside the kernel (native/attention.h); `sinks[Hq]`: each query head's sink logit (GPT-OSS)."""
    _require()
    i32 = lambda a: jnp.asarray(a, jnp.int32)
    if isinstance(kv_pages, QuantizedKV):
        values, scales = kv_pages.values, kv_pages.scales
    else:  # an unquantized cache has no scales: an empty operand
        values, scales = kv_pages, jnp.zeros((0,), jnp.float32)
    call = jax.ffi.ffi_call(_ATTENTION, jax.ShapeDtypeStruct(q.shape, q.dtype))
    sinks = jnp.zeros((0,), jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32).reshape(q.shape[1])
    return call(q, values, scales, i32(kv_lens), i32(page_indices), i32(cu_q_lens),
                jnp.reshape(i32(num_seqs), (1,)), sinks, sm_scale=np.float32(sm_scale),
                soft_cap=np.float32(logit_soft_cap or 0.0), window=np.int64(sliding_window or 0), isa=_isa_attr())



def latent_attention_supported(q: jax.Array, latent_pages, value_dim: int) -> bool:
    """Trace-time. Whether `latent_attention` can take these operands here: q [T, H, D] f32 or bf16 over a latent
    cache [P, page, 1, D] in q's dtype (bf16 also as uint16 bits) or a `QuantizedKV` (int8, float8_e4m3fn or its
    uint8 bits), D and value_dim multiples of 16."""
    shape = latent_pages.shape
    if not enabled() or q.ndim != 3 or len(shape) != 4 or shape[2] != 1 or shape[3] != q.shape[2]:
        return False
    if q.shape[2] % 16 or value_dim % 16 or not 0 < value_dim <= q.shape[2]:
        return False
    if isinstance(latent_pages, QuantizedKV):
        return (q.dtype in (jnp.float32, jnp.bfloat16) and latent_pages.scales.dtype == jnp.float32
                and latent_pages.values.dtype in (jnp.int8, jnp.uint8, jnp.float8_e4m3fn))
    if q.dtype == jnp.float32:
        return latent_pages.dtype == jnp.float32
    return q.dtype == jnp.bfloat16 and latent_pages.dtype in (jnp.bfloat16, jnp.uint16)


def latent_attention(q, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, value_dim):
    """Pure. Same contract as `pallas_kernels.mla.latent_attention_reference` (native/mla.h): out [T, H, value_dim];
    a `QuantizedKV` is dequantised row by row as its chunk is read."""
    _require()
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    if isinstance(latent_pages, QuantizedKV):
        values, scales = latent_pages.values, latent_pages.scales
    else:
        values, scales = latent_pages, jnp.zeros((0,), jnp.float32)
    call = jax.ffi.ffi_call(_LATENT_ATTENTION, jax.ShapeDtypeStruct(q.shape[:2] + (value_dim,), q.dtype))
    return call(q, values, scales, i32(kv_lens), i32(page_indices), i32(cu_q_lens),
                jnp.reshape(i32(num_seqs), (1,)), sm_scale=np.float32(sm_scale), value_dim=np.int64(value_dim),
                isa=_isa_attr())


def lora_supported(x: jax.Array, a: jax.Array, b: jax.Array) -> bool:
    """Trace-time. Whether `lora` can run here: x [T, K] float32 or bfloat16, a [S, R, K] and b [S, R, N] in x's
    dtype, on whole local arrays (no multi-device mesh)."""
    if not enabled() or not _single_device_context() or x.ndim != 2 or a.ndim != 3 or b.ndim != 3:
        return False
    dt = jnp.dtype(x.dtype)
    return (dt in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)) and a.dtype == dt and b.dtype == dt
            and a.shape[2] == x.shape[1] and b.shape[:2] == a.shape[:2])


def lora(x: jax.Array, slots: jax.Array, a: jax.Array, b: jax.Array, ranks: jax.Array,
         a_layout: str = "rows", b_layout: str = "rows") -> jax.Array:
    """Pure. [T, N] in x's dtype: (x[t] @ a[s][:r, :]^T) @ b[s][:r, :] per token, s = slots[t], r = ranks[s] (zeros
    where s < 0 or >= S, or r = 0), accumulated in float32 (native/lora.h): each adapter the tokens use read once,
    up to its rank; the others not at all. `a_layout` (rows, pairs or blocks), `b_layout` (rows or strips): each
    slot's A, B in that `pallas_kernels.lora.to_layout` form (bfloat16 only; the call refuses shapes or a path that
    cannot read it)."""
    return lora_parts(x, slots, [(a, b, ranks)], a_layout, b_layout)[0]


def lora_parts(x: jax.Array, slots: jax.Array, parts, a_layout: str = "rows",
               b_layout: str = "rows") -> list[jax.Array]:
    """Pure. `lora` for 1 to 4 projections of one x at once (q|k|v, gate|up: x's rows gathered once, each slot's parts
    in one unit of work): `parts` a sequence of (a, b, ranks) with one S and R, all in the layouts given; one [T, N]
    output per part."""
    _require()
    if not 1 <= len(parts) <= 4:
        raise ValueError(f"lora_parts takes 1 to 4 parts, not {len(parts)}")
    call = jax.ffi.ffi_call(_LORA, [jax.ShapeDtypeStruct((x.shape[0], b.shape[2]), x.dtype) for _, b, _ in parts])
    operands = [x, jnp.asarray(slots, jnp.int32)]
    for a, b, ranks in parts:
        operands += [a, b, jnp.asarray(ranks, jnp.int32)]
    return list(call(*operands, isa=_isa_attr(), a_layout=np.int32(LORA_LAYOUTS.index(a_layout)),
                     b_layout=np.int32(LORA_LAYOUTS.index(b_layout))))


def lora_int8_supported(x: jax.Array, a: jax.Array, b: jax.Array) -> bool:
    """Trace-time. Whether `lora_int8` can run here: x [T, K] float32 or bfloat16, a [S, R/32, Kq, 32, 4] and
    b [S, R * N] int8 (`pallas_kernels.lora.quantize_adapter`'s layouts, N a multiple of 16), on whole local
    arrays."""
    if not enabled() or not _single_device_context() or x.ndim != 2 or a.ndim != 5 or b.ndim != 2:
        return False
    r = a.shape[1] * LORA_INT8_RANK_ROWS
    return (jnp.dtype(x.dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)) and a.dtype == jnp.int8
            and b.dtype == jnp.int8 and a.shape[2] == -(-x.shape[1] // 4) and r > 0 and b.shape[1] % (16 * r) == 0)


def lora_int8(x: jax.Array, slots: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array,
              ranks: jax.Array) -> jax.Array:
    """Pure. `lora` on int8 stacks (native/lora.h "int8 adapter stacks"): [T, N] in x's dtype, (x[t] @ Aq^T * scale)
    @ Bq for slot s = slots[t] up to rank ranks[s]; a [S, R/32, Kq, 32, 4], b [S, R * N] int8, scale [S, R]
    float32."""
    return lora_int8_parts(x, slots, [(a, b, scale, ranks)])[0]


def lora_int8_parts(x: jax.Array, slots: jax.Array, parts) -> list[jax.Array]:
    """Pure. `lora_int8` for 1 to 4 projections of one x at once (q|k|v, gate|up: x's rows gathered and quantized
    once, each slot's parts in one unit of work): `parts` a sequence of (a, b, scale, ranks) with one S and R; one
    [T, N] output per part."""
    _require()
    if not 1 <= len(parts) <= 4:
        raise ValueError(f"lora_int8_parts takes 1 to 4 parts, not {len(parts)}")
    outs = [(x.shape[0], b.shape[1] // (a.shape[1] * LORA_INT8_RANK_ROWS)) for a, b, _, _ in parts]
    call = jax.ffi.ffi_call(_LORA_INT8, [jax.ShapeDtypeStruct(shape, x.dtype) for shape in outs])
    operands = [x, jnp.asarray(slots, jnp.int32)]
    for a, b, scale, ranks in parts:
        operands += [a, b, jnp.asarray(scale, jnp.float32), jnp.asarray(ranks, jnp.int32)]
    return list(call(*operands, isa=_isa_attr()))
