"""DeepSeek-V2 / V3 (multi-head latent attention, DeepSeek MoE) against HF transformers, torch CPU, float32: prompt
logits whole and in 5-token chunks beside another sequence, 32 greedy steps through the paged latent cache, YaRN
positions past the original context; each part of the model shown to matter; the config's refusals by name."""
import dataclasses
import json

import numpy as np
import pytest

from models.config import ModelConfig, UnsupportedModelError
from models.weights import load_hf_model
from serving.core.batch import SeqChunk
from tests.support import hf_models
from tests.support.paged_runner import PagedRunner

PROMPT_LEN, DECODE_STEPS = 40, 32


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("deepseek"))
    return {f: hf_models.cached_dir(root, f) for f in hf_models.MLA_FAMILIES}


def _hf(path):
    import transformers as tf
    return tf.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def _prompt():
    return hf_models.random_prompt(PROMPT_LEN, 160, seed=1)


@pytest.mark.parametrize("family", hf_models.MLA_FAMILIES)
def test_prompt_logits_match_hf(family, hf_dirs):
    hf = _hf(hf_dirs[family])
    prompt = _prompt()
    ref = hf_models.hf_logits(hf, prompt)
    cfg = ModelConfig.from_pretrained(hf_dirs[family])
    assert cfg.is_mla and cfg.rope.original_max_position_embeddings == 16  # the prompt runs 24 positions past it
    runner = PagedRunner(load_hf_model(hf_dirs[family]), page_size=8)
    assert runner.kv[0].shape == (128, 8, 1, 48)  # one latent row per token: kv_lora_rank 32 + RoPE key 16
    err, err_chunked = runner.prefill_errors(prompt, ref)
    print(f"PARITY {family}: max |logit diff| full prefill {err:.2e}, chunked {err_chunked:.2e}")
    assert err < 1e-4 and err_chunked < 1e-4


@pytest.mark.parametrize("family", hf_models.MLA_FAMILIES)
def test_greedy_decode_matches_hf_generate(family, hf_dirs):
    hf = _hf(hf_dirs[family])
    prompts = [hf_models.random_prompt(PROMPT_LEN, 160, seed=s) for s in (2, 3)]
    prompts.append(hf_models.random_prompt(7, 160, seed=4))
    expected = [hf_models.hf_greedy(hf, p, DECODE_STEPS) for p in prompts]
    runner = PagedRunner(load_hf_model(hf_dirs[family]), page_size=8, num_pages=64)
    # Staggered starts and 16-token prefill chunks: steps mix prefill chunks with decode tokens; 72 positions go
    # past the 16 original ones (YaRN) and the 64 of deepseek_v2's max_position_embeddings. Every step padded to one
    # shape (at most 16 + 16 + 7 tokens of 3 sequences): one compile instead of one per bucket.
    assert runner.generate(prompts, DECODE_STEPS, chunk=16, num_tokens=40, num_seqs=4) == expected


def _zero_routing_bias(model):
    for layer in model.layers:
        if hasattr(layer.mlp, "e_score_correction_bias"):
            layer.mlp.e_score_correction_bias.set_value(layer.mlp.e_score_correction_bias[...] * 0)
    return model


# Each part the parity above covers, changed: the prompt logits then differ from HF's.
CHANGES = {
    "softmax scale without mscale_all_dim": ("deepseek_v2", lambda c: dataclasses.replace(
        c, rope=dataclasses.replace(c.rope, mscale_all_dim=0.0)), None),
    "rope without yarn": ("deepseek_v3", lambda c: dataclasses.replace(
        c, rope=dataclasses.replace(c.rope, rope_type="default")), None),
    "rope pairs not de-interleaved": ("deepseek_v3", lambda c: dataclasses.replace(c, rope_interleave=False), None),
    "ungrouped routing": ("deepseek_v2", lambda c: dataclasses.replace(c, topk_method="greedy"), None),
    "no routed_scaling_factor": ("deepseek_v3", lambda c: dataclasses.replace(c, routed_scaling_factor=1.0), None),
    "no routing bias": ("deepseek_v3", None, _zero_routing_bias),
}


@pytest.mark.parametrize("change", CHANGES)
def test_each_part_is_exercised(change, hf_dirs):
    family, edit_config, edit_model = CHANGES[change]
    cfg = ModelConfig.from_pretrained(hf_dirs[family])
    model = load_hf_model(hf_dirs[family], config=edit_config(cfg) if edit_config else cfg)
    runner = PagedRunner(edit_model(model) if edit_model else model, page_size=8)
    got = runner.token_logits([SeqChunk(_prompt(), 0, runner.alloc(PROMPT_LEN))])
    assert np.max(np.abs(got - hf_models.hf_logits(_hf(hf_dirs[family]), _prompt()))) > 1e-3


def test_rope_in_rotate_half_order_matches_hf(tmp_path):
    """A V3 checkpoint whose config says rope_interleave=false (HF's rotate-half rotation) loads as it is."""
    import transformers as tf
    config = hf_models.family_configs()["deepseek_v3"]()
    config.rope_interleave = False
    path = hf_models.save_config(config, tmp_path / "v3")
    assert not ModelConfig.from_pretrained(path).rope_interleave
    runner = PagedRunner(load_hf_model(path), page_size=8)
    got = runner.token_logits([SeqChunk(_prompt(), 0, runner.alloc(PROMPT_LEN))])
    hf = tf.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert np.max(np.abs(got - hf_models.hf_logits(hf, _prompt()))) < 1e-4


def _v3(**over):
    base = hf_models.family_configs()["deepseek_v3"]().to_dict()
    base["architectures"] = ["DeepseekV3ForCausalLM"]
    return {**base, **over}


def test_config_reads_deepseek_fields():
    cfg = ModelConfig.from_hf(_v3())
    assert (cfg.family, cfg.kv_lora_rank, cfg.q_lora_rank, cfg.head_dim, cfg.num_kv_heads) == \
        ("deepseek_v3", 32, 48, 32, 4)
    assert (cfg.scoring_func, cfg.topk_method, cfg.n_group, cfg.topk_group) == ("sigmoid", "noaux_tc", 4, 2)
    assert cfg.moe_layers == (False, True) and not cfg.shared_expert_gate
    assert cfg.shared_expert_intermediate_size == 32 and cfg.routed_scaling_factor == 2.5
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    # DeepSeek's MoE layer rule: from first_k_dense_replace on, every moe_layer_freq-th layer
    freq = ModelConfig.from_hf(_v3(num_hidden_layers=6, moe_layer_freq=2, first_k_dense_replace=1))
    assert freq.moe_layers == (False, False, True, False, True, False)
    v2 = hf_models.family_configs()["deepseek_v2"]().to_dict()
    cfg2 = ModelConfig.from_hf({**v2, "architectures": ["DeepseekV2ForCausalLM"]})
    assert (cfg2.q_lora_rank, cfg2.scoring_func, cfg2.topk_method, cfg2.rope_interleave) == \
        (0, "softmax", "group_limited_greedy", True)


@pytest.mark.parametrize("over, needle", [
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    (dict(topk_method="group_limited_greedy"), "topk_method='group_limited_greedy'"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(kv_lora_rank=None), "kv_lora_rank=None"),
    (dict(n_group=3), "n_group=3"),
    (dict(topk_group=1, num_experts_per_tok=3), "topk_group=1"),
    (dict(ep_size=4), "ep_size=4"),
    (dict(architectures=["DeepseekV2ForCausalLM"], norm_topk_prob=True, topk_method="greedy",
          scoring_func="softmax"), "norm_topk_prob"),
    (dict(architectures=["DeepseekV2ForCausalLM"], topk_method="noaux_tc", scoring_func="softmax"), "noaux_tc"),
])
def test_unsupported_deepseek_option_is_named(over, needle):
    with pytest.raises((UnsupportedModelError, ValueError), match=needle):
        ModelConfig.from_hf(_v3(**over))


def test_next_token_prediction_layers_are_skipped(tmp_path, hf_dirs):
    """A V3 checkpoint's multi-token-prediction layer (model.layers.<num_hidden_layers>.*, a draft module) loads past;
    any other tensor the model does not use still fails the load."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from models.safetensors_io import CheckpointError
    path = tmp_path / "mtp"
    shutil.copytree(hf_dirs["deepseek_v3"], path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.2.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    save_file(tensors, path / "model.safetensors")
    assert load_hf_model(str(path)).config.num_layers == 2
    tensors["model.layers.1.self_attn.stray.weight"] = np.zeros((4,), np.float32)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="stray"):
        load_hf_model(str(path))
    assert json.loads((path / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_block_fp8_checkpoint_as_v3_ships_it(hf_dirs, tmp_path):
    """DeepSeek-V3's own format (quant_method fp8, 128 x 128 blocks, weight_scale_inv): the attention's projections,
    the shared and routed experts stay float8 with their block scales, kv_b_proj (read by the absorption einsums) is
    dequantised at load, and the prompt logits are HF's on the same weights."""
    import jax.numpy as jnp
    from flax import nnx

    from models.quantized_checkpoint_writer import write_quantized_checkpoint
    from tests.support.quantized_reference import reference_logits, reference_route
    out = str(tmp_path / "fp8")
    write_quantized_checkpoint(hf_dirs["deepseek_v3"], out, "deepseek-fp8")
    model = load_hf_model(out, dtype=jnp.float32)
    params = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
        assert params[f"layers/1/self_attn/{name}"].dtype == jnp.float8_e4m3fn, name
        assert params[f"layers/1/self_attn/{name}_scale"].dtype == jnp.float32, name
    assert params["layers/1/self_attn/kv_b_proj"].dtype == jnp.float32
    assert params["layers/1/mlp/gate_proj"].dtype == params["layers/1/mlp/shared_expert/up_proj"].dtype == \
        jnp.float8_e4m3fn
    prompt = _prompt()
    runner = PagedRunner(model, page_size=8)
    got = runner.token_logits([SeqChunk(prompt, 0, runner.alloc(PROMPT_LEN))])
    err = float(np.max(np.abs(got - reference_logits(out, prompt))))
    print(f"QUANTIZED PARITY deepseek_v3 deepseek-fp8 ({reference_route(out)}): max |logit diff| {err:.2e}")
    assert err < 1e-4
