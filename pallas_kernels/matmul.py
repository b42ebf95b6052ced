"""The model's `matmul` (native CPU kernels where they take it, else XLA) and their weight plumbing: `dense_weight`,
`pack_groups` (dense weights repacked into panels, fused where they read the same input) and the LM head's int8
screen for greedy steps (`head_screen`, `screened_greedy`). Details: docs/native-kernels.md."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels import native


def matmul(x: jax.Array, w: jax.Array, out_dtype=None, scale=None) -> jax.Array:
    """Pure. `x[..., K] @ w[K, N]` accumulated in float32, returned in `out_dtype` (default x's). On CPU the
    native kernel runs it where it can; otherwise XLA, asked for bf16 x bf16 -> f32 (its fast AMX/YNNPACK path,
    ~4x faster than its bf16 -> bf16 dot). A quantized `w` (models.quant) comes with its `scale`: [N] per column or
    [G, N] per group of K rows."""
    out_dtype = out_dtype or x.dtype
    if scale is not None:
        return _quantized_matmul(x, w, scale, out_dtype)
    if native.is_packed(w):  # panels packed at load (`pack_groups`)
        if native.packed_supported(x, w, out_dtype):
            return native.matmul_packed(x, w, out_dtype)
        w = native.unpack_weight(w, x.shape[-1])
    if native.matmul_supported(x, w, out_dtype):
        return native.matmul(x, w, out_dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype)


def _quantized_matmul(x, w, scale, out_dtype):
    """XLA: the weight converted to x's dtype inside the dot, the scales applied to the float32 accumulator."""
    k, n = w.shape
    wx = w.astype(x.dtype)
    if scale.ndim == 1:
        y = jnp.dot(x, wx, preferred_element_type=jnp.float32) * scale
    else:
        g = scale.shape[0]
        if k % g:
            raise ValueError(f"group-wise scales [{g}, {n}] need K ({k}) a multiple of the {g} groups")
        parts = jnp.einsum("...gr,grn->...gn", x.reshape(x.shape[:-1] + (g, k // g)), wx.reshape(g, k // g, n),
                           preferred_element_type=jnp.float32)
        y = jnp.sum(parts * scale, axis=-2)
    return y.astype(out_dtype)


def dense_weight(param: nnx.Param, rows: int) -> jax.Array:
    """A matmul weight as `matmul` takes it: [rows, -1], or its packed panels as they are."""
    w = param[...]
    return w if native.is_packed(w) else w.reshape(rows, -1)


def pack_groups(groups) -> int:
    """Repacks dense matmul weights into the native kernels' panel layout, in place, and returns how many packed
    matrices there are now. `groups`: (owner module, fused attribute or None, [parameter names], rows K) per set of
    weights that read the same input; a group with a fused attribute whose concatenation packs becomes one matrix
    there (its parts set to None: fewer, larger kernel calls, each with a fixed cost), else each part that packs is
    packed alone. Weights already packed, missing, or whose N is not whole panels stay as they are."""
    todo = []  # (owner, attribute to set, names it replaces, [K, N_i] blocks packed as one)
    for owner, fused, names, rows in groups:
        ws = [getattr(owner, n) for n in names]
        if any(w is None or native.is_packed(w[...]) for w in ws):
            continue
        mats = [w[...].reshape(rows, -1) for w in ws]
        whole = jax.ShapeDtypeStruct((rows, sum(m.shape[1] for m in mats)), mats[0].dtype)
        if fused and native.can_pack(whole):
            todo.append((owner, fused, names, mats))
            continue
        todo += [(owner, n, [n], [m]) for n, m in zip(names, mats) if native.can_pack(m)]
    for (owner, attr, names, _), packed in zip(todo, native.pack_weights([w for *_, w in todo])):
        for n in names:
            if n != attr:
                setattr(owner, n, None)
        if attr in names:
            getattr(owner, attr).set_value(packed)
        else:
            setattr(owner, attr, nnx.Param(packed))
    return len(todo)


# ---------------------------------------------------------------------------------------------------------
# The LM head's int8 screen, for greedy steps.

class HeadScreen(nnx.Variable):
    """The int8 screen of the LM head for greedy steps (`head_screen`); not a parameter: serving-only."""


# Most logits rows a step may have for the screened greedy head: from ~4 rows the int8 pass costs about what the
# full-precision head read does (it converts and multiplies per row), so wider steps use the plain head.
SCREEN_MAX_ROWS = 4


def head_screen_bytes(vocab_size: int, hidden_size: int) -> int:
    """Memory the LM head's int8 screen takes: q [vocab, hidden rounded up to 64] int8 and two float32 per
    vocabulary row."""
    return vocab_size * (native.screen_width(hidden_size) + 8)


def head_screen(head: jax.Array, tied: bool) -> tuple[HeadScreen, HeadScreen] | None:
    """The int8 screen (q, bounds) of an LM head as loaded (`native.greedy_head_screen`): [V, E] when `tied` (the
    embedding table), else [E, V]; None where the kernels or the head's dtype cannot take it. A greedy step then
    reads a quarter (bf16) or an eighth (f32) of the head's bytes and gets the same tokens. Build it before
    packing: it reads the head as loaded."""
    if not native.enabled() or jnp.dtype(head.dtype) not in native.PANELS or native.is_packed(head):
        return None
    # [N, K]: the tied table as it is, an untied [K, N] head as a transposed view (converted a block of rows at a
    # time by the screen)
    head_nk = np.asarray(head) if tied else np.asarray(head).T
    q, bounds = native.greedy_head_screen(head_nk)
    return HeadScreen(jnp.asarray(q)), HeadScreen(jnp.asarray(bounds))


def screened_greedy(hidden: jax.Array, screen, bounds, head: jax.Array, tied: bool,
                    num_rows: jax.Array) -> jax.Array | None:
    """Pure. int32 [N]: the argmax of each row's logits (lowest id on ties) for the first `num_rows[0]` rows of
    hidden states [N, E] (the rest 0), from the head's int8 screen; None where it cannot run (more than
    SCREEN_MAX_ROWS rows, or the native kernels unavailable in this trace)."""
    if hidden.shape[0] > SCREEN_MAX_ROWS:
        return None
    layout = "nk" if tied else "packed" if native.is_packed(head) else "kn"
    if not native.greedy_head_supported(hidden, head):
        return None
    tokens, _ = native.greedy_head(hidden, screen, bounds, head, num_rows, layout=layout)
    return tokens
