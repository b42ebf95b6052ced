"""Small random-weight HF models of every supported family, saved with `save_pretrained` for parity tests."""
from __future__ import annotations

import os

import torch

COMMON = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.08,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)


def family_configs():
    import transformers as tf
    return {
        "llama": lambda: tf.LlamaConfig(**COMMON, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "mistral": lambda: tf.MistralConfig(**COMMON, sliding_window=24),
        "qwen2": lambda: tf.Qwen2Config(**{**COMMON, "num_key_value_heads": 1}, tie_word_embeddings=True),
        "qwen3": lambda: tf.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False),
        "mixtral": lambda: tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=48, shared_expert_intermediate_size=80,
                                               norm_topk_prob=False, decoder_sparse_step=1,
                                               mlp_only_layers=[1]),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=48, norm_topk_prob=True, head_dim=16),
    }


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")


def build_hf_model(family: str, seed: int = 0, dtype=torch.float32):
    import transformers as tf
    torch.manual_seed(seed)
    cfg = family_configs()[family]()
    cfg._attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="eager")
    model.eval()
    return model


def save_hf_model(family: str, out_dir: str, seed: int = 0, dtype=torch.float32, max_shard_size=None):
    model = build_hf_model(family, seed, dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return model


def random_prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def hf_logits(model, prompt: list[int]):
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().numpy()


def cached_dir(tmp_root: str, family: str, **kw) -> str:
    d = os.path.join(tmp_root, family)
    if not os.path.exists(os.path.join(d, "config.json")):
        save_hf_model(family, d, **kw)
    return d


def save_config(config, out_dir: str, seed: int = 0) -> str:
    """A random-weight HF model of `config` (a transformers config) saved to `out_dir`; returns the directory."""
    import transformers as tf
    torch.manual_seed(seed)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    return str(out_dir)
