"""ModelConfig parsing: every family, and a named error for each unsupported architecture or option."""
import math

import pytest

from models.config import ModelConfig, UnsupportedModelError
from tests.support import hf_models


@pytest.mark.parametrize("family", hf_models.FAMILIES)
def test_parse_each_family(family):
    hf = hf_models.family_configs()[family]()
    d = hf.to_dict()
    arch = "Gemma3ForCausalLM" if family == "gemma3" else type(hf).__name__.replace("Config", "ForCausalLM")
    d["architectures"] = [arch]
    cfg = ModelConfig.from_hf(d)
    assert cfg.family == family
    assert cfg.num_layers == (3 if family == "gemma3" else 2) and cfg.vocab_size == 160
    assert cfg.is_moe == (family in ("mixtral", "qwen2_moe", "qwen3_moe"))
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def _llama(**over):
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
    base.update(over)
    return base


def test_legacy_rope_fields_and_llama3_scaling():
    cfg = ModelConfig.from_hf(_llama(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}))
    assert cfg.rope.rope_type == "llama3" and cfg.rope.theta == 500000.0 and cfg.rope.factor == 8.0


def test_qwen_sliding_window_only_when_enabled():
    base = dict(architectures=["Qwen2ForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=128,
                num_hidden_layers=4, num_attention_heads=4, sliding_window=32, max_window_layers=2)
    assert ModelConfig.from_hf(base).sliding_windows == (None,) * 4
    assert ModelConfig.from_hf({**base, "use_sliding_window": True}).sliding_windows == (None, None, 32, 32)


@pytest.mark.parametrize("over, needle", [
    (dict(architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "dynamic"),
    (dict(hidden_act="gelu"), "gelu"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(layer_types=["full_attention", "chunked_attention"], sliding_window=8), "chunked_attention"),
    (dict(torch_dtype="float8_e4m3fn"), "float8"),
])
def test_unsupported_option_is_named(over, needle):
    with pytest.raises(UnsupportedModelError, match=needle):
        ModelConfig.from_hf(_llama(**over))


def test_yarn_attention_factor_as_hf_computes_it():
    """Qwen2.5's long-context yarn (the factor's temperature), DeepSeek-V3's (mscale = mscale_all_dim: 1, kept for its
    softmax scale), an explicit attention_factor, and a missing factor (max / original positions)."""
    qwen = ModelConfig.from_hf(_llama(max_position_embeddings=131072, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})).rope
    assert (qwen.rope_type, qwen.factor, qwen.original_max_position_embeddings) == ("yarn", 4.0, 32768)
    assert qwen.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)
    assert (qwen.beta_fast, qwen.beta_slow, qwen.truncate) == (32, 1, True)
    deepseek = ModelConfig.from_hf(_llama(rope_scaling={
        "type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
        "original_max_position_embeddings": 4096})).rope
    assert deepseek.attention_factor == 1.0 and deepseek.mscale_all_dim == 1.0
    given = ModelConfig.from_hf(_llama(rope_parameters={
        "rope_type": "yarn", "factor": 2.0, "attention_factor": 0.9, "original_max_position_embeddings": 64}))
    assert given.rope.attention_factor == 0.9
    implied = ModelConfig.from_hf(_llama(max_position_embeddings=256, rope_parameters={
        "rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}))
    assert implied.rope.factor == 4.0


def _phi3(**over):
    return dict(architectures=["Phi3ForCausalLM"], vocab_size=100, hidden_size=96, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=131072,
                original_max_position_embeddings=4096, rope_theta=10000.0, **over)


def test_phi4_mini_longrope_past_its_original_context():
    """Phi-4-mini's config.json (legacy fields): longrope's short and long factors and attention factor, a quarter of
    each 24-wide head not rotated, and the whole context served (no longer capped at the original 4096 positions)."""
    cfg = ModelConfig.from_hf(_phi3(partial_rotary_factor=0.75, rope_scaling={
        "type": "longrope", "short_factor": [1.0] * 8 + [2.0], "long_factor": [4.0] * 9}))
    assert cfg.family == "phi3" and cfg.rope.rope_type == "longrope" and cfg.rope.partial_rotary_factor == 0.75
    assert cfg.rope.short_factor == (1.0,) * 8 + (2.0,) and cfg.rope.long_factor == (4.0,) * 9
    assert cfg.max_position_embeddings == 131072 and cfg.rope.original_max_position_embeddings == 4096
    assert cfg.rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    with pytest.raises(UnsupportedModelError, match=r"long_factor \[4.0\] \(expected a list of 9 numbers"):
        ModelConfig.from_hf(_phi3(partial_rotary_factor=0.75, rope_scaling={
            "type": "longrope", "short_factor": [1.0] * 9, "long_factor": [4.0]}))
    with pytest.raises(UnsupportedModelError, match=r"short_factor \[1.0, 2.0\] \(expected a list of 9 numbers"):
        ModelConfig.from_hf(_phi3(partial_rotary_factor=0.75, rope_scaling={
            "type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [4.0] * 9}))
    with pytest.raises(UnsupportedModelError, match="'linear' for Phi-3"):
        ModelConfig.from_hf(_phi3(rope_scaling={"type": "linear", "factor": 2.0}))
    assert ModelConfig.from_hf(_phi3(rope_scaling=None)).max_position_embeddings == 131072  # plain RoPE: as given


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(str(tmp_path))
