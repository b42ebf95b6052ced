"""The model's `matmul` (native CPU kernels where they take it, else XLA; quantized weights with their scales) and
their weight plumbing: `dense_weight`, `pack_groups` (dense weights repacked into panels, fused where they read the
same input, with their scales) and the LM head's int8 screen for greedy steps (`head_screen`, `screened_greedy`).
`pack_experts` does the same for MoE experts, slot by slot. Details: docs/native-kernels.md."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels import native
from pallas_kernels.target import target_platform


def matmul(x: jax.Array, w: jax.Array, out_dtype=None, scale: jax.Array | None = None) -> jax.Array:
    """Pure. `x[..., K] @ w[K, N]` accumulated in float32, returned in `out_dtype` (default x's). On CPU the
    native kernel runs it where it can; otherwise XLA, asked for bf16 x bf16 -> f32 (its fast AMX/YNNPACK path,
    ~4x faster than its bf16 -> bf16 dot). With `scale` (float32), `w` is quantized (int8 or float8_e4m3fn, [K, N]
    or packed) and the product is `x @ (w * scale)`: `scale` per column (N values, e.g. [N] or the weight's output
    dims) or per group of K/G rows along K (G x N values, G leading: [G, N] or (G,) + output dims)."""
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


def _quantized_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, out_dtype) -> jax.Array:
    """`matmul` with a scale: native where it runs, else XLA's dot on the weight converted to x's dtype (a convert
    that GPU and TPU compilers fuse into the dot's operand read: tests/pallas_kernels/test_quant_matmul.py checks
    the program they are given), the scales applied to the float32 products."""
    if native.matmul_int8_supported(x, w, scale, out_dtype):
        return native.matmul_int8(x, w, scale, out_dtype)
    k = x.shape[-1]
    if native.is_packed(w):
        w = native.unpack_weight(w, k)
    n = w.shape[1]
    groups = native.scale_groups(scale, n)
    scale = scale.reshape(groups, n).astype(jnp.float32)
    if groups == 1:
        out = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32) * scale[0]
    elif k % groups:
        raise ValueError(f"scale has {groups} groups along K = {k}: groups must divide K")
    else:  # per group: [..., G, N] partial products, scaled, summed over G
        # (XLA:CPU has no batched bf16 x bf16 -> f32 dot: float32 there)
        dt = jnp.float32 if target_platform() == "cpu" else x.dtype
        blocks = w.reshape(groups, k // groups, n).astype(dt)
        partial = jnp.einsum("...gk,gkn->...gn", x.reshape(*x.shape[:-1], groups, k // groups).astype(dt), blocks,
                             preferred_element_type=jnp.float32)
        out = (partial * scale).sum(axis=-2)
    return out.astype(out_dtype)


def dense_weight(param: nnx.Param, rows: int) -> jax.Array:
    """A matmul weight as `matmul` takes it: [rows, -1], or its packed panels as they are."""
    w = param[...]
    return w if native.is_packed(w) else w.reshape(rows, -1)


SCALE_SUFFIX = "_scale"  # a quantized weight `<name>`'s scales live in the sibling parameter `<name>_scale`


def _fused_scale(scales: list, widths: list[int]) -> jax.Array | None:
    """The scales of weights fused along N, concatenated: [N] (per column) or [G, N] (per group); None where the
    parts' groups differ."""
    groups = [native.scale_groups(s, n) for s, n in zip(scales, widths)]
    if len(set(groups)) != 1:
        return None
    parts = [jnp.asarray(s, jnp.float32).reshape(groups[0], n) for s, n in zip(scales, widths)]
    fused = jnp.concatenate(parts, axis=1)
    return fused[0] if groups[0] == 1 else fused


def pack_groups(groups) -> int:
    """Repacks dense matmul weights into the native kernels' panel layout, in place, and returns how many packed
    matrices there are now. `groups`: (owner module, fused attribute or None, [parameter names], rows K) per set of
    weights that read the same input; a group with a fused attribute whose concatenation packs becomes one matrix
    there (its parts set to None: fewer, larger kernel calls, each with a fixed cost), else each part that packs is
    packed alone. Quantized weights (int8, with `<name>_scale` siblings) fuse with their scales: those concatenate
    along N into `<fused>_scale` ([N], or [G, N] per group; parts whose groups differ are packed alone), the
    parts' scales set to None; a weight packed alone keeps its scale. Weights already packed, missing, or whose N
    is not whole panels stay as they are."""
    todo = []  # (owner, attribute to set, names it replaces, [K, N_i] blocks packed as one, fused scale or None)
    for owner, fused, names, rows in groups:
        ws = [getattr(owner, n) for n in names]
        if any(w is None or native.is_packed(w[...]) for w in ws):
            continue
        mats = [w[...].reshape(rows, -1) for w in ws]
        scales = [getattr(owner, n + SCALE_SUFFIX, None) for n in names]
        quantized = [s is not None for s in scales]
        if any(quantized) and not all(quantized):
            continue  # a group's parts are quantized alike, or not touched
        whole = jax.ShapeDtypeStruct((rows, sum(m.shape[1] for m in mats)), mats[0].dtype)
        scale = None
        if fused and all(quantized):
            scale = _fused_scale([s[...] for s in scales], [m.shape[1] for m in mats])
        if fused and native.can_pack(whole) and (scale is not None or not any(quantized)):
            todo.append((owner, fused, names, mats, scale))
            continue
        todo += [(owner, n, [n], [m], None) for n, m in zip(names, mats) if native.can_pack(m)]
    for (owner, attr, names, _, scale), packed in zip(todo, native.pack_weights([t[3] for t in todo])):
        _replace(owner, attr, names, packed)
        if scale is not None:
            _replace(owner, attr + SCALE_SUFFIX, [n + SCALE_SUFFIX for n in names], scale)
    return len(todo)


EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


def pack_experts(moes) -> int:
    """Repacks MoE layers' routed experts (`moes`: modules with gate_proj/up_proj [S, E, I] and down_proj [S, I, E])
    into the native expert kernel's packed layout, slot by slot, in place (one huge-page buffer, as `pack_groups`);
    returns how many stacks it packed. Float experts pack in their dtype's layout, int8 experts with a scale per
    slot and output column (`<name>_scale` [S, N]) in the int8 one (their scales as they are); other quantized
    experts (group-wise, fp8), experts already packed and those whose E or I is not whole panels stay as they are,
    as do all where MESHSERVE_MOE_KERNEL forces a path other than the native kernel."""
    from pallas_kernels.moe import native_may_run
    todo = []
    for m in moes if native_may_run() else ():
        ws = [getattr(m, n)[...] for n in EXPERT_WEIGHTS]
        scales = [getattr(m, n + SCALE_SUFFIX, None) for n in EXPERT_WEIGHTS]
        if any(s is not None for s in scales):  # int8 with a scale per slot and output column: packed as int8
            per_channel = all(s is not None and s[...].shape == (w.shape[0], w.shape[2]) for s, w in zip(scales, ws))
            if not per_channel or any(jnp.dtype(w.dtype) != jnp.int8 for w in ws):
                continue
        elif any(jnp.dtype(w.dtype) not in native.PANELS for w in ws):
            continue
        if all(w.ndim == 3 and native.can_pack(w) for w in ws):
            todo += [(m, n, w) for n, w in zip(EXPERT_WEIGHTS, ws)]
    for (m, n, _), packed in zip(todo, native.pack_weights([t[2] for t in todo])):
        getattr(m, n).set_value(packed)
    return len(todo)


def _replace(owner, attr: str, names: list[str], value) -> None:
    """Sets parameter `attr` of `owner` to `value` (a new parameter where it has none) and the other `names` to
    None."""
    for n in names:
        if n != attr:
            setattr(owner, n, None)
    if getattr(owner, attr, None) is not None:
        getattr(owner, attr).set_value(value)
    else:
        setattr(owner, attr, nnx.Param(value))


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
