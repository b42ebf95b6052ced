"""HF transformers' float32 logits on the weights of a pre-quantized checkpoint (`reference_logits`), by the best route
that runs on CPU (`reference_route`):

- "compressed-tensors": transformers + the compressed-tensors package decompress the checkpoint themselves
  (`CompressedTensorsConfig(dequantize=True)`): HF's own reading of the format, into a plain float model (no
  activation quantization, as our matmuls run the inputs unquantised). Not for MoE checkpoints with unpacked int8
  experts, which transformers 5.24 drops.
- "fine-grained-fp8": the `fp8` block format through `FineGrainedFP8Config(dequantize=True)` (its CPU route), used
  when every quantized weight is a whole number of blocks: HF splits a weight evenly over the scale grid, which is
  wrong (or refused) for a partial last block.
- "dequantized": otherwise, our dequantised weights (`QuantizedWeight.dequantize`) written as a float32 checkpoint
  and loaded into the HF float model: this checks the model, not the format reading."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings

import numpy as np
import torch
from safetensors.numpy import save_file

from models.quantized_checkpoint import CheckpointQuantization
from models.quantized_checkpoint_writer import is_linear_weight
from models.safetensors_io import SafetensorsCheckpoint


def quantization_of(ckpt_dir: str) -> CheckpointQuantization:
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        return CheckpointQuantization.from_config(json.load(f))


def dequantized_weights(ckpt_dir: str) -> dict[str, np.ndarray]:
    """Every tensor an HF float model loads, by name: quantized Linear weights dequantised to float32 by our reader,
    their scales and auxiliaries dropped, the rest as stored (as float32)."""
    quant, ckpt = quantization_of(ckpt_dir), SafetensorsCheckpoint(ckpt_dir)
    weights = {n.removesuffix("_packed") for n in ckpt.names() if n.endswith((".weight", ".weight_packed"))}
    out, read = {}, set()
    for name in sorted(weights):
        if is_linear_weight(name, ckpt.shape(name) if name in ckpt else (1, 1)):  # packed: 2-D by construction
            quantized = quant.read_linear(ckpt, name)
            if quantized is not None:
                out[name] = quantized.dequantize()
                read.update(quantized.tensors)
    for name in ckpt.names():
        if name not in read and name not in out:
            out[name] = ckpt.get(name).astype(np.float32)
    return out


def reference_route(ckpt_dir: str) -> str:
    quant, ckpt = quantization_of(ckpt_dir), SafetensorsCheckpoint(ckpt_dir)
    if quant.method == "compressed-tensors":
        # transformers 5.24 decompresses MoE experts only as fp8 `weight` or int `weight_packed`: unpacked int8
        # experts (int-quantized, naive-quantized) come out missing.
        unpacked_int8_experts = any(".experts." in n and ckpt.dtype_name(n) == "I8" for n in ckpt.names())
        return "dequantized" if unpacked_int8_experts else "compressed-tensors"
    rows, cols = quant.groups[0].block or (1, 1)
    fits = lambda dim, block: dim % block == 0 or dim < block  # noqa: E731
    whole_blocks = all(fits(ckpt.shape(n)[0], rows) and fits(ckpt.shape(n)[1], cols)
                       for n in ckpt.names() if ckpt.dtype_name(n) == "F8_E4M3")
    return "fine-grained-fp8" if whole_blocks else "dequantized"


def load_reference_model(ckpt_dir: str, route: str | None = None):
    """The HF float32 model on the checkpoint's quantized weights, by `route` (default: `reference_route`)."""
    import transformers as tf
    route = route or reference_route(ckpt_dir)
    kwargs = dict(dtype=torch.float32, attn_implementation="eager")
    if route in ("compressed-tensors", "fine-grained-fp8"):
        config = tf.CompressedTensorsConfig if route == "compressed-tensors" else tf.FineGrainedFP8Config
        with warnings.catch_warnings():  # "the model's quantization_config is used": all but `dequantize`, as meant
            warnings.filterwarnings("ignore", message="You passed `quantization_config`")
            return tf.AutoModelForCausalLM.from_pretrained(
                ckpt_dir, quantization_config=config(dequantize=True), **kwargs).eval()
    with tempfile.TemporaryDirectory() as float_dir:
        return tf.AutoModelForCausalLM.from_pretrained(write_dequantized_checkpoint(ckpt_dir, float_dir),
                                                       **kwargs).eval()


def write_dequantized_checkpoint(ckpt_dir: str, out_dir: str) -> str:
    """The checkpoint with our dequantised weights (`dequantized_weights`) as a float32 HF checkpoint in `out_dir`,
    without its quantization_config; returns `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    save_file(dequantized_weights(ckpt_dir), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    for name in os.listdir(ckpt_dir):
        if name.startswith(("tokenizer", "generation_config", "special_tokens")):
            shutil.copy(os.path.join(ckpt_dir, name), out_dir)
    return out_dir


def reference_logits(ckpt_dir: str, ids: list[int], route: str | None = None) -> np.ndarray:
    """HF's float32 logits [len(ids), vocab] for one prompt on the checkpoint's quantized weights."""
    model = load_reference_model(ckpt_dir, route)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()
