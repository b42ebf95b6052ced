"""Building blocks every decoder uses: parameter initialisers that carry logical axes, RMSNorm, the SwiGLU MLP and
the embedding lookup. Matmuls go through `pallas_kernels.matmul` (native CPU kernels where they run)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import UnsupportedModelError
from models.lora import apply_lora, apply_lora_parts
from models.quant import WeightQuant, matmul_scale, quantize, scale_axes, scale_name
from pallas_kernels.matmul import dense_weight, matmul
from pallas_kernels.target import target_platform
from sharding.axes import EMBED, MLP as MLP_AXIS


def next_key(stream: nnx.RngStream) -> jax.Array:
    """`stream()`'s key (fold_in(key, count), then count + 1: the same keys), with the count replaced whole.
    `stream()` updates it as `count[...] += 1`, whose check of the new value's `sharding` raises and formats an
    AttributeError on a tracer; the message walks the whole trace so far, so a model built under a trace
    (`nnx.eval_shape`, a jitted init) paid a walk per parameter: quadratic in its depth (SmolLM2-135M's 30 layers under
    `models.weights.abstract_model`: 0.96 -> 0.27 CPU s on a Zen 3; more for deeper models)."""
    count = stream.count
    count._check_can_update()  # as stream() does (flax >= 0.12.8, < 0.13: pyproject)
    key = jax.random.fold_in(stream.key[...], count[...])
    count.set_value(count[...] + 1)
    return key


def param(rngs: nnx.Rngs, shape, axes, dtype, scale=0.02) -> nnx.Param:
    """A normal(0, scale) parameter with its logical axes (`sharding.axes`)."""
    value = (jax.random.normal(next_key(rngs.params), shape, jnp.float32) * scale).astype(dtype)
    return nnx.Param(value, axes=axes)


def linear_param(owner: nnx.Module, name: str, rngs: nnx.Rngs, shape, axes, dtype, contract: tuple[int, ...],
                 quant: WeightQuant | None) -> None:
    """Sets `owner.<name>`, a matmul weight contracting over axes `contract`: a float parameter, or with `quant` its
    quantized values (the random init quantized) and `owner.<name>_scale` (models.quant)."""
    p = param(rngs, shape, axes, dtype)
    k = math.prod(shape[contract[0]:contract[-1] + 1])
    if quant is not None and quant.group and k > quant.group and k % quant.group:
        raise UnsupportedModelError(f"{name}: {k} input rows are not whole {quant.group}-row quantization blocks "
                                    f"(block-wise scales need the input dimension a multiple of the block)")
    if quant is None:
        setattr(owner, name, p)
        return
    values, scale = quantize(p[...], contract, quant, xp=jnp)
    setattr(owner, name, nnx.Param(values, axes=axes))
    setattr(owner, scale_name(name), nnx.Param(scale, axes=scale_axes(axes, contract, quant.group)))


def weight_scale(owner: nnx.Module, name: str, rows: int, group: int) -> jax.Array | None:
    """The scales of `owner.<name>` as `matmul` takes them for its [rows, N] view, or None (not quantized)."""
    s = getattr(owner, scale_name(name), None)
    return None if s is None else matmul_scale(s[...], rows, group)


def linear(x: jax.Array, owner: nnx.Module, name: str, rows: int, group: int = 0) -> jax.Array:
    """Pure. `x @ owner.<name>` over its [rows, N] view (packed, quantized or plain)."""
    return matmul(x, dense_weight(getattr(owner, name), rows), scale=weight_scale(owner, name, rows, group))


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
    """x / rms(x) * weight in float32; `unit_offset` (Gemma): * (1 + weight), the weight starting at 0."""

    def __init__(self, dim: int, eps: float, axis_name: str, dtype, unit_offset: bool = False):
        self.weight = (zeros if unit_offset else ones)((dim,), (axis_name,), dtype)
        self.eps = eps
        self.unit_offset = unit_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        scale = self.weight[...].astype(jnp.float32)
        if self.unit_offset:  # added in float32, as HF's Gemma3RMSNorm does (a bf16 1 + w would round)
            scale = 1.0 + scale
        return (scale * xf).astype(x.dtype)


# The gate activations of the gated MLP, by HF's name: SwiGLU's silu, GeGLU's tanh-approximated GELU (Gemma).
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); act silu (SwiGLU) or tanh GELU (GeGLU)."""

    def __init__(self, hidden: int, intermediate: int, dtype, rngs: nnx.Rngs, quant: WeightQuant | None = None,
                 activation: str = "silu"):
        if activation not in ACTIVATIONS:
            raise UnsupportedModelError(f"MLP activation {activation!r} (supported: {', '.join(ACTIVATIONS)})")
        linear_param(self, "gate_proj", rngs, (hidden, intermediate), (EMBED, MLP_AXIS), dtype, (0,), quant)
        linear_param(self, "up_proj", rngs, (hidden, intermediate), (EMBED, MLP_AXIS), dtype, (0,), quant)
        linear_param(self, "down_proj", rngs, (intermediate, hidden), (MLP_AXIS, EMBED), dtype, (0,), quant)
        self.hidden, self.intermediate = hidden, intermediate
        self.activation = activation
        self.quant_group = quant.group if quant else 0
        self.gate_up_proj = nnx.data(None)  # gate|up fused and packed by `pallas_kernels.matmul.pack_groups` (then gate/up_proj are None)
        self.lora = nnx.data(None)  # adapter slots of gate/up/down (models.lora.LoRAStacks), set when serving LoRA

    def __call__(self, x, lora_slots=None):
        """`lora_slots` [T]: each token's adapter slot (< 0: none), or None (no adapter in the step)."""
        e, i, g = self.hidden, self.intermediate, self.quant_group
        act = ACTIVATIONS[self.activation]
        if self.gate_up_proj is not None:
            gu = linear(x, self, "gate_up_proj", e, g)
            gate, up = gu[:, :i], gu[:, i:]
        else:
            gate, up = linear(x, self, "gate_proj", e, g), linear(x, self, "up_proj", e, g)
        if self.lora is not None and lora_slots is not None:
            gate, up = apply_lora_parts(self.lora, ("gate_proj", "up_proj"), x, (gate, up), lora_slots)
        h = act(gate) * up
        return apply_lora(self.lora, "down_proj", h, linear(h, self, "down_proj", i, g), lora_slots)
