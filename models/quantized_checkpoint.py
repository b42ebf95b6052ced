"""Pre-quantized HF checkpoints, read side: a config's `quantization_config` parsed into a `CheckpointQuantization`
(llm-compressor's compressed-tensors 8-bit int / fp8, and the `fp8` format of DeepSeek-V3 and Qwen3-FP8), which reads
each quantized Linear weight as a `QuantizedWeight`: 8-bit values as stored and float32 scales. Every other scheme is
refused with a `CheckpointError` naming it. Details: docs/models.md."""
from __future__ import annotations

import dataclasses
import math
import re

import ml_dtypes
import numpy as np

from models.safetensors_io import CheckpointError, SafetensorsCheckpoint

FP8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
INT8 = np.dtype(np.int8)
_STORED_NAME = {INT8: "I8", FP8_E4M3: "F8_E4M3"}
_FP8_TO_FLOAT32 = np.arange(256, dtype=np.uint8).view(FP8_E4M3).astype(np.float32)  # 4x ml_dtypes' cast
_FLOAT_NAMES = ("F32", "BF16", "F16", "F64")
_CT_FORMATS = ("int-quantized", "float-quantized", "naive-quantized", "pack-quantized")
_STRATEGIES = ("channel", "tensor", "group", "block")


@dataclasses.dataclass(frozen=True)
class WeightScheme:
    """How a group of Linear weights is stored: symmetric 8-bit values, one scale per `strategy` unit.

    `block` is the [out, in] tile one scale covers for "group" ((1, group_size)) and "block" ((rows, cols));
    `activations` records what the checkpoint asks of the layer's inputs (None: weight-only; e.g. "dynamic int8
    per-token"); our matmuls run the inputs unquantised either way."""
    dtype: np.dtype
    strategy: str
    block: tuple[int, int] | None = None
    activations: str | None = None
    packed: bool = False  # compressed-tensors pack-quantized: four int8 values (offset by 128) to an int32
    targets: tuple[str, ...] = ("Linear",)


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """One Linear weight: `values` [out, in] (HF's layout) int8 or float8_e4m3fn; `scales` float32, [out] (one per
    output row; tensor-wise scales broadcast) or, with `block` (rows, cols), [ceil(out / rows), ceil(in / cols)].
    Dequantised = values * the scale of its row or block. `tensors`: every checkpoint tensor read for it."""
    values: np.ndarray
    scales: np.ndarray
    block: tuple[int, int] | None
    tensors: tuple[str, ...]

    @property
    def group_size(self) -> int | None:
        """Rows of K (the input dim) one scale covers in `output_scales`; None for one scale per channel."""
        return None if self.block is None else self.block[1]

    def output_scales(self) -> np.ndarray:
        """The scales of the transposed [in, out] weight in output layout: [out], or [G, out] with one row per
        group of `group_size` input rows (G = ceil(in / group_size))."""
        if self.block is None:
            return self.scales
        return np.ascontiguousarray(np.repeat(self.scales, self.block[0], axis=0)[:self.values.shape[0]].T)

    def dequantize(self) -> np.ndarray:
        """float32 [out, in]."""
        values = _FP8_TO_FLOAT32[self.values.view(np.uint8)] if self.values.dtype == FP8_E4M3 else \
            self.values.astype(np.float32)
        return values * element_scales(self.scales, self.block, self.values.shape)


def element_scales(scales: np.ndarray, block: tuple[int, int] | None, shape: tuple[int, int]) -> np.ndarray:
    """The scale of each element of an [out, in] weight, from `scales` [out] (block None) or one per `block`."""
    out, k = shape
    if block is None:
        return np.broadcast_to(scales.reshape(out, 1), shape)
    rows, cols = block
    return np.repeat(np.repeat(scales, rows, axis=0)[:out], cols, axis=1)[:, :k]


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's declared quantization: `method` ("compressed-tensors" or "fp8"), one `WeightScheme` per config
    group, the Linear modules left in floating point (`ignore`: names or "re:" regexes) and the KV cache scheme as
    declared (compressed-tensors' `kv_cache_scheme`: its k_scale / v_scale tensors are not read here)."""
    method: str
    groups: tuple[WeightScheme, ...]
    ignore: tuple[str, ...] = ()
    kv_cache: dict | None = None

    @classmethod
    def from_config(cls, hf_config: dict) -> CheckpointQuantization | None:
        """From an HF config.json dict; None when it declares no quantization."""
        q = hf_config.get("quantization_config")
        if q is None:
            return None
        method = q.get("quant_method")
        if method == "compressed-tensors":
            return _parse_compressed_tensors(q)
        if method == "fp8":
            return _parse_fp8(q)
        if method == "mxfp4":  # GPT-OSS's experts, dequantised at load by models.mxfp4 (models.config checks the family)
            return None
        raise CheckpointError(f"quantization_config: quant_method {method!r} is not supported (supported: "
                              f"'compressed-tensors' with 8-bit int or fp8 weights, 'fp8')")

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme of Linear `module` (its HF name, e.g. model.layers.0.mlp.up_proj) by the config's targets and
        ignore list; None when the config leaves it in floating point."""
        if any(name_matches(module, pattern) for pattern in self.ignore):
            return None
        return next((g for g in self.groups if any(t == "Linear" or name_matches(module, t) for t in g.targets)),
                    None)

    def read_linear(self, ckpt: SafetensorsCheckpoint, weight_name: str) -> QuantizedWeight | None:
        """The quantized weight of one HF Linear weight name (`<module>.weight`), or None when that Linear is stored
        in floating point. compressed-tensors decides by the config (targets, ignore); the fp8 format by the stored
        dtype (its `modules_to_not_convert` is advisory: real checkpoints leave routers out of it). A scale or zero
        point beside a floating-point weight, a wrong dtype or shape, and a non-zero zero point all raise."""
        module = weight_name.removesuffix(".weight")
        if self.method == "fp8":
            quantized = weight_name in ckpt and ckpt.dtype_name(weight_name) == "F8_E4M3"
            scheme = self.groups[0] if quantized else None
        else:
            scheme = self.scheme_for(module)
        if scheme is None:
            stray = [f"{module}.{s}" for s in ("weight_scale", "weight_scale_inv", "weight_zero_point", "weight_packed")
                     if f"{module}.{s}" in ckpt]
            if stray:
                raise CheckpointError(f"tensor {stray[0]!r} is in the checkpoint, but {self.method} leaves {module!r} "
                                      f"unquantized ({_why_unquantized(self, module)})")
            return None
        return _read(ckpt, module, scheme, self.method)


def name_matches(name: str, pattern: str) -> bool:
    """compressed-tensors' rule: "re:<regex>" matched from the start of the name, else the exact name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


def _why_unquantized(quant: CheckpointQuantization, module: str) -> str:
    if quant.method == "fp8":
        return "its weight is not stored as float8_e4m3fn"
    if any(name_matches(module, p) for p in quant.ignore):
        return "it is on the ignore list"
    return "no config group targets it"


def _parse_compressed_tensors(q: dict) -> CheckpointQuantization:
    fmt = q.get("format")
    if fmt not in _CT_FORMATS + ("mixed-precision",):
        raise CheckpointError(f"quantization_config: compressed-tensors format {fmt!r} is not supported (supported: "
                              f"{', '.join(_CT_FORMATS)}, mixed-precision of those)")
    sparsity = q.get("sparsity_config") or {}
    if sparsity and sparsity.get("format") != "dense":  # older llm-compressor records a "dense" one
        raise CheckpointError(f"quantization_config: compressed-tensors sparsity_config {sparsity!r} is not supported")
    if q.get("transform_config"):
        raise CheckpointError(f"quantization_config: compressed-tensors transform_config {q['transform_config']!r} "
                              f"is not supported")
    groups = q.get("config_groups") or {}
    if not groups:
        raise CheckpointError("quantization_config: compressed-tensors config without config_groups")
    parsed = tuple(_parse_config_group(name, group, fmt) for name, group in groups.items())
    return CheckpointQuantization("compressed-tensors", parsed, tuple(q.get("ignore") or ()),
                                  q.get("kv_cache_scheme"))


def _parse_config_group(name: str, group, fmt: str) -> WeightScheme:
    where = f"quantization_config: compressed-tensors config group {name!r}"
    if not isinstance(group, dict):
        raise CheckpointError(f"{where} is a preset name ({group!r}); only expanded schemes are supported")
    w = group.get("weights")
    if not w:
        raise CheckpointError(f"{where} quantizes no weights (activation-only quantization is not supported)")
    group_fmt = group.get("format") or fmt
    if group_fmt not in _CT_FORMATS:
        raise CheckpointError(f"{where}: format {group_fmt!r} is not supported (supported: {', '.join(_CT_FORMATS)})")
    kind, bits = w.get("type", "int"), w.get("num_bits")
    if kind not in ("int", "float") or bits != 8:
        raise CheckpointError(f"{where}: {bits}-bit {kind} weights are not supported (8-bit int or float only)")
    if not w.get("symmetric", True):
        raise CheckpointError(f"{where}: asymmetric weights (zero points) are not supported (symmetric only)")
    if w.get("dynamic"):
        raise CheckpointError(f"{where}: dynamic weight quantization is not supported")
    if w.get("actorder") in ("group", "dynamic"):
        raise CheckpointError(f"{where}: actorder {w['actorder']!r} (weight_g_idx reordering) is not supported")
    if group.get("output_activations"):
        raise CheckpointError(f"{where}: output activation quantization is not supported")
    group_size = w.get("group_size")
    strategy = w.get("strategy") or {None: "tensor", -1: "channel"}.get(group_size, "group")
    if strategy not in _STRATEGIES:
        raise CheckpointError(f"{where}: weight strategy {strategy!r} is not supported "
                              f"(supported: {', '.join(_STRATEGIES)})")
    block = None
    if strategy == "group":
        if not isinstance(group_size, int) or group_size <= 0:
            raise CheckpointError(f"{where}: group strategy with group_size {group_size!r} (needs a positive int)")
        block = (1, group_size)
    elif strategy == "block":
        structure = w.get("block_structure")
        if not (isinstance(structure, list) and len(structure) == 2 and all(isinstance(v, int) and v > 0
                                                                            for v in structure)):
            raise CheckpointError(f"{where}: block strategy with block_structure {structure!r} (needs [rows, cols])")
        block = tuple(structure)
    packed = group_fmt == "pack-quantized"
    if packed and kind != "int":
        raise CheckpointError(f"{where}: pack-quantized {kind} weights are not supported (int only)")
    dtype = INT8 if kind == "int" else FP8_E4M3
    return WeightScheme(dtype, strategy, block, _describe_activations(group.get("input_activations")), packed,
                        tuple(group.get("targets") or ()))


def _describe_activations(a: dict | None) -> str | None:
    if not a:
        return None
    timing = "dynamic" if a.get("dynamic") else "static"
    return f"{timing} {a.get('type', 'int')}{a.get('num_bits')} per-{a.get('strategy') or 'tensor'}"


def _parse_fp8(q: dict) -> CheckpointQuantization:
    where = "quantization_config: fp8"
    if q.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{where} fmt {q['fmt']!r} is not supported (e4m3 only)")
    activations = q.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise CheckpointError(f"{where} activation_scheme {activations!r} is not supported (dynamic or static)")
    if q.get("modules_to_convert"):
        raise CheckpointError(f"{where} modules_to_convert {q['modules_to_convert']!r} (fp8 embeddings) is not "
                              f"supported")
    if q.get("expert_dtype", "fp8") != "fp8":
        raise CheckpointError(f"{where} expert_dtype {q['expert_dtype']!r} is not supported (fp8 only)")
    block = q.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2 and all(
            isinstance(v, int) and v > 0 for v in block)):
        raise CheckpointError(f"{where} weight_block_size {block!r} (needs [rows, cols] or null)")
    scheme = WeightScheme(FP8_E4M3, "block" if block else "tensor", tuple(block) if block else None,
                          f"{activations} fp8")
    ignore = q.get("modules_to_not_convert") or q.get("ignored_layers") or ()
    return CheckpointQuantization("fp8", (scheme,), tuple(ignore))


def _read(ckpt: SafetensorsCheckpoint, module: str, scheme: WeightScheme, method: str) -> QuantizedWeight:
    name = lambda suffix: f"{module}.{suffix}"  # noqa: E731
    if scheme.packed:
        values, tensors = _unpack_int8(ckpt, module), [name("weight_packed"), name("weight_shape")]
    else:
        values, tensors = _stored(ckpt, name("weight"), scheme.dtype, method), [name("weight")]
    scale_name = name("weight_scale_inv" if method == "fp8" and scheme.block else "weight_scale")
    scales, block = _canonical_scales(ckpt, scale_name, scheme, values.shape)
    tensors.append(scale_name)
    for zero_point in (name("weight_zero_point"), name("input_zero_point")):
        if zero_point in ckpt:
            if np.any(ckpt.get(zero_point).astype(np.float32) != 0):
                raise CheckpointError(f"tensor {zero_point!r} has non-zero zero points: only symmetric "
                                      f"quantization is supported")
            tensors.append(zero_point)
    if scheme.activations is not None:
        # Static activation scales: our matmuls run the inputs unquantised, so they are read past.
        tensors += [n for n in (name("input_scale"), name("activation_scale")) if n in ckpt]
    return QuantizedWeight(values, scales, block, tuple(tensors))


def _stored(ckpt: SafetensorsCheckpoint, name: str, dtype: np.dtype, method: str) -> np.ndarray:
    if name not in ckpt:
        raise CheckpointError(f"tensor {name!r} is missing from the checkpoint ({method} quantizes its module)")
    if ckpt.dtype_name(name) != _STORED_NAME[dtype]:
        raise CheckpointError(f"tensor {name!r} has dtype {ckpt.dtype_name(name)}, expected "
                              f"{_STORED_NAME[dtype]} for {method} {dtype.name} weights")
    values = ckpt.get(name)
    if values.ndim != 2:
        raise CheckpointError(f"tensor {name!r} has shape {values.shape}; a Linear weight is [out, in]")
    return values


def _unpack_int8(ckpt: SafetensorsCheckpoint, module: str) -> np.ndarray:
    """pack-quantized 8-bit: int32 words holding four values each, offset by 128, little-endian from element 0."""
    packed = _stored_any(ckpt, f"{module}.weight_packed", ("I32",))
    shape = tuple(int(v) for v in _stored_any(ckpt, f"{module}.weight_shape", ("I64", "I32")))
    if len(shape) != 2 or packed.ndim != 2 or packed.shape != (shape[0], math.ceil(shape[1] / 4)):
        raise CheckpointError(f"tensor {module + '.weight_packed'!r} has shape {packed.shape}, which does not hold "
                              f"8-bit values of weight_shape {shape}")
    unsigned = np.ascontiguousarray(packed).astype("<i4").view(np.uint8)[:, :shape[1]]
    return (unsigned.astype(np.int16) - 128).astype(np.int8)


def _stored_any(ckpt: SafetensorsCheckpoint, name: str, dtype_names: tuple[str, ...]) -> np.ndarray:
    if name not in ckpt:
        raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
    if ckpt.dtype_name(name) not in dtype_names:
        raise CheckpointError(f"tensor {name!r} has dtype {ckpt.dtype_name(name)}, expected one of {dtype_names}")
    return ckpt.get(name)


def _canonical_scales(ckpt: SafetensorsCheckpoint, name: str, scheme: WeightScheme,
                      shape: tuple[int, int]) -> tuple[np.ndarray, tuple[int, int] | None]:
    raw = _stored_any(ckpt, name, _FLOAT_NAMES).astype(np.float32)
    out, k = shape
    if scheme.strategy == "tensor":
        want, got = "one value", raw.size == 1
        scales, block = np.full((out,), raw.reshape(-1)[0] if got else 0, np.float32), None
    elif scheme.strategy == "channel":
        want, got = f"[{out}, 1]", raw.shape in ((out, 1), (out,))
        scales, block = raw.reshape(-1), None
    else:
        rows, cols = scheme.block
        grid = (math.ceil(out / rows), math.ceil(k / cols))
        want, got = f"{list(grid)} ({rows}x{cols} blocks of [{out}, {k}])", raw.shape == grid
        scales, block = raw, scheme.block
    if not got:
        raise CheckpointError(f"tensor {name!r} has shape {raw.shape}, expected {want} for {scheme.strategy} scales")
    if not np.all(np.isfinite(scales)):
        raise CheckpointError(f"tensor {name!r} holds non-finite scales")
    return np.ascontiguousarray(scales), block
