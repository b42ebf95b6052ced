"""The batched LoRA update of a ragged batch behind one entry point, `lora_delta`: per token t, (x[t] @ a[s]^T) @ b[s]
for its adapter slot s = slots[t] (nothing where s < 0: the base model), each slot's rank read up to its own rank;
A is stored transposed ([slots, rank, K]: an adapter's first r rows are all its update reads, contiguous).
Backends: 'gather' (a few tokens: each token's adapter gathered), 'loop' (XLA:CPU: per slot some token uses, every
row masked), 'ragged_dot' (tokens sorted by slot through XLA's grouped matmul: accelerators), and on single-device
CPU the native kernel where it runs ('native'). MESHSERVE_LORA_KERNEL forces one (comparisons, tests). Details:
docs/lora.md."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native
from pallas_kernels.names import LORA_BLOCK_COLUMNS as BLOCK_COLUMNS
from pallas_kernels.names import LORA_BLOCK_ROWS as BLOCK_ROWS
from pallas_kernels.names import LORA_INT8_RANK_ROWS as INT8_RANK_ROWS
from pallas_kernels.names import LORA_INT8_STRIP as INT8_STRIP
from pallas_kernels.names import LORA_LAYOUTS
from pallas_kernels.names import LORA_STRIP as STRIP
from pallas_kernels.target import target_platform

LORA_ENV_VAR = "MESHSERVE_LORA_KERNEL"  # auto (default) | native | gather | loop | ragged_dot
BACKENDS = ("native", "gather", "loop", "ragged_dot")
# Up to this many tokens the XLA paths gather each token's A and B (they read T adapters' worth, not all slots):
# a decode step of a few sequences.
GATHER_MAX_TOKENS = 4
# A stack's forms (`to_layout`).
ROWS, PAIRS, BLOCKS, STRIPS = LORA_LAYOUTS
# A in pairs and B in strips need K and N multiples of this: whole vectors of every native path's width.
PAIR_COLUMNS = 16


def stack_layouts(dtype, rank: int, k: int, n: int) -> tuple[str, str]:
    """Trace-time (the native path in use). How the native kernel reads A [rank, k] and B [rank, n] stacks of `dtype`
    (`to_layout`'s forms; native/lora.h): bfloat16 B in strips where rank is even and n a multiple of PAIR_COLUMNS; A in
    blocks on a path with a pair dot product (avx512_bf16, amx, neon_bf16; rank a multiple of BLOCK_ROWS, k of
    BLOCK_COLUMNS), in pairs on one that widens bfloat16 (B in strips, k a multiple of PAIR_COLUMNS); else rows."""
    bf16 = jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)
    b = STRIPS if bf16 and rank % 2 == 0 and n % PAIR_COLUMNS == 0 else ROWS
    if native.pair_dot(native.isa()):
        return (BLOCKS if bf16 and rank % BLOCK_ROWS == 0 and k % BLOCK_COLUMNS == 0 else ROWS), b
    return (PAIRS if b == STRIPS and k % PAIR_COLUMNS == 0 else ROWS), b


def _strips(w, group: int, width: int):
    """w [..., R, C] (numpy stays numpy) as [..., R * C]: strips of `width` columns (the last as narrow as C leaves
    it), each strip's rows in groups of `group` (rows g..g + group - 1 of a column side by side), the strips one after
    another. The pairs (one strip, groups of 2), the strips (2) and int8 B's quads (4) of `to_layout` and
    `quantize_adapter`."""
    *lead, r, c = w.shape
    strips = [w[..., c0:c0 + width].reshape(*lead, r // group, group, -1).swapaxes(-1, -2).reshape(*lead, -1)
              for c0 in range(0, c, width)]
    return (np.concatenate if isinstance(w, np.ndarray) else jnp.concatenate)(strips, -1)


def _from_strips(flat, r: int, c: int, group: int, width: int):
    """The inverse of `_strips`: flat [..., R * C] as [..., R, C] row-major."""
    *lead, _ = flat.shape
    strips = [flat[..., c0 * r:(c0 + min(width, c - c0)) * r].reshape(*lead, r // group, -1, group).swapaxes(-1, -2)
              .reshape(*lead, r, -1) for c0 in range(0, c, width)]
    return (np.concatenate if isinstance(flat, np.ndarray) else jnp.concatenate)(strips, -1)


def to_layout(w, layout: str):
    """A stack's [..., R, C] (numpy or jax; A: C = K, B: C = N) in one of the native kernel's forms, same shape
    (native/lora.h; `from_layout` undoes it). Element (j, c) of a slot's [R, C] goes to flat
      rows:   j C + c;
      pairs:  (j // 2) 2C + 2c + j % 2 (rows 2i and 2i + 1 side by side along C);
      blocks: (j // 4) 4C + (c // 32) 128 + (j % 4) 32 + c % 32 (blocks of BLOCK_ROWS rows, chunks of BLOCK_COLUMNS
              columns of each side by side);
      strips: c0 R + (j // 2) 2w + 2 (c - c0) + j % 2 for the strip [c0, c0 + w) holding c (strips of STRIP
              columns, the last as narrow as C leaves it; each strip's rows in pairs).
    A rank-r adapter's first r rows stay one contiguous run in rows, pairs and blocks (up to a pair or block)."""
    if layout == ROWS:
        return w
    *lead, r, c = w.shape
    nd = len(lead)
    if layout in (PAIRS, STRIPS):  # (pairs: one strip as wide as C)
        return _strips(w, 2, c if layout == PAIRS else STRIP).reshape(*lead, r, c)
    if layout == BLOCKS:
        return w.reshape(*lead, r // BLOCK_ROWS, BLOCK_ROWS, c // BLOCK_COLUMNS, BLOCK_COLUMNS).transpose(
            *range(nd), nd, nd + 2, nd + 1, nd + 3).reshape(*lead, r, c)
    raise ValueError(f"unknown LoRA stack layout {layout!r}: expected one of {', '.join(LORA_LAYOUTS)}")


def from_layout(w, layout: str):
    """Pure. The inverse of `to_layout`: [..., R, C] row-major again."""
    if layout == ROWS:
        return w
    *lead, r, c = w.shape
    nd = len(lead)
    if layout in (PAIRS, STRIPS):
        return _from_strips(w.reshape(*lead, r * c), r, c, 2, c if layout == PAIRS else STRIP)
    if layout == BLOCKS:
        return w.reshape(*lead, r // BLOCK_ROWS, c // BLOCK_COLUMNS, BLOCK_ROWS, BLOCK_COLUMNS).transpose(
            *range(nd), nd, nd + 2, nd + 1, nd + 3).reshape(*lead, r, c)
    raise ValueError(f"unknown LoRA stack layout {layout!r}: expected one of {', '.join(LORA_LAYOUTS)}")


def _forced_backend() -> str:
    """Trace-time. MESHSERVE_LORA_KERNEL, checked: "" or "auto" (the automatic choice), or one of BACKENDS."""
    choice = os.environ.get(LORA_ENV_VAR, "auto").strip().lower()
    if choice not in ("", "auto", *BACKENDS):
        raise ValueError(f"{LORA_ENV_VAR}={choice!r}: expected auto or one of {', '.join(BACKENDS)}")
    return choice


def lora_backend(x: jax.Array, a: jax.Array, b: jax.Array) -> str:
    """Trace-time. Which backend `lora_delta` takes for x [T, K], a [S, R, K], b [S, R, N] here."""
    choice = _forced_backend()
    if choice == "native" and not native.lora_supported(x, a, b):
        choice = "auto"  # (under a mesh, or a dtype the kernel does not take: the automatic choice)
    if choice in BACKENDS:
        return choice
    if native.lora_supported(x, a, b):
        return "native"
    if x.shape[0] <= GATHER_MAX_TOKENS:
        return "gather"
    return "loop" if target_platform() == "cpu" else "ragged_dot"


def lora_delta(x: jax.Array, slots: jax.Array, a: jax.Array, b: jax.Array, ranks: jax.Array,
               a_layout: str = ROWS, b_layout: str = ROWS) -> jax.Array:
    """Pure. [T, N] in x's dtype: (x[t] @ a[slots[t]]^T) @ b[slots[t]] per token, 0 where slots[t] < 0; x [T, K],
    slots [T] int32, a [S, R, K], b [S, R, N] in x's dtype (rows past a slot's rank are zero; `a_layout`, `b_layout`:
    each slot's A, B in that `to_layout` form, which the native kernel reads as it is and the XLA paths undo first),
    ranks [S] int32 (each slot's rank: the native kernel reads no further; 0: the slot holds nothing for this
    projection). Accumulated in float32."""
    backend = lora_backend(x, a, b)
    if backend == "native":
        return native.lora(x, slots, a, b, ranks, a_layout=a_layout, b_layout=b_layout)
    return _xla_delta(backend, x, slots, from_layout(a, a_layout), from_layout(b, b_layout))


def lora_delta_parts(x: jax.Array, slots: jax.Array, parts, a_layout: str = ROWS, b_layout: str = ROWS
                     ) -> list[jax.Array]:
    """Pure. `lora_delta` of several projections of one x (`parts`: (a, b, ranks) each, one S and R, all in the layouts
    given; q|k|v, gate|up): one native call for all of them where it runs (x's rows gathered once, each slot's parts
    read in one unit of work), else each part as `lora_delta`. One [T, N] update per part."""
    if all(lora_backend(x, a, b) == "native" for a, b, _ in parts):
        return native.lora_parts(x, slots, parts, a_layout, b_layout)
    return [lora_delta(x, slots, a, b, ranks, a_layout, b_layout) for a, b, ranks in parts]


def _xla_delta(backend: str, x, slots, a, b):
    """Pure. `lora_delta` on an XLA backend, A and B row-major."""
    if backend == "gather":
        return gathered_lora(x, slots, a, b)
    if backend == "loop":
        return looped_lora(x, slots, a, b)
    return ragged_lora(x, slots, a, b)


def _dot(x, w):
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def _dot_t(x, a):
    """x [T, K] @ a [R, K]^T, accumulated in float32 (XLA's dot takes the transposed operand as it is)."""
    return jax.lax.dot_general(x, a, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def gathered_lora(x, slots, a, b):
    """Pure. `lora_delta` reading each token's own A and B (gathered: T adapters' worth of weights)."""
    used = slots >= 0
    idx = jnp.where(used, slots, 0)
    f32 = jnp.float32
    xa = jnp.einsum("tk,trk->tr", x.astype(f32), a[idx].astype(f32))
    xa = jnp.where(used[:, None], xa, 0)
    return jnp.einsum("tr,trn->tn", xa, b[idx].astype(f32)).astype(x.dtype)


def looped_lora(x, slots, a, b):
    """Pure. `lora_delta` as a loop over the slots, each one some token uses applied to every row (rows of other
    slots masked to 0 between A and B), the others skipped: each used adapter read once; 2-D dots of x's dtype
    accumulated in float32 (XLA:CPU's fast path). The rows cost (slots used) x T."""
    n = a.shape[0]
    present = jnp.zeros((n + 1,), jnp.bool_).at[jnp.where(slots >= 0, slots, n)].set(True)[:n]

    def apply(s, y):
        xa = jnp.where((slots == s)[:, None], _dot_t(x, jax.lax.dynamic_index_in_dim(a, s, keepdims=False)), 0)
        return y + _dot(xa.astype(x.dtype), jax.lax.dynamic_index_in_dim(b, s, keepdims=False))

    def body(s, y):
        return jax.lax.cond(present[s], apply, lambda s, y: y, s, y)

    y = jax.lax.fori_loop(0, n, body, jnp.zeros((x.shape[0], b.shape[2]), jnp.float32))
    return y.astype(x.dtype)


def ragged_lora(x, slots, a, b):
    """Pure. `lora_delta` with XLA's `ragged_dot`: tokens sorted by slot (those of none last, in no group), A then B
    as grouped matmuls, scattered back."""
    n = a.shape[0]
    key = jnp.where(slots >= 0, slots, n)
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.zeros((n + 1,), jnp.int32).at[key].add(1)[:n]
    # A [S, R, K] contracted over its last axis (no transposed copy of the stack)
    a_dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                               lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))
    xa = jax.lax.ragged_dot_general(x[order], a, group_sizes, a_dims, preferred_element_type=jnp.float32)
    out = jax.lax.ragged_dot(xa.astype(x.dtype), b, group_sizes, preferred_element_type=jnp.float32)
    out = jnp.where((key[order] < n)[:, None], out, 0)  # rows in no group: not defined by ragged_dot
    return jnp.zeros(out.shape, jnp.float32).at[order].set(out).astype(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# int8 adapter stacks (EngineConfig.lora_dtype = "int8"): half the bytes of bfloat16. Each slot's A and B rows
# quantized per rank row, symmetric, the two scales multiplied into one per rank row (native/lora.h "int8 adapter
# stacks" has the layouts). Slots are rank rows in multiples of INT8_RANK_ROWS, N a multiple of PAIR_COLUMNS.


def int8_fits(rank: int, n: int) -> bool:
    """Whether stacks of `rank` rank rows per slot and `n` output columns can be held in int8."""
    return rank % INT8_RANK_ROWS == 0 and n % PAIR_COLUMNS == 0


def quantize_adapter(a, b):
    """NumPy. A [..., R, K] and B [..., R, N] (float, B with its scaling) as (aq [..., R/32, Kq, 32, 4] int8,
    bq [..., R * N] int8, scale [..., R] float32): A's and B's rank rows each scaled to [-127, 127] by their largest
    |value| (a zero row: scale 0), y = ((x @ dequant(aq)^T) * scale) @ dequant(bq) up to rounding. aq: blocks of 32
    rank rows, rows k..k+3 of each rank side by side (K zero-padded to Kq quads); bq: B in strips of 64 columns (the
    last one as narrow as N leaves it), each strip's rank rows in quads, rows r..r+3 of each column side by side
    (native/lora.h "int8 adapter stacks")."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    *lead, r, k = a.shape
    sa, sb = np.abs(a).max(-1) / 127, np.abs(b).max(-1) / 127
    aq = np.rint(a / np.where(sa > 0, sa, 1)[..., None]).astype(np.int8)
    bq = np.rint(b / np.where(sb > 0, sb, 1)[..., None]).astype(np.int8)
    kq = -(-k // 4)
    aq = np.pad(aq, [(0, 0)] * len(lead) + [(0, 0), (0, 4 * kq - k)])
    aq = aq.reshape(*lead, r // INT8_RANK_ROWS, INT8_RANK_ROWS, kq, 4)
    nd = len(lead)
    aq = aq.transpose(*range(nd), nd, nd + 2, nd + 1, nd + 3)
    return np.ascontiguousarray(aq), _strips(bq, 4, INT8_STRIP), (sa * sb).astype(np.float32)


def dequantize_adapter(aq, bq, scale, k: int):
    """Pure. `quantize_adapter`'s stacks as float32 A [..., R, K] (with the scale) and B [..., R, N]."""
    *lead, rb, kq, _, _ = aq.shape
    nd = len(lead)
    a = aq.transpose(*range(nd), nd, nd + 2, nd + 1, nd + 3).reshape(*lead, rb * INT8_RANK_ROWS, 4 * kq)[..., :k]
    r = rb * INT8_RANK_ROWS
    b = _from_strips(bq, r, bq.shape[-1] // r, 4, INT8_STRIP)
    return a.astype(jnp.float32) * scale[..., None], b.astype(jnp.float32)


def lora_delta_int8(x: jax.Array, slots: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array,
                    ranks: jax.Array) -> jax.Array:
    """Pure. `lora_delta` on int8 stacks (`quantize_adapter`): the native kernel where it runs (x and x @ A^T then
    quantized per token to int8 where the CPU has int8 dot products), else the stacks dequantized to x's dtype and an
    XLA backend (as `lora_delta` picks it). Rows past a slot's rank must be zero."""
    return lora_delta_int8_parts(x, slots, [(a, b, scale, ranks)])[0]


def lora_delta_int8_parts(x: jax.Array, slots: jax.Array, parts) -> list[jax.Array]:
    """Pure. `lora_delta_int8` of several projections of one x (`parts`: (a, b, scale, ranks) each, one S and R; q|k|v,
    gate|up): one native call for all of them where it runs (x's rows gathered and quantized once, each slot's parts
    read in one unit of work), else each part as `lora_delta_int8`'s fallback. One [T, N] update per part."""
    if _forced_backend() in ("", "auto", "native") and all(native.lora_int8_supported(x, a, b) for a, b, _, _ in parts):
        return native.lora_int8_parts(x, slots, parts)
    out = []
    for a, b, scale, ranks in parts:
        af, bf = dequantize_adapter(a, b, scale, x.shape[1])
        out.append(lora_delta(x, slots, af.astype(x.dtype), bf.astype(x.dtype), ranks))
    return out
