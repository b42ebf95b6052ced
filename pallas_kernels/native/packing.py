"""The host-side layouts the native CPU kernels read: packed weight panels (`pack_weight`, `pack_weights` into one
huge-page buffer, and back: `unpack_weight`, `unpack_experts`) and the LM head's int8 screen (`greedy_head_screen`)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

PANELS = {jnp.dtype(jnp.float32): 32, jnp.dtype(jnp.bfloat16): 64}  # columns per packed float weight panel
BF16_K_ALIGN = 32  # packed bfloat16 weights pad K to a multiple of this (one AMX tile step)
# Packed layouts per weight dtype: (columns per panel, K rows side by side per column, K padded to a multiple of).
_PACKED = {jnp.dtype(jnp.float32): (32, 1, 1), jnp.dtype(jnp.bfloat16): (64, 2, BF16_K_ALIGN),
           jnp.dtype(jnp.int8): (64, 4, 4)}

# ---------------------------------------------------------------------------------------------------------
# Packed weights: a [K, N] weight stored as panels of P columns, each contiguous down K, so the kernel streams
# every panel front to back (the row-major weight is read as K separate row streams, which the hardware
# prefetchers follow poorly: ~8-15 GB/s against ~20-24 GB/s here). float32: [N/32, K, 32, 1] (32 columns: a
# register tile then holds 14 rows); bfloat16: [N/64, Kp/2, 64, 2] with K zero-padded to Kp (a multiple of 32)
# and rows k, k+1 of each column side by side (the pair layout vdpbf16ps and AMX B tiles read); int8: [N/64, Kp/4,
# 64, 4], K zero-padded to a multiple of 4 and rows k..k+3 side by side (the quads vpdpbusd and sdot read). Same
# bytes as the weight (plus the K padding). A stack of weights [S, K, N] (a MoE layer's experts, one per slot) packs
# slot by slot: [S, N/P, Kp/step, P, step].


def _padded_k(k: int, dtype) -> int:
    align = _PACKED[jnp.dtype(dtype)][2]
    return -(-k // align) * align


def can_pack(w) -> bool:
    """Whether `pack_weight` takes this [K, N] weight (or [S, K, N] stack)."""
    layout = _PACKED.get(jnp.dtype(w.dtype))
    return (layout is not None and w.ndim in (2, 3) and min(w.shape) > 0 and w.shape[-1] % layout[0] == 0)


def _panels(w, xp):
    """The packed layout of [..., K, N] `w` with array module `xp` (jax.numpy on device, NumPy on the host)."""
    *lead, k, n = w.shape
    panel, step, _ = _PACKED[jnp.dtype(w.dtype)]
    kp = _padded_k(k, w.dtype)
    if kp != k:
        w = xp.pad(w, [(0, 0)] * len(lead) + [(0, kp - k), (0, 0)])
    b = len(lead)
    return w.reshape(*lead, kp // step, step, n // panel, panel).transpose(*range(b), b + 2, b, b + 3, b + 1)


def pack_weight(w: jax.Array) -> jax.Array:
    """Pure. The packed layout of a [K, N] weight or [S, K, N] stack (see above); `can_pack(w)` must hold."""
    return _panels(w, jnp)


def packed_host(w: np.ndarray) -> np.ndarray:
    """`pack_weight` in NumPy, on the host (a strided view where no padding is needed; copy it where it should
    live)."""
    return _panels(w, np)


_ARENA_ALIGN = 4096


def huge_page_buffer(nbytes: int):
    """An anonymous, zeroed host buffer (an mmap) advised for transparent huge pages (where the kernel has them
    off, ordinary pages: same contents, slower streams)."""
    import mmap

    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return buf


def pack_weights(weights: list) -> list[jax.Array]:
    """Packs [K, N] weights into one host buffer backed by transparent huge pages where the kernel grants them,
    and returns CPU arrays aliasing it (device_put of an aligned NumPy array is zero-copy on the CPU), each on
    its weight's device. An entry may be a list of [K, N_i] blocks, packed as their concatenation along N (fused
    projections); each packed matrix must pass `can_pack`. One matrix at a time is materialised on the host, so
    packing needs the buffer plus the largest matrix beyond the weights themselves. With 4 KiB pages a weight
    stream crosses a page every 4 KiB and one core read ~11 GB/s here; with 2 MiB pages ~14.5 GB/s. The arrays
    keep the buffer alive."""
    entries = [w if isinstance(w, (list, tuple)) else [w] for w in weights]
    shapes = []
    for blocks in entries:
        *lead, k = blocks[0].shape[:-1]
        dt = jnp.dtype(blocks[0].dtype)
        n = sum(b.shape[-1] for b in blocks)
        if any(b.shape[:-1] != blocks[0].shape[:-1] or jnp.dtype(b.dtype) != dt for b in blocks) or not can_pack(
                jax.ShapeDtypeStruct((*lead, k, n), dt)):
            raise ValueError(f"cannot pack blocks of shapes {[b.shape for b in blocks]} ({dt})")
        panel, step, _ = _PACKED[dt]
        shapes.append((*lead, n // panel, _padded_k(k, dt) // step, panel, step, dt))
    offsets, total = [], 0
    for *shape, dt in shapes:
        offsets.append(total)
        total += -(-math.prod(shape) * dt.itemsize // _ARENA_ALIGN) * _ARENA_ALIGN
    if total == 0:
        return []
    arena = huge_page_buffer(total)
    out = []
    for blocks, (*shape, dt), off in zip(entries, shapes, offsets):
        host = [np.asarray(b) for b in blocks]
        view = np.frombuffer(arena, dtype=dt, count=math.prod(shape), offset=off).reshape(shape)
        view[...] = packed_host(host[0] if len(host) == 1 else np.concatenate(host, axis=-1))
        view.flags.writeable = False
        w = blocks[0]
        device = next(iter(w.devices())) if isinstance(w, jax.Array) else jax.devices("cpu")[0]
        out.append(jax.device_put(view, device))
    return out


def is_packed(w) -> bool:
    """Whether `w` is a weight in the packed layout of its dtype (a 4-D array of another layout or dtype is not)."""
    if getattr(w, "ndim", 0) != 4:
        return False
    layout = _PACKED.get(jnp.dtype(w.dtype))
    return layout is not None and tuple(w.shape[2:]) == layout[:2]


def packed_shape(w, k: int) -> tuple[int, int]:
    """The logical [K, N] of packed `w` for inputs with `k` columns (checked against its padded K)."""
    kw = w.shape[1] * w.shape[3]
    expected = _padded_k(k, w.dtype)
    if kw != expected:
        raise ValueError(f"packed weight holds {kw} rows of K, inputs have {k} columns")
    return k, w.shape[0] * w.shape[2]


def is_packed_experts(w) -> bool:
    """Whether `w` is a stack of weights [S, K, N] packed slot by slot ([S, N/P, Kp/step, P, step], float32,
    bfloat16 or int8: the expert kernel's packed layouts)."""
    if getattr(w, "ndim", 0) != 5:
        return False
    layout = _PACKED.get(jnp.dtype(w.dtype))
    return layout is not None and tuple(w.shape[3:]) == layout[:2]


def unpack_experts(w: jax.Array, k: int) -> jax.Array:
    """Pure. The [S, K, N] stack back from its packed layout (an XLA copy: the fallback paths only)."""
    s, panels, rows, panel, step = w.shape
    if rows * step != _padded_k(k, w.dtype):
        raise ValueError(f"packed experts hold {rows * step} rows of K, inputs have {k} columns")
    return w.transpose(0, 2, 4, 1, 3).reshape(s, rows * step, panels * panel)[:, :k]


def unpack_weight(w: jax.Array, k: int) -> jax.Array:
    """Pure. The [K, N] weight back from its packed layout (an XLA copy: the fallback path only)."""
    _, n = packed_shape(w, k)
    full = w.transpose(1, 3, 0, 2).reshape(w.shape[1] * w.shape[3], n)
    return full[:k]


# ---------------------------------------------------------------------------------------------------------
# Greedy LM head by screening (native/greedy_head.h): the argmax of the exact logits from
# a read of an int8 copy of the head plus the full-precision columns of the few rows its error bounds cannot
# rule out.
SCREEN_K_ALIGN = 64  # the int8 copy pads K to a multiple of this


def screen_width(k: int) -> int:
    """Columns of the int8 screen of a head with K = `k`: K rounded up to SCREEN_K_ALIGN."""
    return -(-k // SCREEN_K_ALIGN) * SCREEN_K_ALIGN


def greedy_head_screen(head_nk: np.ndarray, block: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """Host-side. The int8 screen of an LM head given as [N, K] (vocabulary rows): q [N, Kq] (K rounded up to
    SCREEN_K_ALIGN, zero-padded) and bounds [2, N] float32: each row's scale s_j (row j ~ s_j q_j) and c_j, an
    upper bound on |x.w_j - s_j fl32(x.q_j)| / ||x|| for any x: the quantisation error's norm plus float32
    rounding of the kernel's accumulation over Kq terms and the scaling (gamma_{Kq+2} ||s_j q_j||), rounded up."""
    n, k = head_nk.shape
    kq = screen_width(k)
    q = np.zeros((n, kq), np.int8)
    bounds = np.zeros((2, n), np.float32)
    u = 2.0 ** -24
    gamma = (kq + 2) * u / (1 - (kq + 2) * u)
    for j0 in range(0, n, block):
        w = np.asarray(head_nk[j0:j0 + block], np.float64)
        scale = (np.abs(w).max(axis=1) / 127).astype(np.float32)
        scale = np.where(scale > 0, scale, np.float32(1))
        s = scale.astype(np.float64)[:, None]
        qi = np.clip(np.rint(w / s), -127, 127)
        approx = qi * s  # exact in float64 (8-bit x 24-bit products)
        c = (np.linalg.norm(w - approx, axis=1) + gamma * np.linalg.norm(approx, axis=1)) * (1 + 1e-6)
        c32 = c.astype(np.float32)
        c32 = np.where(c32.astype(np.float64) < c, np.nextafter(c32, np.float32(np.inf)), c32)
        q[j0:j0 + len(w), :k] = qi.astype(np.int8)
        bounds[0, j0:j0 + len(w)] = scale
        bounds[1, j0:j0 + len(w)] = c32
    return q, bounds
