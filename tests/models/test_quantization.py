"""Quantized weights (models.quant): the format's round trip, quantise-at-load against HF on the same quantised
weights for every family, Orbax round trip, and the shipped tiny model's held-out perplexity against float."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from models.quant import QMAX, WeightQuant, dequantize, quantize
from models.weights import load_hf_model, load_model, save_orbax
from serving.core.batch import SeqChunk
from tests.support import hf_models
from tests.support.paged_runner import PagedRunner
from tests.support.quant import fake_quantize_hf


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("group", [0, 16])
def test_quantize_round_trip_error_is_bounded(kind, group):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 40, 24)).astype(np.float32)  # lead 3, K 40 (not whole 16-row groups), N 24
    w[1, :, 5] = 0.0  # an all-zero channel
    quant = WeightQuant(kind, group)
    values, scale = quantize(w, (1,), quant)
    assert values.dtype == quant.dtype and values.shape == w.shape
    assert scale.shape == ((3, 3, 24) if group else (3, 24))
    back = dequantize(values, scale, (1,), group)
    assert np.all(back[1, :, 5] == 0) and np.all(np.isfinite(back))
    # per element: half a step of int8, or e4m3's 3 mantissa bits (2^-4 relative) of the block's absmax
    blocks = np.pad(np.abs(w), ((0, 0), (0, (-40) % (group or 40)), (0, 0))).reshape(3, -1, group or 40, 24)
    amax = np.repeat(blocks.max(axis=2), group or 40, axis=1)[:, :40]
    bound = amax / QMAX[kind] * 0.5 if kind == "int8" else np.maximum(np.abs(w) * 2.0 ** -4, amax / 448 * 2.0 ** -9)
    assert np.all(np.abs(back - w) <= bound * (1 + 1e-6) + 1e-12)
    # jax.numpy gives the same values
    jv, js = quantize(jnp.asarray(w), (1,), quant, xp=jnp)
    np.testing.assert_array_equal(np.asarray(jv).astype(np.float32), values.astype(np.float32))
    np.testing.assert_allclose(np.asarray(js), scale, rtol=1e-6)


def _logits(model, prompt):
    runner = PagedRunner(model, page_size=8)
    return runner.token_logits([SeqChunk(prompt, 0, runner.alloc(len(prompt)))])


@pytest.mark.parametrize("family", hf_models.FAMILIES)
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_at_load_matches_hf_on_the_same_quantized_weights(family, kind, tmp_path_factory):
    d = hf_models.cached_dir(str(tmp_path_factory.getbasetemp() / "quant_hf"), family)
    model = load_hf_model(d, quantization=kind)
    assert model.config.quantization == kind
    attn = model.layers[0].self_attn
    assert attn.q_proj[...].dtype == jnp.dtype(WeightQuant(kind).dtype)
    assert attn.q_proj_scale[...].shape == attn.q_proj.shape[1:]
    hf = hf_models.build_hf_model(family)
    replaced = fake_quantize_hf(hf, WeightQuant(kind))
    # q, k, v, o and the MLP (or the experts, fused or not); Phi-3's qkv_proj and gate_up_proj are one weight each
    assert len(replaced) >= (4 if family == "phi3" else 6) * model.config.num_layers
    prompt = hf_models.random_prompt(20, 160, seed=3)
    ours = _logits(model, prompt)
    ref = hf_models.hf_logits(hf, prompt)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)


def test_orbax_keeps_weights_quantized(tmp_path, tmp_path_factory):
    d = hf_models.cached_dir(str(tmp_path_factory.getbasetemp() / "quant_hf"), "qwen2_moe")
    model = load_hf_model(d, quantization="int8")
    save_orbax(model, str(tmp_path / "orbax"), hf_dir=d)
    restored = load_model(str(tmp_path / "orbax"))
    assert restored.config.quantization == "int8"
    assert restored.layers[0].mlp.gate_proj[...].dtype == jnp.int8
    prompt = hf_models.random_prompt(12, 160, seed=4)
    np.testing.assert_array_equal(_logits(restored, prompt), _logits(model, prompt))
    with pytest.raises(ValueError, match="holds int8 weights"):
        load_model(str(tmp_path / "orbax"), quantization="fp8")


def test_unknown_quantization_is_refused(tmp_path_factory):
    d = hf_models.cached_dir(str(tmp_path_factory.getbasetemp() / "quant_hf"), "llama")
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_hf_model(d, quantization="int4")


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_group_wise_scales_match_hf_on_the_same_quantized_weights(family, tmp_path_factory):
    """Scales per 16 K rows (the block-wise fp8 layout's granularity, smaller), through every matmul kind."""
    from models.config import ModelConfig
    d = hf_models.cached_dir(str(tmp_path_factory.getbasetemp() / "quant_hf"), family)
    cfg = dataclasses.replace(ModelConfig.from_pretrained(d), quantization="fp8", quantization_group=16)
    model = load_hf_model(d, config=cfg)
    assert model.layers[0].self_attn.o_proj_scale.shape == (4, 64)  # K = 4 heads x 16 -> 4 groups; N = 64
    hf = hf_models.build_hf_model(family)
    fake_quantize_hf(hf, WeightQuant("fp8", 16))
    prompt = hf_models.random_prompt(20, 160, seed=3)
    np.testing.assert_allclose(_logits(model, prompt), hf_models.hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)


def test_tiny_model_heldout_perplexity_with_quantized_weights_and_kv():
    """Quantise-at-load and a quantized KV cache on the shipped tiny model: held-out perplexity within 1% of float
    with int8 weights, within 2% with an int8 / fp8 KV cache too; the held-out next tokens (argmax) equal to
    float's reported."""
    from tests.support.tiny import heldout_perplexity, heldout_windows, model_dir
    windows, seq_len = heldout_windows("target")
    cells = [("none", "auto"), ("int8", "auto"), ("fp8", "auto"), ("none", "int8"), ("none", "fp8_e4m3"),
             ("int8", "int8"), ("int8", "fp8_e4m3")]
    ppl, top1, models = {}, {}, {}
    for weights, kv in cells:
        if weights not in models:
            models[weights] = load_hf_model(model_dir("target"), quantization=weights)
        # The argmax of the perplexity's own logits (one program per cell; a greedy decode compiled a second).
        top1[weights, kv] = []
        ppl[weights, kv] = heldout_perplexity(PagedRunner(models[weights], page_size=16, num_pages=seq_len // 16 + 16,
                                                          max_pages=seq_len // 16, kv_cache_dtype=kv), windows,
                                              top1[weights, kv])
    base = ("none", "auto")
    for cell in cells:
        agree = np.mean(np.concatenate(top1[cell]) == np.concatenate(top1[base]))
        print(f"QUANT tiny target, weights {cell[0]}, KV {cell[1]}: held-out ppl {ppl[cell]:.4f} "
              f"({ppl[cell] / ppl[base] - 1:+.2%}), held-out next tokens (argmax) equal to float {agree:.1%}")
    assert abs(ppl["int8", "auto"] / ppl[base] - 1) < 0.01
    for cell in cells[2:]:
        assert abs(ppl[cell] / ppl[base] - 1) < 0.02, cell
