"""ModelConfig: the decoder-only architectures meshserve runs, parsed from an HF `config.json`.

Anything the model code does not implement fails here, at load, with the option named — never silently wrong
numbers deep inside a jit trace.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Phi3ForCausalLM": "phi3",  # Phi-3 and Phi-4 (fused qkv_proj and gate_up_proj)
    "DeepseekV2ForCausalLM": "deepseek_v2",  # multi-head latent attention (models/mla.py), DeepSeek MoE
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Gemma3ForCausalLM": "gemma3",  # Gemma 3 text (1B; the larger ones are Gemma3ForConditionalGeneration)
    "GptOssForCausalLM": "gpt_oss",  # attention sinks, sliding / full layers, MoE with biases (docs/models.md)
}
DEEPSEEK_FAMILIES = ("deepseek_v2", "deepseek_v3")
# MoE routing (models/moe.py): how experts are scored and how the top-k is chosen
SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
# Multimodal checkpoints served as their language model: architecture -> the text config's own architecture.
TEXT_OF_MULTIMODAL = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# A bare config (no architectures) names its family by model_type.
MODEL_TYPES = {"gemma3_text": "Gemma3ForCausalLM", "gemma3": "Gemma3ForConditionalGeneration"}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn", "longrope")
log = logging.getLogger(__name__)


class UnsupportedModelError(ValueError):
    """The checkpoint asks for an architecture or option meshserve does not implement."""


@dataclasses.dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn: the ramp between interpolated and extrapolated frequencies (HF modeling_rope_utils)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale_all_dim: float = 0.0  # yarn; kept for attention that scales its softmax by it too (DeepSeek's MLA)
    # yarn, longrope: the factor cos and sin are scaled by (the attention temperature); 1.0 for the others
    attention_factor: float = 1.0
    short_factor: tuple[float, ...] = ()  # longrope: a divisor per frequency, within the original context
    long_factor: tuple[float, ...] = ()  # longrope: a divisor per frequency, for sequences past the original context
    partial_rotary_factor: float = 1.0  # the share of head_dim that is rotated (the rest passes through)

    def __post_init__(self):
        object.__setattr__(self, "short_factor", tuple(float(f) for f in self.short_factor))  # from JSON lists
        object.__setattr__(self, "long_factor", tuple(float(f) for f in self.long_factor))


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    # Per layer: None (full attention) or the window size (tokens attended, self included).
    sliding_windows: tuple[int | None, ...] = ()
    # MoE; `moe_layers[i]` says whether layer i has a sparse MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()
    num_expert_slots: int = 0  # physical expert slots (>= num_experts; spares hold replicas); 0 = num_experts
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    dtype: str = "float32"  # the checkpoint's stored dtype
    # Matmul weights held quantized (models.quant): "" (no), "int8" or "fp8" (e4m3); scales per output channel, or
    # per `quantization_group` K rows (block-wise fp8 checkpoints)
    quantization: str = ""
    quantization_group: int = 0
    # Multi-head latent attention (DeepSeek-V2 / V3, models/mla.py), on when kv_lora_rank > 0; head_dim is then the
    # query/key head (qk_nope_head_dim + qk_rope_head_dim) and num_kv_heads = num_heads (the cache is one latent row)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: queries straight from the hidden state (q_proj, V2-Lite); else q_a -> norm -> q_b
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the checkpoint's RoPE values come in pairs (DeepSeek): de-interleaved at load
    # MoE routing beyond softmax-then-top-k (DeepSeek): scores, expert groups, the routed weights' scale, and whether
    # a shared expert has a sigmoid gate (Qwen2-MoE) or none (DeepSeek's n_shared_experts)
    scoring_func: str = "softmax"  # SCORING_FUNCS
    topk_method: str = "greedy"  # TOPK_METHODS; noaux_tc adds a per-expert score correction bias
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gate: bool = True
    # Gemma 3 (models.gemma3): the MLP's gate activation ("silu": SwiGLU; "gelu_pytorch_tanh": GeGLU), RMSNorm
    # scaling by (1 + weight), the softmax scale 1 / sqrt(query_pre_attn_scalar) (None: 1 / sqrt(head_dim)), tanh
    # soft-capping of attention scores / final logits (None: none), and the sliding-window layers' own RoPE
    # (None: `rope` for every layer)
    hidden_act: str = "silu"
    rms_norm_unit_offset: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local: RopeConfig | None = None
    # GPT-OSS (docs/models.md): a learned sink logit per query head in every attention's softmax, a router bias,
    # experts with biases and the clamped SwiGLU (gate clamped above at swiglu_limit, up to +-swiglu_limit,
    # gate * sigmoid(swiglu_alpha * gate) * (up + 1)); swiglu_limit 0: plain SwiGLU
    attention_sinks: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float = 1.0
    swiglu_limit: float = 0.0
    mxfp4_experts: bool = False  # the checkpoint's experts are MXFP4 blocks + scales, dequantised at load

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if len(self.sliding_windows) != self.num_layers:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.moe_layers) != self.num_layers:
            object.__setattr__(self, "moe_layers", (self.num_experts > 0,) * self.num_layers)
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, {self.num_experts}]")
        if self.scoring_func not in SCORING_FUNCS or self.topk_method not in TOPK_METHODS:
            raise ValueError(f"scoring_func={self.scoring_func!r} / topk_method={self.topk_method!r}: expected one "
                             f"of {SCORING_FUNCS} / {TOPK_METHODS}")
        if self.num_experts and (self.n_group < 1 or self.num_experts % self.n_group
                                 or not 1 <= self.topk_group <= self.n_group):
            raise ValueError(f"n_group={self.n_group}, topk_group={self.topk_group}: n_group must divide the "
                             f"{self.num_experts} experts and 1 <= topk_group <= n_group")
        if self.num_experts and self.topk_group * self.num_experts // self.n_group < self.num_experts_per_tok:
            raise ValueError(f"topk_group={self.topk_group} groups of {self.num_experts // self.n_group} experts "
                             f"hold fewer than num_experts_per_tok={self.num_experts_per_tok}")

    @property
    def weight_quant(self):
        """The `models.quant.WeightQuant` of the matmul weights, or None when they are not quantized."""
        from models.quant import WeightQuant
        return WeightQuant(self.quantization, self.quantization_group) if self.quantization else None

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (models/mla.py) rather than grouped-query attention."""
        return self.kv_lora_rank > 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        d["rope"] = RopeConfig(**d["rope"])
        if d.get("rope_local") is not None:
            d["rope_local"] = RopeConfig(**d["rope_local"])
        for k in ("sliding_windows", "moe_layers", "eos_token_ids"):
            d[k] = tuple(d[k])
        return cls(**d)

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no config.json in {model_dir!r}: expected an HF-format model directory")
        with open(path) as f:
            return cls.from_hf(json.load(f))

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        return _parse_hf(hf)


def _unsupported(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"unsupported model option: {what}")


def _parse_rope(hf: dict[str, Any], family: str) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older configs have `rope_theta` + `rope_scaling`.
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if family == "phi3" and rope_type in ("su", "yarn"):  # Phi3Config reads both as longrope
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise _unsupported(f"rope scaling type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if family == "phi3" and rope_type not in ("default", "longrope"):
        raise _unsupported(f"rope scaling type {rope_type!r} for Phi-3 (supported: default, longrope)")
    partial = float(merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if partial != 1.0 and family != "phi3":  # HF rotates the whole head in the other families
        raise _unsupported(f"partial_rotary_factor={partial} for {family} (only 1.0)")
    if not 0.0 < partial <= 1.0:
        raise _unsupported(f"partial_rotary_factor={partial} (expected 0 < factor <= 1)")
    rope = RopeConfig(theta=float(theta), rope_type=rope_type, factor=float(merged.get("factor") or 1.0),
                      partial_rotary_factor=partial)
    if rope_type == "llama3":
        rope = dataclasses.replace(
            rope,
            low_freq_factor=float(merged["low_freq_factor"]),
            high_freq_factor=float(merged["high_freq_factor"]),
            original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
        )
    elif rope_type in ("yarn", "longrope"):
        rope = _yarn_or_longrope(hf, merged, rope)
    return rope


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature (its Eq. 21): 0.1 * mscale * ln(factor) + 1, or 1 when not scaling."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_or_longrope(hf: dict[str, Any], merged: dict[str, Any], rope: RopeConfig) -> RopeConfig:
    """The yarn / longrope parameters as HF transformers reads them (`modeling_rope_utils`): a top-level
    original_max_position_embeddings (Phi-3) wins over the scaling's own, else max_position_embeddings; a missing
    factor is max_position_embeddings / original; the attention factor, unless given, from factor (and for yarn
    mscale / mscale_all_dim when both are set)."""
    max_pos = int(hf.get("max_position_embeddings", 4096))
    original = int(hf.get("original_max_position_embeddings")
                   or merged.get("original_max_position_embeddings") or max_pos)
    factor = float(merged.get("factor") or max_pos / original)
    attention_factor = merged.get("attention_factor")
    if rope.rope_type == "yarn":
        mscale, mscale_all_dim = merged.get("mscale"), merged.get("mscale_all_dim")
        if attention_factor is None:
            attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                                if mscale and mscale_all_dim else _yarn_mscale(factor))
        return dataclasses.replace(
            rope, factor=factor, original_max_position_embeddings=original,
            beta_fast=float(merged.get("beta_fast") or 32), beta_slow=float(merged.get("beta_slow") or 1),
            truncate=bool(merged.get("truncate", True)), mscale_all_dim=float(mscale_all_dim or 0.0),
            attention_factor=float(attention_factor))
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    rotated = int(head_dim * rope.partial_rotary_factor) // 2
    factors = {}
    for name in ("short_factor", "long_factor"):
        value = merged.get(name)
        if not isinstance(value, list) or len(value) != rotated:
            raise _unsupported(f"longrope {name} {value!r} (expected a list of {rotated} numbers, one per "
                               f"rotated frequency)")
        factors[name] = tuple(value)
    return dataclasses.replace(rope, factor=factor, original_max_position_embeddings=original,
                               attention_factor=float(attention_factor), **factors)


def _sliding_windows(hf: dict[str, Any], family: str, num_layers: int) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        # Qwen only slides when use_sliding_window is set, and then only on some layers.
        if not hf.get("use_sliding_window", False):
            return (None,) * num_layers
        if not layer_types:
            first = hf.get("max_window_layers", num_layers)
            layer_types = ["full_attention" if i < first else "sliding_attention" for i in range(num_layers)]
    if window is None:
        return (None,) * num_layers
    if layer_types:
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise _unsupported(f"layer_types {sorted(unknown)}")
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    return (int(window),) * num_layers


# Gemma3TextConfig's defaults (transformers), which published configs rely on: Gemma 3 4B-27B's text_config names
# only what differs from them.
GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
    attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6,
    rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, final_logit_softcapping=None,
    attn_logit_softcapping=None)


def _gemma3_text(hf: dict[str, Any], multimodal: bool) -> dict[str, Any]:
    """A Gemma 3 config as a flat text config with Gemma3TextConfig's defaults filled in; a multimodal one
    (Gemma3ForConditionalGeneration) by its `text_config`, its top-level eos / dtype / tying winning."""
    text = hf
    if multimodal:
        if not isinstance(hf.get("text_config"), dict):
            raise _unsupported("Gemma3ForConditionalGeneration without a text_config (meshserve serves its language "
                               "model only; the vision tower is not implemented)")
        text = dict(hf["text_config"])
        for key in ("eos_token_id", "bos_token_id", "pad_token_id", "torch_dtype", "dtype", "tie_word_embeddings"):
            if hf.get(key) is not None:
                text[key] = hf[key]
    out = {**GEMMA3_TEXT_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
    if multimodal and out.get("final_logit_softcapping") is not None:
        # transformers' Gemma3ForConditionalGeneration computes its logits without it (Gemma3ForCausalLM caps)
        raise _unsupported(f"final_logit_softcapping={out['final_logit_softcapping']} in a "
                           "Gemma3ForConditionalGeneration text_config (transformers does not apply it there; "
                           "expected null as Gemma 3's checkpoints have)")
    out["architectures"] = ["Gemma3ForCausalLM"]
    if out.get("use_bidirectional_attention"):
        raise _unsupported("use_bidirectional_attention=true (Gemma 3 as an encoder; meshserve decodes causally)")
    if not out.get("layer_types"):
        pattern = int(out.get("sliding_window_pattern") or out.get("_sliding_window_pattern") or 6)
        out["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                              for i in range(int(out["num_hidden_layers"]))]
    return out


def _gemma3_ropes(hf: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(global, local) RoPE of Gemma 3: transformers 5's `rope_parameters` per layer type, or the legacy rope_theta
    and rope_scaling (the global layers') with rope_local_base_freq (the local ones', unscaled)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {"rope_type": "default", "rope_theta": hf["rope_theta"]}
        local = params.get("sliding_attention") or {"rope_type": "default", "rope_theta": hf["rope_local_base_freq"]}
    else:
        full = {**(hf.get("rope_scaling") or {}), **params, "rope_theta": params.get("rope_theta", hf["rope_theta"])}
        local = {"rope_type": "default", "rope_theta": hf["rope_local_base_freq"]}
    strip = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    return (_parse_rope({**strip, "rope_parameters": full}, "gemma3"),
            _parse_rope({**strip, "rope_parameters": local}, "gemma3"))


def _parse_hf(hf: dict[str, Any]) -> ModelConfig:
    archs = hf.get("architectures") or []
    if not archs:  # a bare config (no architectures) names its family by model_type
        by_type = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()} | MODEL_TYPES
        archs = [by_type.get(hf.get("model_type"), f"model_type={hf.get('model_type')!r}")]
    if len(archs) == 1 and archs[0] in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
        hf = _gemma3_text(hf, multimodal=archs[0] != "Gemma3ForCausalLM")
        archs = hf["architectures"]
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        supported = sorted(SUPPORTED_ARCHITECTURES) + list(TEXT_OF_MULTIMODAL)
        raise _unsupported(f"architecture {archs!r} (supported: {', '.join(supported)})")
    family = SUPPORTED_ARCHITECTURES[archs[0]]
    if family in DEEPSEEK_FAMILIES:
        hf = _deepseek_attention(hf)
    if family == "gemma3":  # Gemma writes hidden_activation (Gemma 1's hidden_act was a misleading "gelu")
        act = hf.get("hidden_activation") or hf.get("hidden_act")
        if act != "gelu_pytorch_tanh":
            raise _unsupported(f"hidden_activation={act!r} for Gemma 3 (only 'gelu_pytorch_tanh')")
    else:
        act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
        if act != "silu":
            raise _unsupported(f"hidden_act={act!r} (only 'silu')")
    if hf.get("mlp_bias"):
        raise _unsupported("mlp_bias=true")
    if hf.get("pretraining_tp", 1) != 1:
        raise _unsupported(f"pretraining_tp={hf['pretraining_tp']}")
    num_layers = int(hf["num_hidden_layers"])
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = hf.get("head_dim") or hidden // num_heads
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    attention_bias = bool(hf.get("attention_bias", family == "gpt_oss"))  # GptOssConfig's default: true
    kw: dict[str, Any] = dict(
        family=family,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf.get("intermediate_size") or 0),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=_gemma3_ropes(hf)[0] if family == "gemma3" else _parse_rope(hf, family),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=family in ("qwen2", "qwen2_moe") or attention_bias,
        o_bias=family in ("llama", "mistral", "qwen3", "qwen3_moe", "mixtral", "gemma3", "gpt_oss")
        and attention_bias,
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
        sliding_windows=_sliding_windows(hf, family, num_layers),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=hf.get("pad_token_id"),
        dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
    )
    if family == "gemma3":
        if hf.get("attn_logit_softcapping") is not None:
            # transformers' Gemma3Attention keeps it but never applies it (Gemma 2 did): either choice would differ
            # from what someone meant by it
            raise _unsupported(f"attn_logit_softcapping={hf['attn_logit_softcapping']} for Gemma 3 (transformers' "
                               "Gemma 3 does not apply it; expected null as Gemma 3's checkpoints have)")
        final_cap = hf.get("final_logit_softcapping")
        kw.update(hidden_act="gelu_pytorch_tanh", rms_norm_unit_offset=True,
                  query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]),
                  final_logit_softcapping=None if final_cap is None else float(final_cap),
                  rope_local=_gemma3_ropes(hf)[1])
    if family == "mixtral":
        kw.update(num_experts=int(hf["num_local_experts"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                  moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True)
    elif family in ("qwen2_moe", "qwen3_moe"):
        step = int(hf.get("decoder_sparse_step", 1))
        mlp_only = set(hf.get("mlp_only_layers") or [])
        num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
        kw.update(
            num_experts=num_experts,
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            moe_intermediate_size=int(hf["moe_intermediate_size"]),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0)
            if family == "qwen2_moe" else 0,
            moe_layers=tuple(i not in mlp_only and num_experts > 0 and (i + 1) % step == 0
                             for i in range(num_layers)),
        )
    elif family in DEEPSEEK_FAMILIES:
        kw.update(_deepseek_fields(hf, family, num_layers))
    elif family == "gpt_oss":
        kw.update(_gpt_oss_fields(hf))
    if kw["dtype"] not in ("float32", "bfloat16", "float16"):
        raise _unsupported(f"checkpoint dtype {kw['dtype']!r}")
    _mxfp4(hf, family)
    kw["quantization"], kw["quantization_group"] = _checkpoint_quantization(hf)
    return ModelConfig(**kw)


def _deepseek_attention(hf: dict[str, Any]) -> dict[str, Any]:
    """A DeepSeek config with the keys the generic parse reads set as multi-head latent attention has them: every
    query head its own key head (the cache holds one shared latent row; HF's num_key_value_heads is unused), head_dim
    the query/key head, RoPE over the qk_rope_head_dim values (as HF's rotary embedding, whose head_dim that is)."""
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not isinstance(hf.get(key), int) or hf[key] <= 0:
            raise _unsupported(f"{key}={hf.get(key)!r} (multi-head latent attention needs a positive integer)")
    if hf.get("attention_bias"):
        raise _unsupported("attention_bias=true for DeepSeek (no released checkpoint has it)")
    if hf.get("rope_scaling") and "partial_rotary_factor" in hf["rope_scaling"]:
        raise _unsupported("partial_rotary_factor for DeepSeek (qk_rope_head_dim is the rotated part)")
    heads = int(hf["num_attention_heads"])
    return {**hf, "num_key_value_heads": heads, "head_dim": hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]}


def _deepseek_fields(hf: dict[str, Any], family: str, num_layers: int) -> dict[str, Any]:
    """Multi-head latent attention and DeepSeek MoE (shared experts without a gate, routed weights scaled by
    routed_scaling_factor; V2: softmax scores, greedy or group_limited_greedy top-k; V3: sigmoid scores with the
    per-expert correction bias choosing, by groups' top-2 sums, noaux_tc) as HF transformers' modeling_deepseek_v2
    / v3 compute them. A layer is MoE from first_k_dense_replace on, every moe_layer_freq-th (DeepSeek's rule;
    HF ignores the frequency, 1 in every released config)."""
    n = int(hf.get("n_routed_experts") or 0)
    scoring = hf.get("scoring_func") or ("sigmoid" if family == "deepseek_v3" else "softmax")
    method = hf.get("topk_method") or ("noaux_tc" if family == "deepseek_v3" else "greedy")
    if family == "deepseek_v3" and (scoring, method) != ("sigmoid", "noaux_tc"):
        raise _unsupported(f"DeepSeek-V3 with scoring_func={scoring!r}, topk_method={method!r} (HF's V3 routing is "
                           f"sigmoid scores with noaux_tc)")
    if family == "deepseek_v2":
        if scoring != "softmax" or method not in ("greedy", "group_limited_greedy"):
            raise _unsupported(f"DeepSeek-V2 with scoring_func={scoring!r}, topk_method={method!r} (supported: "
                               f"softmax with greedy or group_limited_greedy)")
        if hf.get("norm_topk_prob"):  # HF's DeepseekV2TopkRouter never normalises; DeepSeek's own code would
            raise _unsupported("norm_topk_prob=true for DeepSeek-V2 (HF transformers ignores it; every released "
                               "V2 checkpoint has false)")
    if hf.get("ep_size", 1) != 1:
        raise _unsupported(f"ep_size={hf['ep_size']} (expert parallelism is the server's --ep)")
    grouped = method != "greedy"
    first_dense, freq = int(hf.get("first_k_dense_replace") or 0), int(hf.get("moe_layer_freq") or 1)
    return dict(
        kv_lora_rank=int(hf["kv_lora_rank"]), q_lora_rank=int(hf.get("q_lora_rank") or 0),
        qk_nope_head_dim=int(hf["qk_nope_head_dim"]), qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
        v_head_dim=int(hf["v_head_dim"]),
        rope_interleave=family == "deepseek_v2" or bool(hf.get("rope_interleave", True)),
        num_experts=n, num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0) if n else 0,
        moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(hf.get("moe_intermediate_size") or 0) * int(
            hf.get("n_shared_experts") or 0),
        shared_expert_gate=False,
        moe_layers=tuple(n > 0 and i >= first_dense and i % freq == 0 for i in range(num_layers)),
        scoring_func=scoring, topk_method=method,
        n_group=int(hf.get("n_group") or 1) if grouped else 1,
        topk_group=int(hf.get("topk_group") or 1) if grouped else 1,
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0))


def _mxfp4(hf: dict[str, Any], family: str) -> bool:
    """Whether the checkpoint declares MXFP4 weights (`quant_method: mxfp4`): GPT-OSS's experts only."""
    method = (hf.get("quantization_config") or {}).get("quant_method")
    if method == "mxfp4" and family != "gpt_oss":
        raise _unsupported(f"quantization_config quant_method 'mxfp4' for {family} (GPT-OSS's experts only)")
    return method == "mxfp4"


def _gpt_oss_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """GPT-OSS as HF transformers' modeling_gpt_oss computes it: every layer MoE (router with a bias, softmax over the
    top-k logits: softmax over all then renormalised, the same weights), experts with biases and the clamped SwiGLU,
    a sink logit per query head."""
    if hf.get("attention_dropout"):
        log.info("gpt_oss: attention_dropout=%s is a training option, not applied", hf["attention_dropout"])
    limit = float(hf.get("swiglu_limit", 7.0))
    if limit <= 0:
        raise _unsupported(f"swiglu_limit={limit} (GPT-OSS clamps its SwiGLU: expected a positive limit)")
    return dict(num_experts=int(hf["num_local_experts"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True, attention_sinks=True,
                router_bias=True, expert_bias=True, swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                swiglu_limit=limit, mxfp4_experts=_mxfp4(hf, "gpt_oss"))


def _checkpoint_quantization(hf: dict[str, Any]) -> tuple[str, int]:
    """(quantization, group) of a pre-quantized checkpoint's matmul weights (models.quantized_checkpoint); ("", 0)
    when it declares none."""
    from models.quantized_checkpoint import INT8, CheckpointQuantization
    q = CheckpointQuantization.from_config(hf)
    if q is None:
        return "", 0
    schemes = {(g.dtype, g.block[1] if g.block else 0) for g in q.groups}
    if len(schemes) != 1:
        raise _unsupported(f"quantization_config with {len(schemes)} different weight schemes (one per model only)")
    (dtype, group), = schemes
    return ("int8" if dtype == INT8 else "fp8"), group
