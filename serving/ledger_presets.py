"""The memory ledger's built-in models (`python -m serving.ledger --preset=NAME`): the HF config.json numbers of
public checkpoints, as dicts `ModelConfig.from_hf` reads, and the name of the source's worked 70B example."""
from __future__ import annotations


def _llama(hidden, layers, heads, kv_heads, inter, vocab, max_pos, theta, dtype, **extra):
    return dict(architectures=["LlamaForCausalLM"], hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter,
                vocab_size=vocab, max_position_embeddings=max_pos, rope_theta=theta, torch_dtype=dtype,
                rms_norm_eps=1e-5, **extra)


# HF config.json numbers of the public checkpoints.
PRESETS: dict[str, tuple[str, dict]] = {
    "llama-2-7b": ("Llama-2-7B", _llama(4096, 32, 32, 32, 11008, 32000, 4096, 10000.0, "float16")),
    "llama-3-8b": ("Llama-3-8B", _llama(4096, 32, 32, 8, 14336, 128256, 8192, 500000.0, "bfloat16")),
    "llama-3-70b": ("Llama-3-70B", _llama(8192, 80, 64, 8, 28672, 128256, 8192, 500000.0, "bfloat16")),
    "mixtral-8x7b": ("Mixtral-8x7B", dict(
        architectures=["MixtralForCausalLM"], hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=14336, vocab_size=32000, max_position_embeddings=32768,
        rope_theta=1e6, num_local_experts=8, num_experts_per_tok=2, torch_dtype="bfloat16", rms_norm_eps=1e-5)),
    # Gemma 3 27B (its config.json; the text_config names only what differs from Gemma3TextConfig's defaults): 62
    # layers, every sixth global, the others a 1024-token window (the hybrid KV cache keeps only that).
    "gemma-3-27b": ("Gemma-3-27B", dict(
        architectures=["Gemma3ForConditionalGeneration"], eos_token_id=[1, 106], torch_dtype="bfloat16",
        text_config=dict(head_dim=128, hidden_size=5376, intermediate_size=21504, model_type="gemma3_text",
                         num_attention_heads=32, num_hidden_layers=62, num_key_value_heads=16,
                         query_pre_attn_scalar=168, rope_scaling={"factor": 8.0, "rope_type": "linear"},
                         sliding_window=1024))),
    # A standard-attention model of about Gemma 3 27B's size (GQA, every layer full).
    "qwen2.5-32b": ("Qwen2.5-32B", dict(
        architectures=["Qwen2ForCausalLM"], hidden_size=5120, num_hidden_layers=64, num_attention_heads=40,
        num_key_value_heads=8, intermediate_size=27648, vocab_size=152064, max_position_embeddings=32768,
        rope_theta=1e6, rms_norm_eps=1e-6, torch_dtype="bfloat16", tie_word_embeddings=False)),
    # DeepSeek-V3 (its config.json; block-FP8 weights): 61 layers (3 dense, then MoE) of multi-head latent
    # attention, whose cache is one row of kv_lora_rank 512 + qk_rope_head_dim 64 per token and layer.
    "deepseek-v3": ("DeepSeek-V3", dict(
        architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4,
        num_experts_per_tok=8, moe_layer_freq=1, first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid",
        max_position_embeddings=163840, rope_theta=10000, rms_norm_eps=1e-6, tie_word_embeddings=False,
        torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1, num_nextn_predict_layers=1,
        rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
                          original_max_position_embeddings=4096, type="yarn"),
        quantization_config=dict(activation_scheme="dynamic", fmt="e4m3", quant_method="fp8",
                                 weight_block_size=[128, 128]))),
    # GPT-OSS 120B (its config.json; MXFP4 experts, dequantised to bf16 at load): 36 layers alternating a 128-token
    # sliding window and full attention, 8 KV heads of 64, 128 experts of 2880 (top 4) with biases, attention sinks.
    "gpt-oss-120b": ("GPT-OSS-120B", dict(
        architectures=["GptOssForCausalLM"], attention_bias=True, head_dim=64, hidden_act="silu", hidden_size=2880,
        intermediate_size=2880, layer_types=["sliding_attention", "full_attention"] * 18,
        max_position_embeddings=131072, num_attention_heads=64, num_experts_per_tok=4, num_hidden_layers=36,
        num_key_value_heads=8, num_local_experts=128, rms_norm_eps=1e-5, rope_theta=150000, sliding_window=128,
        rope_scaling=dict(beta_fast=32.0, beta_slow=1.0, factor=32.0, original_max_position_embeddings=4096,
                          rope_type="yarn", truncate=False),
        swiglu_limit=7.0, tie_word_embeddings=False, vocab_size=201088, eos_token_id=200002, pad_token_id=199999,
        torch_dtype="bfloat16", quantization_config=dict(quant_method="mxfp4", modules_to_not_convert=[
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]))),
    # The source's example (§1.1): 32 layers, hidden 4096, no GQA, fp16 -> 512 KiB of KV per token. The rest of
    # its shape (MLP 11008, vocab 32000) is Llama-2-7B's, which is exactly such a model.
    "source-example": ("source example (32 layers, hidden 4096, no GQA)",
                       _llama(4096, 32, 32, 32, 11008, 32000, 4096, 10000.0, "float16")),
}
SOURCE_70B = "source-70b"  # the source's worked example (§3.4): a budget, not an architecture
