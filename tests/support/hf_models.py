"""Small random-weight HF models of every supported family, saved with `save_pretrained` for parity tests."""
from __future__ import annotations

import os

import torch

COMMON = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.08,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)


# DeepSeek-V2 / V3 (multi-head latent attention, DeepSeek MoE), tiny: latent 32 + RoPE key 16 = a 48-value cache row
MLA = {**COMMON, "num_key_value_heads": None, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
       "qk_nope_head_dim": 16, "n_routed_experts": 8, "moe_intermediate_size": 32, "num_experts_per_tok": 2,
       "first_k_dense_replace": 1}


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
        # Phi-3-mini-4k / Phi-4: fused qkv_proj and gate_up_proj, plain RoPE, a sliding window on every layer.
        "phi3": lambda: tf.Phi3Config(**COMMON, sliding_window=24),
        # Phi-4-mini: longrope (short factors and the attention factor of max / original positions 512 / 128),
        # a quarter of each head not rotated, tied embeddings.
        "phi4_mini": lambda: tf.Phi3Config(**COMMON, tie_word_embeddings=True, original_max_position_embeddings=128,
                                           rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                            "partial_rotary_factor": 0.75,
                                                            "short_factor": [1.0, 1.1, 1.3, 1.8, 2.5, 3.0],
                                                            "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0]}),
        # Phi-3-mini-128k's longrope from 16 original positions to 64: short factors within them, long ones (and
        # the same attention factor) for a sequence past them; the whole 16-wide head rotated.
        "phi3_longrope": lambda: tf.Phi3Config(
            **{**COMMON, "max_position_embeddings": 64}, original_max_position_embeddings=16,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                             "short_factor": [1.0, 1.0, 1.1, 1.2, 1.4, 1.7, 2.0, 2.5],
                             "long_factor": [1.0, 1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 12.0]}),
        # Gemma 3: local (window 12) and global layers interleaved, each kind with its RoPE (the global one scaled),
        # query_pre_attn_scalar 24 (not head_dim 16), a final logit soft-cap, tied embeddings, GeGLU.
        "gemma3": lambda: tf.Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=24, sliding_window=12,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], final_logit_softcapping=3.0,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
        # YaRN from 16 original positions (a 40-token prompt goes 24 past them): Qwen3 with the attention factor
        # from `factor`; Qwen2 with it from mscale / mscale_all_dim, other betas and an untruncated ramp.
        "qwen3_yarn": lambda: tf.Qwen3Config(**{**COMMON, "max_position_embeddings": 64}, head_dim=32, rope_parameters={
            "rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 16}),
        "qwen2_yarn": lambda: tf.Qwen2Config(**{**COMMON, "max_position_embeddings": 128}, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1000.0, "factor": 8.0, "original_max_position_embeddings": 16,
            "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 8.0, "beta_slow": 2.0, "truncate": False}),
        # Multi-head latent attention (models/mla.py). V2-Lite's shape: queries straight from the hidden state,
        # softmax routing, 3 experts of the 2 best of 4 groups, 2 shared experts, a dense first layer; YaRN from
        # 16 original positions with DeepSeek's mscale = mscale_all_dim (the softmax scale's factor).
        "deepseek_v2": lambda: tf.DeepseekV2Config(
            **{**MLA, "max_position_embeddings": 64, "num_experts_per_tok": 3}, q_lora_rank=None, v_head_dim=24,
            n_shared_experts=2, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 16, "mscale": 0.707, "mscale_all_dim": 0.707}),
        # V3's: q_lora_rank, sigmoid scores with the correction bias choosing by groups' top-2 sums, normalised
        # weights times routed_scaling_factor, one shared expert, RoPE values in interleaved pairs.
        "deepseek_v3": lambda: tf.DeepseekV3Config(
            **{**MLA, "max_position_embeddings": 128}, q_lora_rank=48, v_head_dim=32, n_shared_experts=1, n_group=4,
            topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                             "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "beta_fast": 32, "beta_slow": 1}),
        # GPT-OSS: a sliding (window 12) and a full layer, a sink logit per head, YaRN from 16 original positions
        # (untruncated, as gpt-oss ships it), 4 experts with biases, top-2, the SwiGLU clamped at 0.5 (random weights'
        # gate / up values cross it), attention biases.
        "gpt_oss": lambda: tf.GptOssConfig(
            **{**COMMON, "intermediate_size": 64, "max_position_embeddings": 128, "rms_norm_eps": 1e-5}, head_dim=16,
            sliding_window=12,
            num_local_experts=4, num_experts_per_tok=2, swiglu_limit=0.5,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}),
    }


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "phi3", "gemma3")
# Families whose 1-D parameters (norm weights, biases) are moved away from their init values (1, 0), so that a
# loader or model that ignores them fails parity.
PERTURBED = ("phi3", "phi4_mini", "phi3_longrope", "qwen3_yarn", "qwen2_yarn", "gemma3", "deepseek_v2", "deepseek_v3",
             "gpt_oss")
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")


def build_hf_model(family: str, seed: int = 0, dtype=torch.float32, **overrides):
    """The family's random model; `overrides` set config fields (e.g. vocab_size for a real tokenizer)."""
    import transformers as tf
    torch.manual_seed(seed)
    cfg = family_configs()[family]()
    for name, value in overrides.items():
        setattr(cfg, name, value)
    cfg._attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="eager")
    if family in PERTURBED:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim == 1 or name.endswith("_bias"):  # GPT-OSS's expert biases are [experts, N]
                    p.add_(0.2 * torch.randn(p.shape, generator=g))
            for name, b in model.named_buffers():  # DeepSeek-V3's routing bias: large enough to change choices
                if name.endswith("e_score_correction_bias"):
                    b.add_(0.5 * torch.randn(b.shape, generator=g))
    model.eval()
    return model


def save_hf_model(family: str, out_dir: str, seed: int = 0, dtype=torch.float32, max_shard_size=None, **overrides):
    model = build_hf_model(family, seed, dtype, **overrides)
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
