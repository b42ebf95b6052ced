"""Quantized matmul weights: int8 (symmetric) or fp8 e4m3 values beside float32 scales, one per output channel or,
group-wise, one per output channel per group of K rows (block-wise fp8 checkpoints). A quantized parameter keeps its
name, shape and logical axes; its owner holds the scales as `<name>_scale` in "output layout": the weight with its
contracting axes dropped (per channel) or flattened into one axis of G groups (group-wise), so the rules shard a
scale with its weight. `quantize` / `dequantize` convert between float weights and that form. Details:
docs/quantization.md."""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels.names import WEIGHT_QUANTIZATIONS

VALUE_DTYPES = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}
QMAX = {"int8": 127.0, "fp8": 448.0}  # the largest magnitude each format holds


def scale_name(name: str) -> str:
    return f"{name}_scale"


@dataclasses.dataclass(frozen=True, slots=True)
class WeightQuant:
    """How a model's matmul weights are held: `kind` int8 / fp8, `group` K rows per scale (0: per channel)."""
    kind: str
    group: int = 0

    def __post_init__(self):
        if self.kind not in WEIGHT_QUANTIZATIONS:
            raise ValueError(f"weight quantization must be one of {WEIGHT_QUANTIZATIONS}, got {self.kind!r}")
        if self.group < 0:
            raise ValueError(f"quantization group must be >= 0 (0: per channel), got {self.group}")

    @property
    def dtype(self) -> np.dtype:
        return VALUE_DTYPES[self.kind]


def _split(shape, contract: tuple[int, ...]) -> tuple[tuple, int, tuple]:
    """(leading dims, K, output dims) of a weight whose contracting axes are `contract` (contiguous)."""
    c0, c1 = contract[0], contract[-1] + 1
    if tuple(contract) != tuple(range(c0, c1)):
        raise ValueError(f"contracting axes {contract} are not contiguous")
    return tuple(shape[:c0]), math.prod(shape[c0:c1]), tuple(shape[c1:])


def num_groups(k: int, group: int) -> int:
    return 1 if not group else -(-k // group)


def scale_shape(shape, contract: tuple[int, ...], group: int = 0) -> tuple[int, ...]:
    lead, k, out = _split(shape, contract)
    return lead + ((num_groups(k, group),) if group else ()) + out


def scale_axes(axes, contract: tuple[int, ...], group: int = 0) -> tuple:
    """The logical axes of a weight's scales: its own, the contracting ones dropped (or one unsharded group axis)."""
    axes = tuple(axes)
    c0, c1 = contract[0], contract[-1] + 1
    return axes[:c0] + ((None,) if group else ()) + axes[c1:]


def quantize(w, contract: tuple[int, ...], quant: WeightQuant, xp=np):
    """(values, scales) of float weight `w` (NumPy, or jax.numpy with `xp=jnp`): symmetric, absmax per output
    channel (per group of K rows when `quant.group`); an all-zero channel gets scale 1 (its values are 0)."""
    lead, k, out = _split(w.shape, contract)
    g = num_groups(k, quant.group)
    rows = quant.group or k
    wf = w.astype(xp.float32).reshape(lead + (k,) + (-1,))
    if g * rows != k:  # pad K to whole groups (zeros do not change a group's absmax)
        wf = xp.pad(wf, [(0, 0)] * len(lead) + [(0, g * rows - k), (0, 0)])
    blocks = wf.reshape(lead + (g, rows, -1))
    amax = xp.max(xp.abs(blocks), axis=-2)  # lead + (g, N)
    scale = xp.where(amax > 0, amax / QMAX[quant.kind], 1.0).astype(xp.float32)
    q = blocks / scale[..., None, :]
    if quant.kind == "int8":
        q = xp.clip(xp.round(q), -127, 127)
    values = q.astype(quant.dtype).reshape(lead + (g * rows, -1))[..., :k, :].reshape(w.shape)
    scale = scale.reshape(scale_shape(w.shape, contract, quant.group))
    return values, scale


def dequantize(values, scale, contract: tuple[int, ...], group: int = 0, xp=np):
    """Float32 weights of (values, scales) as `quantize` makes them."""
    lead, k, out = _split(values.shape, contract)
    g = num_groups(k, group)
    rows = group or k
    s = xp.asarray(scale, xp.float32).reshape(lead + (g, 1, -1))
    v = values.astype(xp.float32).reshape(lead + (k, -1))
    if g * rows != k:
        v = xp.pad(v, [(0, 0)] * len(lead) + [(0, g * rows - k), (0, 0)])
    w = (v.reshape(lead + (g, rows, -1)) * s).reshape(lead + (g * rows, -1))[..., :k, :]
    return w.reshape(values.shape)


def matmul_scale(scale, k: int, group: int):
    """A weight's scales as `pallas_kernels.matmul.matmul` takes them for its [K, N] view: [N] per channel, [G, N]
    group-wise."""
    return scale.reshape(-1) if not group else scale.reshape(num_groups(k, group), -1)


def is_quantized(w) -> bool:
    return jnp.dtype(w.dtype) in VALUE_DTYPES.values()
