"""Building blocks every decoder uses: parameter initialisers that carry logical axes, RMSNorm, the SwiGLU MLP and
the embedding lookup. Matmuls go through `pallas_kernels.matmul` (native CPU kernels where they run)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.matmul import matmul
from pallas_kernels.target import target_platform
from sharding.axes import EMBED, MLP as MLP_AXIS


def param(rngs: nnx.Rngs, shape, axes, dtype, scale=0.02) -> nnx.Param:
    """A normal(0, scale) parameter with its logical axes (`sharding.axes`)."""
    value = (jax.random.normal(rngs.params(), shape, jnp.float32) * scale).astype(dtype)
    return nnx.Param(value, axes=axes)


def ones(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), axes=axes)


def zeros(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), axes=axes)


def embed_lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Pure. `table[ids]`. On CPU a 16-bit float table is gathered as uint16 bits: XLA:CPU otherwise fuses a
    convert of the whole table to f32 into the gather (98 MB written per step for a 32k x 768 bf16 table)."""
    if target_platform() == "cpu" and jnp.issubdtype(table.dtype, jnp.floating) and table.dtype.itemsize == 2:
        bits = jax.lax.bitcast_convert_type(table, jnp.uint16)[ids]
        return jax.lax.bitcast_convert_type(bits, table.dtype)
    return table[ids]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, axis_name: str, dtype):
        self.weight = ones((dim,), (axis_name,), dtype)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * xf).astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, dtype, rngs: nnx.Rngs):
        self.gate_proj = param(rngs, (hidden, intermediate), (EMBED, MLP_AXIS), dtype)
        self.up_proj = param(rngs, (hidden, intermediate), (EMBED, MLP_AXIS), dtype)
        self.down_proj = param(rngs, (intermediate, hidden), (MLP_AXIS, EMBED), dtype)
        self.intermediate = intermediate
        self.gate_up_proj = nnx.data(None)  # gate|up fused and packed by `pallas_kernels.matmul.pack_groups` (then gate/up_proj are None)

    def __call__(self, x):
        if self.gate_up_proj is not None:
            gu = matmul(x, self.gate_up_proj[...])
            h = jax.nn.silu(gu[:, :self.intermediate]) * gu[:, self.intermediate:]
        else:
            h = jax.nn.silu(matmul(x, self.gate_proj[...])) * matmul(x, self.up_proj[...])
        return matmul(h, self.down_proj[...])
