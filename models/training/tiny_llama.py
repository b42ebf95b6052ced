"""A plain functional Llama (jnp only) for training the tiny models (`TinyLlamaConfig`, `init_params`, `forward`,
`token_losses`): parameters are a flat dict of HF tensor names in HF layout ([out, in] linears), so a checkpoint is the
dict itself. Numerically `models.transformer.CausalLM` and transformers' LlamaForCausalLM (test_tiny_models checks)."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class TinyLlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    bos_token_id: int = 0
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int = 2

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TinyLlamaConfig.{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_hf(self, dtype: str) -> dict:
        """The transformers `config.json` of this model, with weights stored as `dtype`."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
            "pad_token_id": self.pad_token_id,
            "initializer_range": 0.02,
            "use_cache": True,
            "dtype": dtype,
        }


def param_shapes(cfg: TinyLlamaConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, in HF layout."""
    e, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, e), "model.norm.weight": (e,)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}"
        shapes.update({
            f"{p}.input_layernorm.weight": (e,),
            f"{p}.self_attn.q_proj.weight": (cfg.num_heads * d, e),
            f"{p}.self_attn.k_proj.weight": (cfg.num_kv_heads * d, e),
            f"{p}.self_attn.v_proj.weight": (cfg.num_kv_heads * d, e),
            f"{p}.self_attn.o_proj.weight": (e, cfg.num_heads * d),
            f"{p}.post_attention_layernorm.weight": (e,),
            f"{p}.mlp.gate_proj.weight": (i, e),
            f"{p}.mlp.up_proj.weight": (i, e),
            f"{p}.mlp.down_proj.weight": (e, i),
        })
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, e)
    return shapes


def init_params(cfg: TinyLlamaConfig, key: jax.Array) -> dict[str, jax.Array]:
    """Normal(0, 0.02) matrices, residual-branch outputs scaled by 1/sqrt(2 * layers) (GPT-2), unit norms."""
    shapes = param_shapes(cfg)
    keys = jax.random.split(key, len(shapes))
    out_scale = 0.02 / math.sqrt(2 * cfg.num_layers)
    params = {}
    for k, (name, shape) in zip(keys, sorted(shapes.items())):
        if name.endswith("norm.weight"):
            params[name] = jnp.ones(shape, jnp.float32)
        else:
            std = out_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            params[name] = jax.random.normal(k, shape, jnp.float32) * std
    return params


def count_params(params: dict) -> int:
    return int(sum(np.prod(v.shape) for v in params.values()))


@jax.custom_vjp
def _linear_bf16(x: jax.Array, w: jax.Array) -> jax.Array:
    """Pure. `x @ w.T` (w [out, in], HF layout) with bfloat16 operands and float32 accumulation and result.

    On x86 CPUs with AMX or AVX512-BF16, XLA runs bf16 x bf16 -> f32 dots several times faster than f32 dots.
    The backward pass rounds the incoming gradient to bf16 too (plain autodiff would pair an f32 gradient with
    a bf16 operand, which XLA computes as a slow f32 dot); the parameter gradients come back in float32.
    """
    return jnp.einsum("...i,oi->...o", x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                      preferred_element_type=jnp.float32)


def _linear_bf16_fwd(x, w):
    x16, w16 = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    return jnp.einsum("...i,oi->...o", x16, w16, preferred_element_type=jnp.float32), (x16, w16)


def _linear_bf16_bwd(res, g):
    x16, w16 = res
    g16 = g.astype(jnp.bfloat16)
    dx = jnp.einsum("...o,oi->...i", g16, w16, preferred_element_type=jnp.float32)
    dw = jnp.einsum("...o,...i->oi", g16, x16, preferred_element_type=jnp.float32)
    return dx, dw


_linear_bf16.defvjp(_linear_bf16_fwd, _linear_bf16_bwd)


def _linear(x: jax.Array, w: jax.Array, compute_dtype) -> jax.Array:
    """`x @ w.T` for HF-layout `w` [out, in], in float32 or with bf16 operands (`compute_dtype`)."""
    if jnp.dtype(compute_dtype) == jnp.float32:
        return x @ w.T
    if jnp.dtype(compute_dtype) != jnp.bfloat16:
        raise ValueError(f"compute_dtype must be float32 or bfloat16, got {compute_dtype}")
    return _linear_bf16(x, w)


def _rms_norm(x, weight, eps):
    return weight * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))


def _rope(x, cos, sin):
    """HF rotate_half layout; x [B, T, H, D], cos/sin [T, D/2]."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, block: int) -> jax.Array:
    """Pure. Causal GQA attention, q [B, T, Hkv, G, D], k/v [B, T, Hkv, D] -> [B, T, Hkv, G, D].

    Queries go in blocks of `block` that each see only the keys up to their own end, which skips most of the
    masked upper triangle (the scores and their softmax are most of a CPU training step's time).
    """
    t, d = q.shape[1], q.shape[-1]
    if t % block or block >= t:
        block = t
    outs = []
    for start in range(0, t, block):
        end = start + block
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q[:, start:end], k[:, :end]) / math.sqrt(d)
        mask = jnp.arange(end)[None, :] <= jnp.arange(start, end)[:, None]
        probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
        outs.append(jnp.einsum("bkgqs,bskd->bqkgd", probs, v[:, :end]))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def forward(params: dict, cfg: TinyLlamaConfig, tokens: jax.Array, attention_block: int = 128,
            compute_dtype=jnp.float32) -> jax.Array:
    """Pure. Float32 logits [B, T, vocab] of token ids [B, T] (positions 0..T-1, causal).

    `compute_dtype=jnp.bfloat16` (training) gives the linear layers and the LM head bf16 operands with float32
    accumulation; everything else (norms, RoPE, attention, softmax, the residual stream) stays float32.
    """
    b, t = tokens.shape
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    freqs = jnp.arange(t, dtype=jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    x = params["model.embed_tokens.weight"][tokens]
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}"
        h = _rms_norm(x, params[f"{p}.input_layernorm.weight"], cfg.rms_norm_eps)
        q = _linear(h, params[f"{p}.self_attn.q_proj.weight"], compute_dtype).reshape(b, t, hq, d)
        k = _linear(h, params[f"{p}.self_attn.k_proj.weight"], compute_dtype).reshape(b, t, hkv, d)
        v = _linear(h, params[f"{p}.self_attn.v_proj.weight"], compute_dtype).reshape(b, t, hkv, d)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        attn = causal_attention(q.reshape(b, t, hkv, hq // hkv, d), k, v, attention_block).reshape(b, t, hq * d)
        x = x + _linear(attn, params[f"{p}.self_attn.o_proj.weight"], compute_dtype)
        h = _rms_norm(x, params[f"{p}.post_attention_layernorm.weight"], cfg.rms_norm_eps)
        mlp = (jax.nn.silu(_linear(h, params[f"{p}.mlp.gate_proj.weight"], compute_dtype))
               * _linear(h, params[f"{p}.mlp.up_proj.weight"], compute_dtype))
        x = x + _linear(mlp, params[f"{p}.mlp.down_proj.weight"], compute_dtype)
    x = _rms_norm(x, params["model.norm.weight"], cfg.rms_norm_eps)
    head = params["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    return _linear(x, head, compute_dtype)


def token_losses(params: dict, cfg: TinyLlamaConfig, tokens: jax.Array, attention_block: int = 128,
                 compute_dtype=jnp.float32) -> jax.Array:
    """Pure. Next-token negative log-likelihoods [B, T-1] of windows `tokens` [B, T]."""
    logits = forward(params, cfg, tokens[:, :-1], attention_block, compute_dtype)
    # logsumexp minus the target's logit: its gradient is a fused softmax minus one-hot, with no scatter.
    target = jnp.sum(jnp.where(jnp.arange(cfg.vocab_size) == tokens[:, 1:, None], logits, 0.0), axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - target
