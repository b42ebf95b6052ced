"""Pre-quantized HF checkpoints, write side: a floating-point HF checkpoint directory rewritten in a format
`models.quantized_checkpoint` reads, laid out as llm-compressor (compressed-tensors) and DeepSeek-V3 / Qwen3-FP8
(`fp8`, 128x128 blocks) write them; for tests and benchmarks.
`python -m models.quantized_checkpoint_writer --hf_dir=DIR --out=DIR --scheme=int8-w8a8`."""
from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
from absl import app, flags
from safetensors.numpy import save_file

from models.quantized_checkpoint import FP8_E4M3, INT8, element_scales, name_matches
from models.safetensors_io import SafetensorsCheckpoint

# The Linear modules llm-compressor's recipes leave in floating point: the LM head, MoE routers, shared-expert gates.
DEFAULT_IGNORE = ("lm_head", r"re:.*\.mlp\.gate$", r"re:.*\.block_sparse_moe\.gate$", r"re:.*\.shared_expert_gate$")
COMPRESSED_TENSORS_VERSION = "0.20.1"  # the release whose tensor layout and config keys these files follow
_INT8_HALF_RANGE, _FP8_MAX = 127.5, 448.0  # llm-compressor's min-max observer: scale = amax / (range / 2)

# name: (quant_method, weight type, strategy, group size or block, input activations' strategy, format)
SCHEMES = {
    # llm-compressor's presets
    "int8-w8a8": ("compressed-tensors", "int", "channel", None, "token", "int-quantized"),  # W8A8 (INT8)
    "int8-w8a16-g128": ("compressed-tensors", "int", "group", 128, None, "pack-quantized"),  # W8A16
    "fp8-dynamic": ("compressed-tensors", "float", "channel", None, "token", "float-quantized"),  # FP8_DYNAMIC
    "fp8-block": ("compressed-tensors", "float", "block", (128, 128), "group", "float-quantized"),  # FP8_BLOCK
    # the same formats, other granularities
    "int8-w8a16": ("compressed-tensors", "int", "channel", None, None, "pack-quantized"),
    "int8-naive": ("compressed-tensors", "int", "channel", None, None, "naive-quantized"),
    "fp8-tensor": ("compressed-tensors", "float", "tensor", None, "token", "float-quantized"),
    # DeepSeek-V3 / Qwen3-FP8
    "deepseek-fp8": ("fp8", "float", "block", (128, 128), "dynamic", None),
}


def is_linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """A 2-D `<module>.weight` that is not an embedding table: what llm-compressor's "Linear" target quantizes."""
    return name.endswith(".weight") and len(shape) == 2 and "embed" not in name.rsplit(".", 2)[-2]


def quantize_weight(w: np.ndarray, kind: str, strategy: str, block: tuple[int, int] | None = None,
                    scale_dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """A float [out, in] weight -> (int8 or float8_e4m3fn values, scales as compressed-tensors stores them: [1] for
    "tensor", [out, 1] "channel", [ceil(out / r), ceil(in / c)] for a (r, c) `block`; "group" g is block (1, g)).
    Scales are rounded to `scale_dtype` first and the values quantized against the rounded scales, so a reader's
    values * scales is this quantization exactly."""
    w = np.asarray(w, np.float32)
    out, k = w.shape
    rows, cols = {"tensor": (out, k), "channel": (1, k)}.get(strategy, block)
    grid = (math.ceil(out / rows), math.ceil(k / cols))
    padded = np.zeros((grid[0] * rows, grid[1] * cols), np.float32)
    padded[:out, :k] = np.abs(w)
    amax = padded.reshape(grid[0], rows, grid[1], cols).max(axis=(1, 3))
    scales = amax / np.float32(_INT8_HALF_RANGE if kind == "int" else _FP8_MAX)
    scales = np.where(scales == 0, np.finfo(np.float32).eps, scales).astype(scale_dtype)
    x = w / element_scales(scales.astype(np.float32), (rows, cols), w.shape)
    if kind == "int":
        values = np.clip(np.round(x), -128, 127).astype(INT8)
    else:
        values = np.clip(x, -_FP8_MAX, _FP8_MAX).astype(FP8_E4M3)
    return values, scales.reshape(1) if strategy == "tensor" else scales


def pack_int8(values: np.ndarray) -> np.ndarray:
    """compressed-tensors pack-quantized, 8 bits: four values (offset by 128) to an int32, element 0 lowest."""
    out, k = values.shape
    unsigned = np.zeros((out, 4 * math.ceil(k / 4)), np.uint8)
    unsigned[:, :k] = (values.astype(np.int16) + 128).astype(np.uint8)
    return unsigned.view("<i4").astype(np.int32)


def write_quantized_checkpoint(hf_dir: str, out_dir: str, scheme: str, *,
                               ignore: tuple[str, ...] = DEFAULT_IGNORE) -> None:
    """Rewrites the floating-point HF checkpoint `hf_dir` into `out_dir` with every Linear weight not matched by
    `ignore` (names or "re:" regexes) quantized by `scheme` (a key of SCHEMES); the shard layout, the other tensors
    and files are kept, and config.json gains the format's `quantization_config`."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r} (known: {', '.join(SCHEMES)})")
    method, kind, strategy, size, activations, fmt = SCHEMES[scheme]
    block = (1, size) if strategy == "group" else size
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    if "quantization_config" in config:
        raise ValueError(f"{hf_dir} is already quantized ({config['quantization_config'].get('quant_method')})")
    ckpt = SafetensorsCheckpoint(hf_dir)
    os.makedirs(out_dir, exist_ok=True)
    ignored, weight_map, total_bytes = set(), {}, 0
    for fname, names in _shards(hf_dir, ckpt).items():
        tensors = {}
        for name in names:
            w, module = ckpt.get(name), name.removesuffix(".weight")
            if not is_linear_weight(name, w.shape):
                tensors[name] = w
            elif any(name_matches(module, p) for p in ignore):
                ignored.add(module)
                tensors[name] = w
            elif strategy == "group" and w.shape[1] % size:
                raise ValueError(f"{name}: {w.shape[1]} input features are not a whole number of {size}-groups "
                                 f"(compressed-tensors' group strategy needs them)")
            else:
                # compressed-tensors keeps scales in the weight's dtype; DeepSeek-V3's scale_inv are float32.
                values, scales = quantize_weight(w, kind, strategy, block, np.float32 if method == "fp8" else w.dtype)
                tensors.update(_stored_tensors(module, values, scales, method, fmt))
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
        total_bytes += sum(t.nbytes for t in tensors.values())
    if os.path.exists(os.path.join(hf_dir, "model.safetensors.index.json")):
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, f, indent=2)
    for name in os.listdir(hf_dir):
        if not name.endswith(".safetensors") and name not in ("model.safetensors.index.json", "config.json") and \
                os.path.isfile(os.path.join(hf_dir, name)):
            shutil.copy(os.path.join(hf_dir, name), out_dir)
    config["quantization_config"] = _quantization_config(method, kind, strategy, block, activations, fmt,
                                                         sorted(ignored))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def _shards(hf_dir: str, ckpt: SafetensorsCheckpoint) -> dict[str, list[str]]:
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if not os.path.exists(index):
        return {"model.safetensors": ckpt.names()}
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    shards: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        shards.setdefault(fname, []).append(name)
    return shards


def _stored_tensors(module: str, values: np.ndarray, scales: np.ndarray, method: str, fmt: str | None) -> dict:
    if method == "fp8":
        return {f"{module}.weight": values, f"{module}.weight_scale_inv": scales}
    if fmt == "pack-quantized":
        return {f"{module}.weight_packed": pack_int8(values), f"{module}.weight_scale": scales,
                f"{module}.weight_shape": np.array(values.shape, np.int64)}
    return {f"{module}.weight": values, f"{module}.weight_scale": scales}


def _quantization_config(method, kind, strategy, block, activations, fmt, ignored: list[str]) -> dict:
    if method == "fp8":
        config = {"activation_scheme": activations, "fmt": "e4m3", "quant_method": "fp8",
                  "weight_block_size": list(block)}
        return {**config, "modules_to_not_convert": ignored} if ignored else config
    weights = {"dynamic": False, "group_size": block[1] if strategy == "group" else None, "num_bits": 8,
               "strategy": strategy, "symmetric": True, "type": kind}
    if strategy == "block":
        weights["block_structure"] = list(block)
    inputs = None
    if activations:
        inputs = {"dynamic": True, "group_size": 128 if activations == "group" else None, "num_bits": 8,
                  "strategy": activations, "symmetric": True, "type": kind}
    group = {"format": fmt, "input_activations": inputs, "output_activations": None, "targets": ["Linear"],
             "weights": weights}
    return {"config_groups": {"group_0": group}, "format": fmt, "global_compression_ratio": None, "ignore": ignored,
            "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "sparsity_config": {}, "transform_config": {}, "version": COMPRESSED_TENSORS_VERSION}


def main(argv):
    del argv
    flag = flags.FLAGS
    write_quantized_checkpoint(flag.hf_dir, flag.out, flag.scheme)
    print(f"wrote {flag.out} ({flag.scheme})")


if __name__ == "__main__":
    # Defined only when run as a program, so importing this module adds no global flags.
    flags.DEFINE_string("hf_dir", None, "floating-point HF checkpoint directory", required=True)
    flags.DEFINE_string("out", None, "output directory", required=True)
    flags.DEFINE_enum("scheme", "int8-w8a8", list(SCHEMES), "format and granularity")
    app.run(main)
