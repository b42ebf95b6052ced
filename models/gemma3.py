"""Gemma 3 (text) over the shared layers: the decoder layer with RMSNorms before and after both attention and the
GeGLU MLP (`GemmaDecoderLayer`), the embeddings' sqrt(hidden) scale and tanh soft-capping. The rest is configuration
(`models.config`: (1 + weight) norms, q/k norms, query_pre_attn_scalar, interleaved local / global layers with their
own RoPE) read by `models.attention` and `models.layers`. Details: docs/models.md."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import Attention
from models.config import ModelConfig
from models.layers import MLP, RMSNorm
from sharding.axes import EMBED


class GemmaDecoderLayer(nnx.Module):
    """x + post_attention_norm(attn(input_norm(x))), then + post_feedforward_norm(mlp(pre_feedforward_norm(.)))
    (HF's Gemma3DecoderLayer; its names, so the checkpoint's tensors map one to one)."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype, rngs: nnx.Rngs):
        def norm():
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, EMBED, dtype, cfg.rms_norm_unit_offset)

        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, layer, dtype, rngs)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, rngs, cfg.weight_quant, cfg.hidden_act)
        self.post_feedforward_layernorm = norm()

    def __call__(self, x, positions, kv_pages, batch):
        h, kv_pages = self.self_attn(self.input_layernorm(x), positions, kv_pages, batch)
        x = x + self.post_attention_layernorm(h)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x, kv_pages


def scale_embeddings(x: jax.Array, hidden_size: int) -> jax.Array:
    """Pure. Embeddings times sqrt(hidden_size), the factor rounded to their dtype first as HF does (bf16: 48.0 for
    2304, 73.5 for 27B's 5376)."""
    return x * jnp.asarray(hidden_size ** 0.5, jnp.float32).astype(x.dtype)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """Pure. cap * tanh(x / cap) (None: x)."""
    return x if cap is None else cap * jnp.tanh(x / cap)
