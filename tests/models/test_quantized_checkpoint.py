"""Pre-quantized checkpoints (models.quantized_checkpoint, models.quantized_checkpoint_writer): writer -> reader round
trips (values and scales exact), a named error for every refused scheme and malformed tensor, HF transformers'
decompression of our files equal to our dequantisation, and (after the model side lands) our logits against HF's."""
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers as tf
from safetensors.numpy import save_file

from models.quantized_checkpoint import (FP8_E4M3, INT8, CheckpointQuantization, QuantizedWeight, WeightScheme,
                                         element_scales, name_matches)
from models.quantized_checkpoint_writer import (DEFAULT_IGNORE, SCHEMES, is_linear_weight, quantize_weight,
                                                write_quantized_checkpoint)
from models.safetensors_io import CheckpointError, SafetensorsCheckpoint
from tests.support import hf_models
from tests.support.quantized_reference import (dequantized_weights, load_reference_model, quantization_of,
                                               reference_logits, reference_route, write_dequantized_checkpoint)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _llama(hidden, intermediate):
    return tf.LlamaConfig(**{**hf_models.COMMON, "hidden_size": hidden, "intermediate_size": intermediate})


# Sources: the parity families, plus Llamas whose dims are whole 128-blocks (256 / 384) or end in partial blocks
# (192 / 320), a bf16 one and a sharded one.
SOURCES = ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "llama-whole", "llama-partial",
           "llama-bf16", "llama-sharded")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("float")
    dirs = {f: hf_models.cached_dir(str(root), f) for f in hf_models.FAMILIES}
    dirs["llama-whole"] = hf_models.save_config(_llama(256, 384), root / "llama-whole")
    dirs["llama-partial"] = hf_models.save_config(_llama(192, 320), root / "llama-partial")
    dirs["llama-bf16"] = str(root / "llama-bf16")
    hf_models.save_hf_model("llama", dirs["llama-bf16"], dtype=torch.bfloat16)
    dirs["llama-sharded"] = str(root / "llama-sharded")
    hf_models.save_hf_model("llama", dirs["llama-sharded"], max_shard_size="40KB")
    return dirs


def _block_of(scheme):
    _, _, strategy, size, _, _ = SCHEMES[scheme]
    return (1, size) if strategy == "group" else size


def _scheme_for(family):
    """A scheme each source can take (group-128 needs whole groups: llama-whole only)."""
    return [s for s in SCHEMES if s != "int8-w8a16-g128" or family == "llama-whole"]


ROUND_TRIPS = [(f, s) for f in ("llama", "mixtral", "llama-partial") for s in _scheme_for(f)] + [
    ("llama-whole", "int8-w8a16-g128"), ("llama-whole", "deepseek-fp8"), ("qwen2_moe", "fp8-dynamic"),
    ("qwen3_moe", "int8-w8a16"), ("qwen2", "int8-w8a8"), ("llama-bf16", "int8-w8a8"), ("llama-bf16", "deepseek-fp8"),
    ("llama-sharded", "int8-w8a16"), ("llama-sharded", "fp8-block")]


@pytest.mark.parametrize("family,scheme", ROUND_TRIPS)
def test_writer_reader_round_trip(family, scheme, sources, tmp_path):
    """Each quantized Linear reads back as exactly what the writer quantized (values and canonical scales), within
    half a quantization step of the float weight; the rest is kept as is, and every written tensor is either kept
    or read for a quantized weight, so the loader's unused-tensor check can stay strict."""
    out = str(tmp_path / scheme)
    write_quantized_checkpoint(sources[family], out, scheme)
    method, kind, strategy, _, _, fmt = SCHEMES[scheme]
    block = _block_of(scheme)
    quant, ckpt, source = quantization_of(out), SafetensorsCheckpoint(out), SafetensorsCheckpoint(sources[family])
    assert quant.method == method and len(quant.groups) == 1 and quant.groups[0].strategy == strategy
    kept, read, quantized = set(), set(), 0
    for name in source.names():
        w, module = source.get(name), name.removesuffix(".weight")
        if not is_linear_weight(name, w.shape) or any(name_matches(module, p) for p in DEFAULT_IGNORE):
            if is_linear_weight(name, w.shape):
                assert quant.read_linear(ckpt, name) is None
            np.testing.assert_array_equal(ckpt.get(name), w)
            kept.add(name)
            continue
        got = quant.read_linear(ckpt, name)
        scale_dtype = np.float32 if method == "fp8" else w.dtype
        values, stored_scales = quantize_weight(w, kind, strategy, block, scale_dtype)
        assert got.values.dtype == (INT8 if kind == "int" else FP8_E4M3) and got.values.shape == w.shape
        np.testing.assert_array_equal(got.values.view(np.uint8), values.view(np.uint8))
        canonical = stored_scales.astype(np.float32)
        canonical = np.full(w.shape[0], canonical[0]) if strategy == "tensor" else \
            canonical.reshape(-1) if strategy == "channel" else canonical
        np.testing.assert_array_equal(got.scales, canonical)
        assert got.block == (None if strategy in ("tensor", "channel") else block)
        suffixes = {"fp8": ("weight", "weight_scale_inv"), "pack-quantized": ("weight_packed", "weight_shape",
                                                                              "weight_scale")}
        assert got.tensors == tuple(f"{module}.{s}" for s in suffixes.get(method, suffixes.get(fmt, (
            "weight", "weight_scale"))))
        _assert_within_a_step(got, w.astype(np.float32), kind)
        read.update(got.tensors)
        quantized += 1
    assert quantized >= 14
    assert set(ckpt.names()) == kept | read
    scale_dtypes = {ckpt.dtype_name(n) for n in ckpt.names() if n.endswith(("weight_scale", "weight_scale_inv"))}
    assert scale_dtypes == {"BF16" if family == "llama-bf16" and method != "fp8" else "F32"}
    if family == "llama-sharded":
        index = json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"]
        assert len(set(index.values())) > 3 and set(index) == set(ckpt.names())
        for scale in (n for n in index if n.endswith(".weight_scale")):
            module = scale.removesuffix(".weight_scale")
            assert index[scale] == index.get(f"{module}.weight", index.get(f"{module}.weight_packed"))


def _assert_within_a_step(got: QuantizedWeight, w: np.ndarray, kind: str):
    err = np.abs(got.dequantize() - w)
    scale = element_scales(got.scales, got.block, w.shape)
    if kind == "int":
        assert np.all(err <= scale * 0.5 * 1.001)
    else:  # e4m3: 3 mantissa bits (relative 2^-4), subnormal spacing 2^-9 of the scale
        assert np.all(err <= np.maximum(np.abs(w) * 2.0 ** -4, scale * 2.0 ** -10) * 1.01)


def test_block_scales_cover_their_tiles_partial_edges_included(sources, tmp_path):
    """192 x 320 weights in 128 x 128 blocks: a 2 x 3 scale grid whose last row and column cover 64 rows / columns;
    each tile dequantises with its own scale, and `output_scales` gives the [G, out] view of the transposed weight
    that the matmul's group-wise scale takes."""
    out = str(tmp_path / "q")
    write_quantized_checkpoint(sources["llama-partial"], out, "deepseek-fp8")
    quant, ckpt = quantization_of(out), SafetensorsCheckpoint(out)
    got = quant.read_linear(ckpt, "model.layers.0.mlp.up_proj.weight")  # [320, 192]
    assert got.scales.shape == (3, 2) and got.block == (128, 128) and got.group_size == 128
    values = got.values.astype(np.float32)
    expected = np.empty_like(values)
    for i in range(3):
        for j in range(2):
            tile = np.s_[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            expected[tile] = values[tile] * got.scales[i, j]
    np.testing.assert_array_equal(got.dequantize(), expected)
    _assert_output_layout(got)


@pytest.mark.parametrize("scheme", ["int8-w8a8", "fp8-tensor", "int8-w8a16-g128", "fp8-block"])
def test_output_scales_apply_to_the_transposed_weight(scheme, sources, tmp_path):
    out = str(tmp_path / "q")
    write_quantized_checkpoint(sources["llama-whole"], out, scheme)
    quant, ckpt = quantization_of(out), SafetensorsCheckpoint(out)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        _assert_output_layout(quant.read_linear(ckpt, name))


def _assert_output_layout(got: QuantizedWeight):
    """x @ dequant(w).T == sum over K-groups of x[:, group] @ (values.T[group] * output_scales[g]) (per channel:
    (x @ values.T) * output_scales)."""
    out, k = got.values.shape
    x = np.random.default_rng(0).standard_normal((3, k)).astype(np.float32)
    want = x @ got.dequantize().T
    kn = got.values.T.astype(np.float32)
    scales = got.output_scales()
    if got.group_size is None:
        assert scales.shape == (out,)
        result = (x @ kn) * scales
    else:
        g = got.group_size
        assert scales.shape == (-(-k // g), out)
        result = sum(x[:, i * g:(i + 1) * g] @ (kn[i * g:(i + 1) * g] * scales[i]) for i in range(scales.shape[0]))
    np.testing.assert_allclose(result, want, rtol=1e-5, atol=1e-5)


def test_group_strategy_needs_whole_groups(sources, tmp_path):
    with pytest.raises(ValueError, match="not a whole number of 128-groups"):
        write_quantized_checkpoint(sources["llama"], str(tmp_path / "q"), "int8-w8a16-g128")


# ----------------------------------------------------------------------------------------- refused schemes

def _ct(weights=None, fmt="int-quantized", **group):
    w = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"], "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {**w, **(weights or {})}, "input_activations": None, **group}}}


FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

REFUSED = [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}, "quant_method 'awq'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}, "quant_method 'gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "quant_method 'bitsandbytes'"),
    (_ct({"num_bits": 4, "strategy": "group", "group_size": 128}, "pack-quantized"), "4-bit int weights"),
    (_ct({"symmetric": False}), "asymmetric weights"),
    (_ct(fmt="nvfp4-pack-quantized"), "format 'nvfp4-pack-quantized'"),
    (_ct(fmt="dense"), "format 'dense'"),
    (_ct(fmt="marlin-24"), "format 'marlin-24'"),
    ({**_ct(), "sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config {'format': 'sparse-24-bitmask'}"),
    ({**_ct(), "transform_config": {"config_groups": {"u": {}}}}, "transform_config"),
    (_ct({"strategy": "tensor_group", "group_size": 16}), "weight strategy 'tensor_group'"),
    (_ct({"strategy": "group", "group_size": 128, "actorder": "group"}), "actorder 'group'"),
    (_ct({"dynamic": True}), "dynamic weight quantization"),
    (_ct({"strategy": "group", "group_size": None}), "group_size None"),
    (_ct({"strategy": "block", "block_structure": None}), "block_structure None"),
    (_ct({"type": "float"}, "pack-quantized"), "pack-quantized float weights"),
    (_ct(output_activations={"num_bits": 8, "type": "float", "strategy": "tensor"}), "output activation"),
    ({**_ct(), "config_groups": {"W8A8": ["Linear"]}}, "preset name"),
    ({**_ct(), "config_groups": {"group_0": {"targets": ["Linear"], "weights": None,
                                             "input_activations": {"num_bits": 8}}}}, "activation-only"),
    ({**FP8_BLOCK, "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({**FP8_BLOCK, "activation_scheme": "per-channel"}, "activation_scheme 'per-channel'"),
    ({**FP8_BLOCK, "weight_block_size": [128]}, "weight_block_size [128]"),
    ({**FP8_BLOCK, "expert_dtype": "fp4"}, "expert_dtype 'fp4'"),
    ({**FP8_BLOCK, "modules_to_convert": ["embed_tokens"]}, "modules_to_convert"),
]


@pytest.mark.parametrize("config,message", REFUSED, ids=[m for _, m in REFUSED])
def test_refused_schemes_name_themselves(config, message):
    with pytest.raises(CheckpointError, match="quantization_config") as err:
        CheckpointQuantization.from_config({"quantization_config": config})
    assert message in str(err.value)


def test_no_quantization_config_is_none():
    assert CheckpointQuantization.from_config({"model_type": "llama"}) is None


def test_a_released_llm_compressor_config_parses():
    """FP8_DYNAMIC as llm-compressor 0.x wrote it (every optional key spelled out, a "dense" sparsity record)."""
    args = {"actorder": None, "block_structure": None, "group_size": None, "num_bits": 8, "observer_kwargs": {},
            "symmetric": True, "type": "float"}
    config = {"quant_method": "compressed-tensors", "format": "float-quantized", "global_compression_ratio": 1.24,
              "ignore": ["lm_head"], "kv_cache_scheme": None, "quantization_status": "compressed",
              "sparsity_config": {"format": "dense", "global_sparsity": 0.14, "sparsity_structure": "unstructured"},
              "config_groups": {"group_0": {
                  "targets": ["Linear"], "output_activations": None,
                  "input_activations": {**args, "dynamic": True, "observer": None, "strategy": "token"},
                  "weights": {**args, "dynamic": False, "observer": "minmax", "strategy": "channel"}}}}
    quant = CheckpointQuantization.from_config({"quantization_config": config})
    assert quant.groups[0] == WeightScheme(FP8_E4M3, "channel", None, "dynamic float8 per-token", False, ("Linear",))
    assert quant.scheme_for("lm_head") is None and quant.scheme_for("model.layers.3.mlp.down_proj") is quant.groups[0]


# ----------------------------------------------------------------------------------------- malformed tensors

def _one_linear(tmp_path, config, tensors):
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    return CheckpointQuantization.from_config({"quantization_config": config}), SafetensorsCheckpoint(str(tmp_path))


W = "model.layers.0.mlp.up_proj"
INT_VALUES = np.arange(-12, 12, dtype=np.int8).reshape(4, 6)
FP8_VALUES = np.linspace(-2, 2, 24, dtype=np.float32).reshape(4, 6).astype(ml_dtypes.float8_e4m3fn)
ONES = np.ones((4, 1), np.float32)

MALFORMED = [
    (_ct(), {f"{W}.weight": INT_VALUES.astype(np.float32), f"{W}.weight_scale": ONES}, "has dtype F32, expected I8"),
    (_ct(), {f"{W}.weight": INT_VALUES, f"{W}.weight_scale": np.ones((4, 2), np.float32)}, "expected [4, 1]"),
    (_ct(), {f"{W}.weight": INT_VALUES, f"{W}.weight_scale": ONES.astype(np.int32)}, "has dtype I32"),
    (_ct(), {f"{W}.weight": INT_VALUES}, f"tensor '{W}.weight_scale' is missing"),
    (_ct(), {f"{W}.weight": INT_VALUES, f"{W}.weight_scale": ONES * np.nan}, "non-finite scales"),
    (_ct(), {f"{W}.weight": INT_VALUES, f"{W}.weight_scale": ONES, f"{W}.weight_zero_point": np.ones((4, 1), np.int8)},
     "non-zero zero points"),
    (_ct(fmt="pack-quantized"), {f"{W}.weight_packed": np.zeros((4, 1), np.int32), f"{W}.weight_scale": ONES,
                                 f"{W}.weight_shape": np.array([4, 6])}, "does not hold 8-bit values"),
    (_ct({"type": "float", "strategy": "block", "block_structure": [2, 4]}, "float-quantized"),
     {f"{W}.weight": FP8_VALUES, f"{W}.weight_scale": np.ones((2, 1), np.float32)}, "expected [2, 2] (2x4 blocks"),
    ({**FP8_BLOCK, "weight_block_size": [2, 4]}, {f"{W}.weight": FP8_VALUES, f"{W}.weight_scale_inv": ONES},
     "expected [2, 2]"),
    (FP8_BLOCK, {f"{W}.weight": FP8_VALUES.astype(np.float32), f"{W}.weight_scale_inv": ONES},
     "not stored as float8_e4m3fn"),
    (_ct(), {"lm_head.weight": INT_VALUES, "lm_head.weight_scale": ONES}, "it is on the ignore list"),
    (_ct(targets=["re:.*self_attn.*"]), {f"{W}.weight": INT_VALUES, f"{W}.weight_scale": ONES},
     "no config group targets it"),
]


@pytest.mark.parametrize("config,tensors,message", MALFORMED, ids=[m for _, _, m in MALFORMED])
def test_malformed_tensors_name_the_tensor(config, tensors, message, tmp_path):
    quant, ckpt = _one_linear(tmp_path, config, tensors)
    with pytest.raises(CheckpointError, match="tensor '") as err:
        quant.read_linear(ckpt, next(n for n in tensors if n.endswith(("weight", "weight_packed"))).removesuffix(
            "_packed"))
    assert message in str(err.value)


def test_zero_points_and_static_input_scales_are_read_past(tmp_path):
    """Older llm-compressor files keep all-zero weight_zero_point; the FP8 preset stores a static input_scale. Both
    are accounted for (`tensors`) and change nothing: our matmuls run the inputs unquantised."""
    config = _ct({"type": "float", "strategy": "tensor"}, "float-quantized",
                 input_activations={"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False})
    tensors = {f"{W}.weight": FP8_VALUES, f"{W}.weight_scale": np.array([0.5], np.float32),
               f"{W}.weight_zero_point": np.zeros((1,), np.int8), f"{W}.input_scale": np.array([3.0], np.float32)}
    quant, ckpt = _one_linear(tmp_path, config, tensors)
    assert quant.groups[0].activations == "static float8 per-tensor"
    got = quant.read_linear(ckpt, f"{W}.weight")
    assert set(got.tensors) == set(tensors)
    np.testing.assert_array_equal(got.scales, np.full(4, 0.5, np.float32))
    np.testing.assert_array_equal(got.dequantize(), FP8_VALUES.astype(np.float32) * 0.5)


def test_per_tensor_fp8_format(tmp_path):
    """quant_method fp8 without weight_block_size (AutoFP8): one scalar weight_scale per weight."""
    config = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    tensors = {f"{W}.weight": FP8_VALUES, f"{W}.weight_scale": np.array(0.25, np.float32),
               f"{W}.input_scale": np.array(1.0, np.float32), "lm_head.weight": np.ones((4, 6), np.float32)}
    quant, ckpt = _one_linear(tmp_path, config, tensors)
    got = quant.read_linear(ckpt, f"{W}.weight")
    assert got.block is None and set(got.tensors) == set(tensors) - {"lm_head.weight"}
    np.testing.assert_array_equal(got.dequantize(), FP8_VALUES.astype(np.float32) * 0.25)
    assert quant.read_linear(ckpt, "lm_head.weight") is None


def test_safetensors_reads_fp8(tmp_path):
    e4m3 = np.array([[-448, -1.5, 0, 0.015625, 448]], np.float32).astype(ml_dtypes.float8_e4m3fn)
    e5m2 = np.array([-57344, -1.5, 0, 2.0 ** -16], np.float32).astype(ml_dtypes.float8_e5m2)
    save_file({"a": e4m3, "b": e5m2}, str(tmp_path / "model.safetensors"))
    ckpt = SafetensorsCheckpoint(str(tmp_path))
    assert (ckpt.dtype_name("a"), ckpt.dtype_name("b")) == ("F8_E4M3", "F8_E5M2")
    np.testing.assert_array_equal(ckpt.get("a").astype(np.float32), e4m3.astype(np.float32))
    np.testing.assert_array_equal(ckpt.get("b").astype(np.float32), e5m2.astype(np.float32))


# ----------------------------------------------------------------------------------------- HF transformers

@pytest.mark.parametrize("family,scheme", [("llama", s) for s in _scheme_for("llama")] + [
    ("llama-whole", "int8-w8a16-g128"), ("llama-whole", "deepseek-fp8"), ("llama-partial", "fp8-block"),
    ("qwen2", "fp8-dynamic")])
def test_hf_decompresses_our_files_to_our_weights(family, scheme, sources, tmp_path):
    """transformers (with compressed-tensors, or its fine-grained fp8 on CPU) loads our files, and its float weights
    are our dequantisation, bit for bit."""
    out = str(tmp_path / scheme)
    write_quantized_checkpoint(sources[family], out, scheme)
    route = reference_route(out)
    assert route == ("fine-grained-fp8" if scheme == "deepseek-fp8" else "compressed-tensors")
    hf = load_reference_model(out).state_dict()
    ours = dequantized_weights(out)
    for name, value in ours.items():
        np.testing.assert_array_equal(hf[name].numpy(), value, err_msg=name)


@pytest.mark.parametrize("family,scheme", [(f, s) for f in ("mixtral", "qwen3_moe") for s in (
    "int8-w8a16", "fp8-dynamic", "fp8-block", "deepseek-fp8")])
def test_hf_decompresses_our_moe_files_to_our_weights(family, scheme, sources, tmp_path):
    """MoE: transformers fuses the experts, so the check is its logits against the HF float model holding our
    dequantised weights: the same weights give the same logits."""
    out = str(tmp_path / scheme)
    write_quantized_checkpoint(sources[family], out, scheme)
    assert reference_route(out) != "dequantized"
    ids = hf_models.random_prompt(16, 160, seed=2)
    np.testing.assert_allclose(reference_logits(out, ids), reference_logits(out, ids, route="dequantized"),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("family,scheme,route", [
    ("mixtral", "int8-w8a8", "dequantized"),  # transformers 5.24 drops unpacked int8 experts
    ("llama-partial", "deepseek-fp8", "dequantized"),  # partial 128-blocks: HF's fine-grained dequant splits evenly
    ("llama", "deepseek-fp8", "fine-grained-fp8"),  # every dim under one block
    ("llama", "int8-w8a8", "compressed-tensors")])
def test_reference_route(family, scheme, route, sources, tmp_path):
    out = str(tmp_path / scheme)
    write_quantized_checkpoint(sources[family], out, scheme)
    assert reference_route(out) == route


@pytest.mark.parametrize("family,scheme", [("llama", "int8-w8a8"), ("qwen2", "fp8-tensor"), ("mixtral", "int8-w8a16"),
                                           ("qwen3_moe", "deepseek-fp8"), ("llama-partial", "fp8-block")])
def test_our_float_model_on_the_dequantised_weights_matches_the_reference(family, scheme, sources, tmp_path):
    """The target of the parity test below is reachable: our model (today's float loader) on the dequantised weights
    gives HF's reference logits within 1e-4, so what is left to it is the quantized parameters and matmuls."""
    from models.weights import load_hf_model
    from serving.core.batch import SeqChunk
    from tests.support.paged_runner import PagedRunner
    out = str(tmp_path / scheme)
    write_quantized_checkpoint(sources[family], out, scheme)
    prompt = hf_models.random_prompt(24, 160, seed=1)
    runner = PagedRunner(load_hf_model(write_dequantized_checkpoint(out, str(tmp_path / "float"))), page_size=8)
    got = runner.token_logits([SeqChunk(prompt, 0, runner.alloc(len(prompt)))])
    np.testing.assert_allclose(got, reference_logits(out, prompt), rtol=0, atol=1e-4)


E2E = [("llama", s) for s in _scheme_for("llama")] + [
    (f, s) for f in ("qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe") for s in (
        "int8-w8a8", "fp8-dynamic", "deepseek-fp8")] + [
    ("llama-whole", "int8-w8a16-g128"), ("llama-whole", "fp8-block"),
    ("phi3", "int8-w8a8"), ("phi3", "deepseek-fp8")]  # fused qkv_proj / gate_up_proj: values and scales split


def test_partial_blocks_are_refused_by_name(sources, tmp_path):
    """Block-wise scales over an input dimension that is not whole blocks (HF's fine-grained fp8 cannot load these
    either): refused at load, naming the weight and the block."""
    from models.config import UnsupportedModelError
    from models.weights import load_hf_model
    out = str(tmp_path / "partial")
    write_quantized_checkpoint(sources["llama-partial"], out, "deepseek-fp8")
    with pytest.raises(UnsupportedModelError, match="q_proj: 192 input rows are not whole 128-row"):
        load_hf_model(out, dtype=jnp.float32)


@pytest.mark.parametrize("family,scheme", E2E)
def test_quantized_checkpoint_logits_match_hf(family, scheme, sources, tmp_path):
    """`models.weights.load_hf_model(path, dtype=float32)` on a pre-quantized checkpoint keeps the quantized Linear
    weights quantized (int8 / float8_e4m3fn values beside a float32 `<name>_scale`), and its prompt logits are HF's
    on the same weights (reference_route says how HF gets them) within 1e-4."""
    from flax import nnx

    from models.weights import load_hf_model
    from serving.core.batch import SeqChunk
    from tests.support.paged_runner import PagedRunner
    out = str(tmp_path / scheme)
    write_quantized_checkpoint(sources[family], out, scheme)
    prompt = hf_models.random_prompt(24, 160, seed=1)
    expected = reference_logits(out, prompt)
    model = load_hf_model(out, dtype=jnp.float32)
    params = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    quantized = [p for p, v in params.items() if v.dtype in (jnp.int8, jnp.float8_e4m3fn)]
    assert quantized and all(params[f"{p}_scale"].dtype == jnp.float32 for p in quantized)
    runner = PagedRunner(model, page_size=8)
    got = runner.token_logits([SeqChunk(prompt, 0, runner.alloc(len(prompt)))])
    err = float(np.max(np.abs(got - expected)))
    print(f"QUANTIZED PARITY {family} {scheme} ({reference_route(out)}): max |logit diff| {err:.2e}")
    assert err < 1e-4


@pytest.mark.e2e
def test_command_line(sources, tmp_path):
    out = str(tmp_path / "q")
    proc = subprocess.run([sys.executable, "-m", "models.quantized_checkpoint_writer", f"--hf_dir={sources['llama']}",
                           f"--out={out}", "--scheme=deepseek-fp8"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["quantization_config"] == {**FP8_BLOCK, "modules_to_not_convert": ["lm_head"]}
    assert os.path.exists(os.path.join(out, "generation_config.json"))
