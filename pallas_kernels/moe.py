"""The grouped expert MLP of mixture-of-experts layers, behind one entry point: `grouped_expert_mlp`. On CPU with the
native kernels it is one call of `native.expert_mlp` (each selected expert's weights read once for all its tokens,
unselected experts not read at all; fused gate|up, SwiGLU, down and the weighted combine); elsewhere (GPU, TPU,
MESHSERVE_CPU_KERNELS=xla, a multi-device context outside shard_map) the (token, expert) pairs are sorted by slot and
run through `jax.lax.ragged_dot`. MESHSERVE_MOE_KERNEL=ragged_dot forces the latter on CPU too (for comparisons)."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from pallas_kernels import native

MOE_ENV_VAR = "MESHSERVE_MOE_KERNEL"  # auto (default): native where it runs | ragged_dot
BACKENDS = ("native", "ragged_dot")


def moe_backend(x, gate, up, down) -> str:
    """Trace-time. Which backend `grouped_expert_mlp` takes for these operands here."""
    choice = os.environ.get(MOE_ENV_VAR, "auto").strip().lower()
    if choice not in ("", "auto", *BACKENDS):
        raise ValueError(f"{MOE_ENV_VAR}={choice!r}: expected auto or one of {', '.join(BACKENDS)}")
    if choice != "ragged_dot" and native.expert_mlp_supported(x, gate, up, down):
        return "native"
    return "ragged_dot"


def grouped_expert_mlp(x, slots, weights, gate, up, down):
    """Pure. [T, E] in x's dtype: sum_k weights[t, k] * SwiGLU_{slots[t, k]}(x[t]), SwiGLU_s(v) =
    (silu(v @ gate[s]) * (v @ up[s])) @ down[s]; x [T, E], slots [T, k] int (< 0: padding, no work; >= S: no work),
    weights [T, k], gate/up [S, E, I], down [S, I, E]. Runs on whole local arrays (under a mesh: inside shard_map)."""
    if moe_backend(x, gate, up, down) == "native":
        return native.expert_mlp(x, slots, weights, gate, up, down)
    return ragged_expert_mlp(x, slots, weights, gate, up, down)


def ragged_expert_mlp(x, slots, weights, gate, up, down):
    """Pure. `grouped_expert_mlp` with XLA's ops: the (token, k) pairs sorted by slot (those of no slot last, not
    computed) through `ragged_dot`, then scattered back with their weights."""
    t, k = slots.shape
    n = gate.shape[0]
    flat = slots.reshape(-1)
    mine = (flat >= 0) & (flat < n)
    key = jnp.where(mine, flat, n)
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.zeros((n + 1,), jnp.int32).at[key].add(1)[:n]
    token = order // k
    xs = x[token]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, gate, group_sizes)) * jax.lax.ragged_dot(xs, up, group_sizes)
    out = jax.lax.ragged_dot(h, down, group_sizes)
    w = jnp.where(mine[order], weights.reshape(-1)[order], 0).astype(out.dtype)
    return jnp.zeros_like(x).at[token].add(out * w[:, None])
