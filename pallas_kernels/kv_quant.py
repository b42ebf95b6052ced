"""The quantized paged KV cache (`QuantizedKV`: int8 or float8_e4m3 values and one float32 scale per token per KV head,
K and V apart), the quantise / dequantise of its rows every backend shares, and its storage and sharding (its shape
and size: `models.kv_cache`). Details: docs/attention.md."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.names import KV_CACHE_DTYPES, check_kv_cache_dtype  # noqa: F401 - re-exported

QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}  # the largest magnitude a row's absmax is scaled to
VALUE_DTYPE_NAMES = {"int8": "int8", "fp8_e4m3": "float8_e4m3fn"}  # each quantized format's values
SCALE_BYTES = 4  # a float32 scale per row (token, KV head, K or V)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "scales"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    """One layer's quantized KV pages, laid out as an unquantized cache's (K of head h at row 2h, V at 2h+1); row
    [p, t, r] holds `values[p, t, r] * scales[p, t, r]`. (Under `shard_map` the fields may be partition specs.)"""
    values: jax.Array  # [P, page_size, 2*Hkv, D]: int8, float8_e4m3fn, or uint8 holding float8_e4m3fn bits (cpu)
    scales: jax.Array  # [P, page_size, 2*Hkv] float32

    @property
    def shape(self) -> tuple[int, ...]:
        """The pages' shape, [P, page_size, 2*Hkv, D] (as an unquantized cache's)."""
        return self.values.shape

    @property
    def kv_cache_dtype(self) -> str:
        """"int8" or "fp8_e4m3" (KV_CACHE_DTYPES), from the values' dtype."""
        return cache_format(self.values.dtype)


def values_dtype(kv_cache_dtype: str, backend: str):
    """The dtype a quantized cache's values are stored in for `backend`. XLA:CPU converts a whole float8 array to
    float16 and back around every gather and scatter, so on cpu float8_e4m3 values are stored as their uint8 bits
    and only the pages read are bitcast (as 16-bit floats are stored as uint16, `reference.kv_storage_dtype`)."""
    if check_kv_cache_dtype(kv_cache_dtype) == "int8":
        return jnp.dtype(jnp.int8)
    if kv_cache_dtype == "fp8_e4m3":
        return jnp.dtype(jnp.uint8 if backend == "cpu" else jnp.float8_e4m3fn)
    raise ValueError("kv_cache_dtype='auto' is not quantized")


def cache_format(dtype) -> str:
    """The KV_CACHE_DTYPES name of quantized values of `dtype` (uint8: float8_e4m3fn bits)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.int8:
        return "int8"
    if dtype in (jnp.uint8, jnp.float8_e4m3fn):
        return "fp8_e4m3"
    raise ValueError(f"quantized KV values are int8, float8_e4m3fn or uint8 (its bits), got {dtype}")


def widen(values: jax.Array) -> jax.Array:
    """Pure. Quantized values as float32 (uint8 read as float8_e4m3fn bits)."""
    if values.dtype == jnp.uint8:
        values = jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn)
    return values.astype(jnp.float32)


def quantize(rows: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Pure. Rows `[..., D]` -> (values `[..., D]` in quantized `dtype`, float32 scales `[...]`), one scale per row:
    absmax / 127 (int8, rounded to nearest) or absmax / 448 (float8_e4m3, saturated). A zero row gets scale 0 and
    values 0, which dequantise to 0."""
    x = rows.astype(jnp.float32)
    qmax = QMAX[cache_format(dtype)]
    scales = jnp.max(jnp.abs(x), axis=-1) / qmax
    y = x / jnp.where(scales > 0, scales, 1.0)[..., None]
    if jnp.dtype(dtype) == jnp.int8:
        return jnp.clip(jnp.round(y), -qmax, qmax).astype(jnp.int8), scales
    values = jnp.clip(y, -qmax, qmax).astype(jnp.float8_e4m3fn)
    if jnp.dtype(dtype) == jnp.uint8:
        values = jax.lax.bitcast_convert_type(values, jnp.uint8)
    return values, scales


def dequantize(values: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Pure. `values [..., D] * scales [...]`, computed in float32, returned in `dtype`."""
    return (widen(values) * scales[..., None]).astype(dtype)


def _less_head_dim(spec, values_ndim: int) -> jax.sharding.PartitionSpec:
    spec = tuple(spec) + (None,) * (values_ndim - len(spec))
    return jax.sharding.PartitionSpec(*spec[:-1])


def scales_sharding(sharding, values_ndim: int = 4):
    """The scales' sharding for `values_ndim`-D values sharded `sharding` (a NamedSharding less its last, head_dim,
    entry; any other sharding as it is)."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, _less_head_dim(sharding.spec, values_ndim))
    return sharding


def partition_spec(kv, values_spec: jax.sharding.PartitionSpec):
    """The `shard_map` spec of cache `kv` whose pages take `values_spec` ([P, page_size, 2*Hkv, D]): the spec itself
    for an unquantized cache, a QuantizedKV of specs (scales split on their head axis like the values) otherwise."""
    if not isinstance(kv, QuantizedKV):
        return values_spec
    return QuantizedKV(values_spec, _less_head_dim(values_spec, 4))


def slice_heads(kv, start, size: int):
    """Pure. Rows [start, start + size) of the head axis (2*Hkv, K and V interleaved) of cache `kv`."""
    if isinstance(kv, QuantizedKV):
        return QuantizedKV(jax.lax.dynamic_slice_in_dim(kv.values, start, size, axis=2),
                           jax.lax.dynamic_slice_in_dim(kv.scales, start, size, axis=2))
    return jax.lax.dynamic_slice_in_dim(kv, start, size, axis=2)

