"""Gemma 3 beyond the families' parity (tests/models/test_model_parity.py runs it there): each of its parts matters to
the result, a Gemma3ForConditionalGeneration checkpoint (both tensor layouts) serves its language model, the published
configs parse to their shapes, and what is not implemented is refused by name at load."""
import dataclasses
import json
import os

import numpy as np
import pytest
import torch
import transformers as tf
from safetensors.numpy import load_file, save_file

from models.config import ModelConfig, UnsupportedModelError
from models.weights import load_hf_model
from serving import ledger
from serving.core.batch import SeqChunk
from tests.support import hf_models
from tests.support.paged_runner import PagedRunner

PROMPT = hf_models.random_prompt(40, 160, seed=1)


def _logits(model, prompt=PROMPT):
    runner = PagedRunner(model, page_size=8)
    return runner.token_logits([SeqChunk(prompt, 0, runner.alloc(len(prompt)))])


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    d = hf_models.cached_dir(str(tmp_path_factory.mktemp("gemma3")), "gemma3")
    hf = tf.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
    return d, hf_models.hf_logits(hf, PROMPT)


@pytest.mark.parametrize("change", [
    dict(sliding_windows=(None, None, None)),  # the local layers' window
    dict(rope_local=None),  # their own RoPE base (the global layers' scaled one instead)
    dict(query_pre_attn_scalar=None),  # 1 / sqrt(head_dim) instead of 1 / sqrt(24)
    dict(final_logit_softcapping=None),
], ids=["window", "local_rope", "query_pre_attn_scalar", "final_softcap"])
def test_each_part_matters(gemma3, change):
    """The parity of test_model_parity covers each part only if leaving it out changes the logits."""
    path, ref = gemma3
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.sliding_windows == (12, None, 12) and cfg.rope_local.theta == 100.0 and cfg.rope.factor == 2.0
    got = _logits(load_hf_model(path, config=dataclasses.replace(cfg, **change)))
    assert np.max(np.abs(got - ref)) > 1e-3


def _conditional_generation(root: str) -> tuple[str, torch.nn.Module]:
    """A tiny Gemma3ForConditionalGeneration (SigLIP tower of one layer) saved to `root`, and the HF model."""
    torch.manual_seed(0)
    text = hf_models.family_configs()["gemma3"]()
    text.final_logit_softcapping = None  # Gemma3ForConditionalGeneration does not apply it (refused: below)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=28, patch_size=14)
    cfg = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=150,
                          boi_token_index=151, eoi_token_index=152)
    model = tf.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "language_model" in name:
                p.add_(0.2 * torch.randn(p.shape))
    model.save_pretrained(root)
    return root, model


def test_conditional_generation_checkpoint_serves_its_language_model(tmp_path):
    path, hf = _conditional_generation(str(tmp_path / "published"))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([PROMPT])).logits[0].float().numpy()
    names = load_file(os.path.join(path, "model.safetensors"))
    assert "language_model.model.embed_tokens.weight" in names and any(n.startswith("vision_tower.") for n in names)
    # transformers 5's in-memory layout, as some conversions save it: model.language_model.X, model.vision_tower.X
    other = str(tmp_path / "renamed")
    os.makedirs(other)
    renamed = {("model.language_model." + n.removeprefix("language_model.model.")
                if n.startswith("language_model.model.") else "model." + n): v for n, v in names.items()}
    save_file(renamed, os.path.join(other, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(other, "config.json"), "w") as f:
        json.dump(config, f)
    assert "model.language_model.embed_tokens.weight" in renamed and "model.vision_tower.head.probe" in renamed
    for d in (path, other):
        model = load_hf_model(d)
        assert model.config.family == "gemma3" and model.config.sliding_windows == (12, None, 12)
        np.testing.assert_allclose(_logits(model), ref, atol=1e-4, rtol=1e-4)


GEMMA3_27B = ledger.PRESETS["gemma-3-27b"][1]


def test_published_configs_parse_to_their_shapes():
    """Gemma 3 27B (Gemma3ForConditionalGeneration, its text_config names only what differs from the defaults) and
    1B (Gemma3ForCausalLM, legacy rope fields)."""
    big = ModelConfig.from_hf(GEMMA3_27B)
    assert (big.num_layers, big.hidden_size, big.num_heads, big.num_kv_heads, big.head_dim) == (62, 5376, 32, 16, 128)
    assert [i for i, w in enumerate(big.sliding_windows) if w is None] == list(range(5, 62, 6))
    assert set(big.sliding_windows) == {1024, None} and big.query_pre_attn_scalar == 168
    assert (big.rope.rope_type, big.rope.factor, big.rope.theta) == ("linear", 8.0, 1e6)
    assert (big.rope_local.rope_type, big.rope_local.theta) == ("default", 10000.0)
    assert big.tie_word_embeddings and big.vocab_size == 262208 and big.eos_token_ids == (1, 106)
    small = ModelConfig.from_hf({
        "architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": None, "bos_token_id": 2,
        "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
        "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
        "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "vocab_size": 262144})
    assert small.sliding_windows.count(None) == 4 and small.rope.rope_type == "default" and small.num_kv_heads == 1
    assert ModelConfig.from_dict(big.to_dict()) == big


@pytest.mark.parametrize("change, needle", [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]), "chunked_attention"),
    (dict(rope_parameters={"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), "dynamic"),
])
def test_unsupported_options_fail_at_load_named(change, needle):
    hf = {**hf_models.family_configs()["gemma3"]().to_dict(), "architectures": ["Gemma3ForCausalLM"], **change}
    with pytest.raises(UnsupportedModelError, match=needle):
        ModelConfig.from_hf(hf)
    with pytest.raises(UnsupportedModelError, match="text_config"):
        ModelConfig.from_hf({"architectures": ["Gemma3ForConditionalGeneration"], "vision_config": {}})
    with pytest.raises(UnsupportedModelError, match="final_logit_softcapping=30.0 in a Gemma3ForConditional"):
        ModelConfig.from_hf({**GEMMA3_27B, "text_config": {**GEMMA3_27B["text_config"],
                                                           "final_logit_softcapping": 30.0}})
