"""The grouped expert MLP of mixture-of-experts layers, behind one entry point: `grouped_expert_mlp`. On CPU with the
native kernels it is one call of `native.expert_mlp` (each selected expert's weights read once for all its tokens,
unselected experts not read at all; fused gate|up, SwiGLU, down and the weighted combine); on XLA:CPU a step of a few
(token, expert) pairs gathers the selected experts' weights (`GATHER_MAX_PAIRS`); elsewhere (GPU, TPU, larger steps
on XLA:CPU) the (token, expert) pairs are sorted by slot and run through `jax.lax.ragged_dot`.
MESHSERVE_MOE_KERNEL=ragged_dot (or gather) forces that path (for comparisons)."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from pallas_kernels import native
from pallas_kernels.target import target_platform

MOE_ENV_VAR = "MESHSERVE_MOE_KERNEL"  # auto (default): native where it runs | gather | ragged_dot
BACKENDS = ("native", "gather", "ragged_dot")
# XLA:CPU without the native kernels: up to this many (token, expert) pairs (a decode step of 1-2 tokens at top-2)
# gather the selected experts' weights and apply them directly, so the step reads what the tokens selected
# (mixtral-tiny, one layer, 1 token: 0.54 ms against ragged_dot's 15.5 ms, which walks every group on XLA:CPU); at
# 8 pairs both took ~16 ms, so more pairs stay on ragged_dot.
GATHER_MAX_PAIRS = 4


def moe_backend(x, gate, up, down, pairs: int | None = None) -> str:
    """Trace-time. Which backend `grouped_expert_mlp` takes for these operands here (`pairs`: the (token, expert)
    pairs, T * k; None: many)."""
    pairs = GATHER_MAX_PAIRS + 1 if pairs is None else pairs
    choice = os.environ.get(MOE_ENV_VAR, "auto").strip().lower()
    if choice not in ("", "auto", *BACKENDS):
        raise ValueError(f"{MOE_ENV_VAR}={choice!r}: expected auto or one of {', '.join(BACKENDS)}")
    if choice in ("gather", "ragged_dot"):
        return choice
    if native.expert_mlp_supported(x, gate, up, down):
        return "native"
    if target_platform() == "cpu" and pairs <= GATHER_MAX_PAIRS:
        return "gather"
    return "ragged_dot"


def grouped_expert_mlp(x, slots, weights, gate, up, down, scales=None, group=0):
    """Pure. [T, E] in x's dtype: sum_k weights[t, k] * SwiGLU_{slots[t, k]}(x[t]), SwiGLU_s(v) =
    (silu(v @ gate[s]) * (v @ up[s])) @ down[s]; x [T, E], slots [T, k] int (< 0: padding, no work; >= S: no work),
    weights [T, k], gate/up [S, E, I], down [S, I, E]. Runs on whole local arrays (under a mesh: inside shard_map).
    Quantized weights (models.quant) come with `scales` (gate, up, down): per channel [S, I], [S, I], [S, E], or per
    `group` K rows [S, G, I], [S, G, I], [S, G, E]."""
    backend = "gather" if scales is not None and slots.size <= GATHER_MAX_PAIRS else \
        moe_backend(x, gate, up, down, slots.size)
    if backend == "native" and scales is None:
        return native.expert_mlp(x, slots, weights, gate, up, down)
    if backend == "gather":
        return gathered_expert_mlp(x, slots, weights, gate, up, down, scales, group)
    return ragged_expert_mlp(x, slots, weights, gate, up, down, scales, group)


def _dequantized(w, scale, group: int, dtype):
    """Pure. Expert weights [..., K, N] (gathered or all) times their scales ([..., N] or [..., G, N]), in `dtype`."""
    if scale is None:
        return w
    s = scale[..., None, :] if not group else jnp.repeat(scale, group, axis=-2)[..., :w.shape[-2], :]
    return (w.astype(jnp.float32) * s).astype(dtype)


def gathered_expert_mlp(x, slots, weights, gate, up, down, scales=None, group=0):
    """Pure. `grouped_expert_mlp` for a few pairs: each (token, k) pair's expert weights gathered and applied with
    batched matmuls; slots outside [0, S) weigh 0."""
    t, k = slots.shape
    n = gate.shape[0]
    flat = slots.reshape(-1)
    mine = (flat >= 0) & (flat < n)
    idx = jnp.where(mine, flat, 0)
    xs = jnp.repeat(x, k, axis=0)  # pair p = token p // k
    gs, us, ds = (None,) * 3 if scales is None else (s[idx] for s in scales)
    gw, uw, dw = (_dequantized(w[idx], s, group, x.dtype) for w, s in ((gate, gs), (up, us), (down, ds)))
    h = jax.nn.silu(jnp.einsum("pe,pei->pi", xs, gw)) * jnp.einsum("pe,pei->pi", xs, uw)
    out = jnp.einsum("pi,pie->pe", h, dw)
    w = jnp.where(mine, weights.reshape(-1), 0).astype(out.dtype)
    return (out * w[:, None]).reshape(t, k, -1).sum(axis=1)


def ragged_expert_mlp(x, slots, weights, gate, up, down, scales=None, group=0):
    """Pure. `grouped_expert_mlp` with XLA's ops: the (token, k) pairs sorted by slot (those of no slot last, not
    computed) through `ragged_dot`, then scattered back with their weights. Quantized weights: per-channel scales
    multiply each row's output by its expert's scales; group-wise ones dequantize the weights first (a copy per
    call: the slow path)."""
    t, k = slots.shape
    n = gate.shape[0]
    flat = slots.reshape(-1)
    mine = (flat >= 0) & (flat < n)
    key = jnp.where(mine, flat, n)
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.zeros((n + 1,), jnp.int32).at[key].add(1)[:n]
    token = order // k
    xs = x[token]
    row_scale = [None] * 3
    if scales is not None and group:
        gate, up, down = (_dequantized(w, s, group, x.dtype) for w, s in zip((gate, up, down), scales))
    elif scales is not None:
        gate, up, down = (w.astype(x.dtype) for w in (gate, up, down))
        expert = jnp.minimum(key[order], n - 1)
        row_scale = [s[expert] for s in scales]

    def dot(a, w, s):
        if s is None:
            return jax.lax.ragged_dot(a, w, group_sizes)
        return (jax.lax.ragged_dot(a, w, group_sizes, preferred_element_type=jnp.float32) * s).astype(a.dtype)

    h = jax.nn.silu(dot(xs, gate, row_scale[0])) * dot(xs, up, row_scale[1])
    out = dot(h, down, row_scale[2])
    w = jnp.where(mine[order], weights.reshape(-1)[order], 0).astype(out.dtype)
    return jnp.zeros_like(x).at[token].add(out * w[:, None])
