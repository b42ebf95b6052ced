"""`write_gguf`: an HF checkpoint (Llama, Qwen2/3, Mixtral, Qwen2/3-MoE, Gemma 3, Phi-3, DeepSeek-V2 / V3, GPT-OSS in
safetensors) as a GGUF file of the same weights, laid out as llama.cpp's converter writes it, with gguf's writer. The
llama.cpp benchmarks (serving/bench/llamacpp.py) and the GGUF loader's tests (its safetensors twin) use it.

    python -m models.gguf_writer --hf_dir=DIR --out=FILE.gguf [--tensor_type=F32|BF16|Q8_0|...]
"""
from __future__ import annotations

import os
from pathlib import Path

import ml_dtypes
import numpy as np

from models.config import ModelConfig
from models.safetensors_io import SafetensorsCheckpoint

# meshserve's model family -> llama.cpp's architecture
GGUF_ARCHITECTURES = {"llama": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                      "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gemma3": "gemma3", "phi3": "phi3",
                      "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2", "gpt_oss": "gpt-oss"}
# HF names of an expert's gate, up and down projections per family (per-expert checkpoints)
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
                 "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}
# Matrix types written with gguf.quants' own quantizers (the others need llama.cpp's)
QUANTIZED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def rope_pairs(w: np.ndarray, heads: int) -> np.ndarray:
    """HF rotate-half rows (per head: first half, second half) -> interleaved pairs (x0, x_half, x1, ...), as
    llama.cpp's converter permutes q and k for its "llama" architecture."""
    out_dim = w.shape[0]
    return w.reshape(heads, 2, out_dim // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg: ModelConfig) -> np.ndarray:
    """Llama 3's per-frequency RoPE divisors (GGUF's rope_freqs.weight): plain / scaled inverse frequencies."""
    import dataclasses

    from models.rope import inverse_frequencies
    plain = inverse_frequencies(dataclasses.replace(cfg.rope, rope_type="default"), cfg.head_dim).astype(np.float64)
    return (plain / inverse_frequencies(cfg.rope, cfg.head_dim).astype(np.float64)).astype(np.float32)


def _stacked_experts(tensors: SafetensorsCheckpoint, layer: int, family: str, n: int) -> tuple[np.ndarray, ...]:
    """Layer `layer`'s experts' gate, up and down weights, each stacked [n, out, in], from per-expert tensors (under
    `block_sparse_moe.` or `mlp.`) or from transformers 5's fused experts (gate_up_proj [n, 2I, E], gate rows
    first, and down_proj [n, E, I])."""
    for module in ("block_sparse_moe", "mlp"):
        m = f"model.layers.{layer}.{module}.experts."
        if f"{m}0.{_EXPERT_NAMES[family][0]}.weight" in tensors:
            return tuple(np.stack([tensors.get(f"{m}{j}.{name}.weight") for j in range(n)])
                         for name in _EXPERT_NAMES[family])
    m = f"model.layers.{layer}.mlp.experts."
    gate, up = np.split(tensors.get(m + "gate_up_proj"), 2, axis=1)
    return gate, up, tensors.get(m + "down_proj")


def _router(tensors: SafetensorsCheckpoint, layer: int) -> np.ndarray:
    mixtral = f"model.layers.{layer}.block_sparse_moe.gate.weight"
    return tensors.get(mixtral if mixtral in tensors else f"model.layers.{layer}.mlp.gate.weight")


def _check_gemma3(cfg: ModelConfig) -> None:
    """What llama.cpp's gemma3 hard-codes rather than reads must hold: every sixth layer global (one window on the
    others), the local layers' RoPE base 10000 unscaled, query_pre_attn_scalar = head_dim (hidden / heads at 27B)."""
    from models.gguf import GEMMA3_27B_LAYERS, GEMMA3_GLOBAL_EVERY, GEMMA3_LOCAL_ROPE_BASE
    local = [s is not None for s in cfg.sliding_windows]
    if local != [(i + 1) % GEMMA3_GLOBAL_EVERY != 0 for i in range(cfg.num_layers)] or \
            len({s for s in cfg.sliding_windows if s}) > 1:
        raise ValueError(f"write_gguf writes Gemma 3 with every {GEMMA3_GLOBAL_EVERY}th layer global (what llama.cpp "
                         f"assumes), not sliding windows {cfg.sliding_windows}")
    local_rope = cfg.rope_local
    if local_rope is None or local_rope.rope_type != "default" or local_rope.theta != GEMMA3_LOCAL_ROPE_BASE:
        raise ValueError(f"write_gguf writes Gemma 3 with local layers' plain RoPE base {GEMMA3_LOCAL_ROPE_BASE} "
                         f"(what llama.cpp assumes), not {local_rope}")
    scalar = cfg.hidden_size / cfg.num_heads if cfg.num_layers == GEMMA3_27B_LAYERS else cfg.head_dim
    if cfg.query_pre_attn_scalar != scalar:
        raise ValueError(f"write_gguf writes Gemma 3 with query_pre_attn_scalar {scalar} (what llama.cpp assumes), "
                         f"not {cfg.query_pre_attn_scalar}")


def _check_deepseek2(cfg: ModelConfig) -> None:
    """llama.cpp's deepseek2 rotates RoPE values in pairs (rope_interleave), takes YaRN's mscale = mscale_all_dim
    (the RoPE attention factor 1) and has no per-layer frequency of MoE layers (dense ones lead)."""
    if not cfg.rope_interleave:
        raise ValueError("write_gguf writes DeepSeek with rope_interleave (what llama.cpp's deepseek2 rotates)")
    if cfg.rope.rope_type == "yarn" and (abs(cfg.rope.attention_factor - 1.0) > 1e-6 or not cfg.rope.truncate):
        raise ValueError(f"write_gguf writes DeepSeek's YaRN with mscale = mscale_all_dim and truncate, not attention "
                         f"factor {cfg.rope.attention_factor}, truncate={cfg.rope.truncate}")
    dense = cfg.moe_layers.index(True) if any(cfg.moe_layers) else cfg.num_layers
    if cfg.moe_layers != (False,) * dense + (True,) * (cfg.num_layers - dense):
        raise ValueError(f"write_gguf writes DeepSeek with dense layers first, then MoE ones, not {cfg.moe_layers}")


def _check_gpt_oss(cfg: ModelConfig) -> None:
    """llama.cpp's gpt-oss hard-codes every second layer global, the SwiGLU's limit 7 and alpha 1.702; GPT-OSS's
    YaRN is untruncated, and its experts are written dequantised (float)."""
    from models.gguf import GPT_OSS_GLOBAL_EVERY, GPT_OSS_SWIGLU_ALPHA, GPT_OSS_SWIGLU_LIMIT
    local = [s is not None for s in cfg.sliding_windows]
    if local != [(i + 1) % GPT_OSS_GLOBAL_EVERY != 0 for i in range(cfg.num_layers)]:
        raise ValueError(f"write_gguf writes GPT-OSS with every {GPT_OSS_GLOBAL_EVERY}nd layer global (what llama.cpp "
                         f"assumes), not sliding windows {cfg.sliding_windows}")
    if (cfg.swiglu_limit, cfg.swiglu_alpha) != (GPT_OSS_SWIGLU_LIMIT, GPT_OSS_SWIGLU_ALPHA):
        raise ValueError(f"write_gguf writes GPT-OSS with swiglu_limit {GPT_OSS_SWIGLU_LIMIT} and alpha "
                         f"{GPT_OSS_SWIGLU_ALPHA} (what llama.cpp assumes), not {cfg.swiglu_limit}, {cfg.swiglu_alpha}")
    if cfg.rope.rope_type == "yarn" and cfg.rope.truncate:
        raise ValueError("write_gguf writes GPT-OSS's YaRN untruncated (as gpt-oss ships it), not truncate=True")
    if cfg.mxfp4_experts:
        raise ValueError("write_gguf writes float experts, not MXFP4 blocks (dequantise the checkpoint first)")


def _gpt_oss_layer(add, tensors: SafetensorsCheckpoint, cfg: ModelConfig, i: int) -> None:
    """Layer i of a GPT-OSS but its input norm, as llama.cpp's converter writes float experts: gate_up_proj
    [N, E, 2I] split by column parity (gate the even ones) into [N, I, E] stacks, down_proj as [N, E, I]."""
    p = f"model.layers.{i}."
    for proj in ("q", "k", "v", "o"):
        out = "output" if proj == "o" else proj
        add(f"blk.{i}.attn_{out}.weight", tensors.get(p + f"self_attn.{proj}_proj.weight"))
        add(f"blk.{i}.attn_{out}.bias", tensors.get(p + f"self_attn.{proj}_proj.bias"))
    add(f"blk.{i}.attn_sinks.weight", tensors.get(p + "self_attn.sinks"))
    add(f"blk.{i}.post_attention_norm.weight", tensors.get(p + "post_attention_layernorm.weight"))
    add(f"blk.{i}.ffn_gate_inp.weight", tensors.get(p + "mlp.router.weight"))
    add(f"blk.{i}.ffn_gate_inp.bias", tensors.get(p + "mlp.router.bias"))
    e = p + "mlp.experts."
    gate_up, gate_up_bias = tensors.get(e + "gate_up_proj"), tensors.get(e + "gate_up_proj_bias")
    for half, name in ((0, "gate"), (1, "up")):
        add(f"blk.{i}.ffn_{name}_exps.weight", np.ascontiguousarray(gate_up[..., half::2].transpose(0, 2, 1)))
        add(f"blk.{i}.ffn_{name}_exps.bias", np.ascontiguousarray(gate_up_bias[..., half::2]))
    add(f"blk.{i}.ffn_down_exps.weight", np.ascontiguousarray(tensors.get(e + "down_proj").transpose(0, 2, 1)))
    add(f"blk.{i}.ffn_down_exps.bias", tensors.get(e + "down_proj_bias"))


def _deepseek2_metadata(w, cfg: ModelConfig) -> None:
    """Multi-head latent attention as llama.cpp's converter describes it (an MQA view: one KV head of the latent
    plus the RoPE key; the heads' sizes as *_mla) and DeepSeek MoE's routing."""
    import gguf
    rank, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    w.add_head_count_kv(1)
    w.add_key_length(rank + rope)
    w.add_value_length(rank)
    w.add_key_length_mla(cfg.qk_nope_head_dim + rope)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_kv_lora_rank(rank)
    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_rope_dimension_count(rope)
    w.add_vocab_size(cfg.vocab_size)
    w.add_leading_dense_block_count(cfg.moe_layers.index(True) if any(cfg.moe_layers) else cfg.num_layers)
    w.add_expert_shared_count(cfg.shared_expert_intermediate_size // max(1, cfg.moe_intermediate_size))
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if cfg.scoring_func == "sigmoid"
                             else gguf.ExpertGatingFuncType.SOFTMAX)
    if cfg.topk_method != "greedy":
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    if cfg.rope.rope_type == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(cfg.rope.factor)
        w.add_rope_scaling_orig_ctx_len(cfg.rope.original_max_position_embeddings)
        w.add_rope_scaling_yarn_log_mul(0.1 * cfg.rope.mscale_all_dim)
        w.add_rope_scaling_yarn_beta_fast(cfg.rope.beta_fast)
        w.add_rope_scaling_yarn_beta_slow(cfg.rope.beta_slow)


def _deepseek2_layer(add, tensors: SafetensorsCheckpoint, cfg: ModelConfig, i: int) -> None:
    """Layer i of a DeepSeek-V2 / V3 but its input norm: kv_b_proj split per head into k_b [H, R, Dn] (transposed,
    for llama.cpp's absorbed attention) and v_b [H, Dv, R], as llama.cpp's converter does."""
    p = f"model.layers.{i}."
    a = p + "self_attn."
    if cfg.q_lora_rank:
        add(f"blk.{i}.attn_q_a.weight", tensors.get(a + "q_a_proj.weight"))
        add(f"blk.{i}.attn_q_a_norm.weight", tensors.get(a + "q_a_layernorm.weight"))
        add(f"blk.{i}.attn_q_b.weight", tensors.get(a + "q_b_proj.weight"))
    else:
        add(f"blk.{i}.attn_q.weight", tensors.get(a + "q_proj.weight"))
    add(f"blk.{i}.attn_kv_a_mqa.weight", tensors.get(a + "kv_a_proj_with_mqa.weight"))
    add(f"blk.{i}.attn_kv_a_norm.weight", tensors.get(a + "kv_a_layernorm.weight"))
    kv_b = tensors.get(a + "kv_b_proj.weight")
    kv_b = kv_b.reshape(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    add(f"blk.{i}.attn_k_b.weight", np.ascontiguousarray(kv_b[:, :cfg.qk_nope_head_dim].transpose(0, 2, 1)))
    add(f"blk.{i}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, cfg.qk_nope_head_dim:]))
    add(f"blk.{i}.attn_output.weight", tensors.get(a + "o_proj.weight"))
    add(f"blk.{i}.ffn_norm.weight", tensors.get(p + "post_attention_layernorm.weight"))
    if not cfg.moe_layers[i]:
        for name in ("gate", "up", "down"):
            add(f"blk.{i}.ffn_{name}.weight", tensors.get(p + f"mlp.{name}_proj.weight"))
        return
    add(f"blk.{i}.ffn_gate_inp.weight", tensors.get(p + "mlp.gate.weight"))
    if cfg.topk_method == "noaux_tc":
        add(f"blk.{i}.exp_probs_b.bias", tensors.get(p + "mlp.gate.e_score_correction_bias"))
    for name in ("gate", "up", "down"):
        add(f"blk.{i}.ffn_{name}_exps.weight",
            np.stack([tensors.get(p + f"mlp.experts.{j}.{name}_proj.weight") for j in range(cfg.num_experts)]))
        if cfg.shared_expert_intermediate_size:
            add(f"blk.{i}.ffn_{name}_shexp.weight", tensors.get(p + f"mlp.shared_experts.{name}_proj.weight"))


def write_gguf(model_dir: str | os.PathLike, path: str | os.PathLike, q8_0: bool = False,
               tensor_type: str | None = None, split_max_tensors: int = 0) -> Path:
    """Writes `model_dir` as GGUF at `path` and returns the path: Llama and Mixtral as llama.cpp's "llama"
    architecture (q/k rows reordered for its interleaved RoPE; Llama 3 RoPE scaling as rope_freqs.weight), Qwen2,
    Qwen3, Qwen2-MoE and Qwen3-MoE under their own names (NEOX RoPE as HF's: rows as stored); experts stacked as
    ffn_{gate,up,down}_exps [n_expert, out, in], the router as ffn_gate_inp, a shared expert as *_shexp; Gemma 3
    (norms as 1 + w), Phi-3 (fused qkv / gate_up), DeepSeek (deepseek2: kv_b split into k_b / v_b) and GPT-OSS
    (float experts) as the converter writes them, refusing what llama.cpp would compute otherwise.
    Matrices in the checkpoint's float type, or `tensor_type` (one of QUANTIZED_TYPES, "F32", "BF16", "F16";
    `q8_0`: "Q8_0", what `llama-quantize ... Q8_0` writes); norms and biases float32. With `split_max_tensors` the
    model is split as `gguf-split` does (path-0000k-of-0000n.gguf; the first part's path is returned)."""
    import gguf
    model_dir, path = Path(model_dir), Path(path)
    cfg = ModelConfig.from_pretrained(str(model_dir))
    arch = GGUF_ARCHITECTURES.get(cfg.family)
    if arch is None:
        raise ValueError(f"write_gguf handles {', '.join(GGUF_ARCHITECTURES)} checkpoints, not {cfg.family!r}")
    scaled = {"llama": "llama3", "gemma3": "linear", "deepseek2": "yarn", "gpt-oss": "yarn"}.get(arch)
    if cfg.rope.rope_type not in ("default", scaled):
        raise ValueError(f"write_gguf writes plain RoPE (and Llama 3's), not {cfg.rope.rope_type!r} (Gemma 3: linear "
                         "too)")
    if arch == "gemma3":
        _check_gemma3(cfg)
    elif arch == "deepseek2":
        _check_deepseek2(cfg)
    elif arch == "gpt-oss":
        _check_gpt_oss(cfg)
    elif any(cfg.sliding_windows) and not (arch == "phi3" and len(set(cfg.sliding_windows)) == 1):
        raise ValueError(f"write_gguf writes full attention (Phi-3: one window on every layer), not sliding windows "
                         f"{cfg.sliding_windows}")
    if cfg.family == "qwen3_moe" and not (cfg.norm_topk_prob and all(cfg.moe_layers)):
        # llama.cpp's qwen3moe renormalises the top-k weights and has a sparse MLP in every layer
        raise ValueError(f"write_gguf writes Qwen3-MoE with norm_topk_prob and every layer sparse, not "
                         f"norm_topk_prob={cfg.norm_topk_prob}, moe_layers={cfg.moe_layers}")
    tensors = SafetensorsCheckpoint(str(model_dir))
    heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
    stored = tensors.get("model.embed_tokens.weight").dtype
    kind = tensor_type or ("Q8_0" if q8_0 else "BF16" if stored == ml_dtypes.bfloat16 else "F32")
    if kind not in QUANTIZED_TYPES + ("F32", "BF16", "F16"):
        raise ValueError(f"tensor_type must be one of F32, BF16, F16, {', '.join(QUANTIZED_TYPES)}; got {kind!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    # llama's MoE (Mixtral) sizes its experts by feed_forward_length, the Qwen MoEs by expert_feed_forward_length
    w.add_feed_forward_length(cfg.moe_intermediate_size if cfg.family == "mixtral" else cfg.intermediate_size)
    if cfg.num_experts:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch in ("qwen2moe", "qwen3moe", "deepseek2", "gpt-oss"):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if cfg.shared_expert_intermediate_size and arch != "deepseek2":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_head_count(heads)
    if arch == "deepseek2":
        _deepseek2_metadata(w, cfg)
    else:
        w.add_head_count_kv(kv_heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope.partial_rotary_factor))
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if any(cfg.sliding_windows):
        w.add_sliding_window(next(s for s in cfg.sliding_windows if s))
    if cfg.rope.rope_type == "yarn" and arch == "gpt-oss":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(cfg.rope.factor)
        w.add_rope_scaling_orig_ctx_len(cfg.rope.original_max_position_embeddings)
    if cfg.rope.rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope.factor)
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if kind == "F32" else gguf.LlamaFileType[f"MOSTLY_{kind}"])
    vocab = cfg.vocab_size
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    tokens += [f"t{i}" for i in range(len(tokens), vocab)]
    types += [gguf.TokenType.NORMAL] * (vocab - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens[:vocab])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(types[:vocab])
    w.add_bos_token_id(1 if cfg.bos_token_id is None else cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_ids[0] if cfg.eos_token_ids else 2)

    def add(name: str, a: np.ndarray) -> None:
        if a.ndim == 1 or kind == "F32":
            w.add_tensor(name, np.ascontiguousarray(a, np.float32))
        elif kind in QUANTIZED_TYPES:  # the shape from the blocks' bytes
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, gguf.quants.quantize(np.asarray(a, np.float32), qtype), raw_dtype=qtype)
        elif kind == "F16":
            w.add_tensor(name, np.ascontiguousarray(a, np.float16))
        else:  # bfloat16 bits
            w.add_tensor(name, np.ascontiguousarray(a, ml_dtypes.bfloat16).view(np.uint16), raw_shape=a.shape,
                         raw_dtype=gguf.GGMLQuantizationType.BF16)

    rope_rows = rope_pairs if arch == "llama" else lambda a, _: a
    shift = np.float32(1.0 if arch == "gemma3" else 0.0)  # llama.cpp's converter stores Gemma's norms as 1 + w

    def norm(name: str, a: np.ndarray) -> None:
        add(name, np.asarray(a, np.float32) + shift)

    add("token_embd.weight", tensors.get("model.embed_tokens.weight"))
    norm("output_norm.weight", tensors.get("model.norm.weight"))
    if not cfg.tie_word_embeddings:  # llama.cpp ties the head to the embedding when output.weight is absent
        add("output.weight", tensors.get("lm_head.weight"))
    if cfg.rope.rope_type == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
        w.add_rope_scaling_orig_ctx_len(cfg.rope.original_max_position_embeddings)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        norm(f"blk.{i}.attn_norm.weight", tensors.get(p + "input_layernorm.weight"))
        if arch == "deepseek2":
            _deepseek2_layer(add, tensors, cfg, i)
            continue
        if arch == "gpt-oss":
            _gpt_oss_layer(add, tensors, cfg, i)
            continue
        if arch == "phi3":  # fused, q rows then k then v
            add(f"blk.{i}.attn_qkv.weight", tensors.get(p + "self_attn.qkv_proj.weight"))
        for proj, h in (("q", heads), ("k", kv_heads), ("v", 0)) if arch != "phi3" else ():
            rows = (lambda a, n=h: rope_rows(a, n)) if h else (lambda a: a)
            add(f"blk.{i}.attn_{proj}.weight", rows(tensors.get(p + f"self_attn.{proj}_proj.weight")))
            if cfg.qkv_bias:
                add(f"blk.{i}.attn_{proj}.bias", rows(tensors.get(p + f"self_attn.{proj}_proj.bias")))
        add(f"blk.{i}.attn_output.weight", tensors.get(p + "self_attn.o_proj.weight"))
        if cfg.o_bias:
            add(f"blk.{i}.attn_output.bias", tensors.get(p + "self_attn.o_proj.bias"))
        if cfg.qk_norm:
            norm(f"blk.{i}.attn_q_norm.weight", tensors.get(p + "self_attn.q_norm.weight"))
            norm(f"blk.{i}.attn_k_norm.weight", tensors.get(p + "self_attn.k_norm.weight"))
        if arch == "gemma3":  # a norm before and after each of attention and the MLP
            norm(f"blk.{i}.post_attention_norm.weight", tensors.get(p + "post_attention_layernorm.weight"))
            norm(f"blk.{i}.ffn_norm.weight", tensors.get(p + "pre_feedforward_layernorm.weight"))
            norm(f"blk.{i}.post_ffw_norm.weight", tensors.get(p + "post_feedforward_layernorm.weight"))
        else:
            add(f"blk.{i}.ffn_norm.weight", tensors.get(p + "post_attention_layernorm.weight"))
        if cfg.moe_layers[i]:  # [n_expert, out, in] per projection (GGUF lists dimensions innermost first)
            add(f"blk.{i}.ffn_gate_inp.weight", _router(tensors, i))
            for name, a in zip(("gate", "up", "down"), _stacked_experts(tensors, i, cfg.family, cfg.num_experts)):
                add(f"blk.{i}.ffn_{name}_exps.weight", a)
            if cfg.shared_expert_intermediate_size:
                for name in ("gate", "up", "down"):
                    add(f"blk.{i}.ffn_{name}_shexp.weight", tensors.get(p + f"mlp.shared_expert.{name}_proj.weight"))
                add(f"blk.{i}.ffn_gate_inp_shexp.weight", tensors.get(p + "mlp.shared_expert_gate.weight")[0])
            continue
        if arch == "phi3":  # llama.cpp keeps gate_up fused as ffn_up (gate rows first)
            add(f"blk.{i}.ffn_up.weight", tensors.get(p + "mlp.gate_up_proj.weight"))
            add(f"blk.{i}.ffn_down.weight", tensors.get(p + "mlp.down_proj.weight"))
            continue
        for name in ("gate", "up", "down"):
            add(f"blk.{i}.ffn_{name}.weight", tensors.get(p + f"mlp.{name}_proj.weight"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    parts = w.format_shard_names(path)
    w.close()
    return parts[0]


def main(argv):
    del argv
    from absl import flags
    f = flags.FLAGS
    print(f"wrote {write_gguf(f.hf_dir, f.out, tensor_type=f.tensor_type)}")


if __name__ == "__main__":
    from absl import app, flags
    flags.DEFINE_string("hf_dir", None, "HF model directory (config.json + safetensors)", required=True)
    flags.DEFINE_string("out", None, "the GGUF file to write", required=True)
    flags.DEFINE_enum("tensor_type", None, ["F32", "BF16", "F16", *QUANTIZED_TYPES],
                      "matrix type (default: the checkpoint's float type)")
    app.run(main)
