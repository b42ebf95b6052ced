"""ModelConfig parsing: every family, and a named error for each unsupported architecture or option."""
import pytest

from models.config import ModelConfig, UnsupportedModelError
from tests.support import hf_models


@pytest.mark.parametrize("family", hf_models.FAMILIES)
def test_parse_each_family(family):
    hf = hf_models.family_configs()[family]()
    d = hf.to_dict()
    d["architectures"] = [type(hf).__name__.replace("Config", "ForCausalLM")]
    cfg = ModelConfig.from_hf(d)
    assert cfg.family == family
    assert cfg.num_layers == 2 and cfg.vocab_size == 160
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
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
    (dict(hidden_act="gelu"), "gelu"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(layer_types=["full_attention", "chunked_attention"], sliding_window=8), "chunked_attention"),
    (dict(torch_dtype="float8_e4m3fn"), "float8"),
])
def test_unsupported_option_is_named(over, needle):
    with pytest.raises(UnsupportedModelError, match=needle):
        ModelConfig.from_hf(_llama(**over))


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(str(tmp_path))
