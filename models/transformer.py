"""The decoder-only transformer (Llama, Mistral, Qwen2/2.5, Qwen3, Mixtral, Qwen2/3-MoE) in Flax NNX: `DecoderLayer`,
`CausalLM` (forward over a RaggedBatch, logits, the hooks for the native CPU kernels' weight packing and head screen)
and its paged KV cache (`kv_cache_shape`, `init_kv_caches`). Details: docs/models.md."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from models.attention import Attention
from models.batch import RaggedBatch
from models.config import ModelConfig
from models.layers import MLP, RMSNorm, embed_lookup, param
from models.lora import ATTENTION_TARGETS, MLP_TARGETS, LoRAProjection, LoRAStacks, lora_targets
from models.moe import MoE
from pallas_kernels import kv_quant
from pallas_kernels import matmul as cpu_weights
from pallas_kernels.kv_quant import QuantizedKV
from pallas_kernels.matmul import matmul
from sharding.axes import EMBED, VOCAB


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, EMBED, dtype)
        self.self_attn = Attention(cfg, layer, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, EMBED, dtype)
        if cfg.moe_layers[layer]:
            self.mlp = MoE(cfg, dtype, rngs, num_slots=cfg.num_expert_slots)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, rngs, cfg.weight_quant)

    def __call__(self, x, positions, kv_pages, batch):
        h, kv_pages = self.self_attn(self.input_layernorm(x), positions, kv_pages, batch)
        x = x + h
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            md = batch.attention
            valid = jnp.arange(x.shape[0]) < md.cu_q_lens[md.num_seqs[0]]
            x = x + self.mlp(h, valid)
        else:
            x = x + self.mlp(h, batch.lora_slots)
        return x, kv_pages


class CausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.config = cfg
        self.embed_tokens = param(rngs, (cfg.vocab_size, cfg.hidden_size), (VOCAB, EMBED), dtype)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype, rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, EMBED, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), (EMBED, VOCAB), dtype)
        self.head_screen = nnx.data(None)  # int8 screen of the head, set by `add_head_screen` (serving, CPU)
        self.head_screen_bounds = nnx.data(None)

    def __call__(self, batch: RaggedBatch, kv_caches: list) -> tuple[jax.Array, list]:
        """Pure given the module state. Returns final-normed hidden states [T, E] and the updated caches (one per
        layer: an array or a `QuantizedKV`, `init_kv_caches`)."""
        x = embed_lookup(self.embed_tokens[...], batch.input_ids)
        new_caches = []
        for layer, kv in zip(self.layers, kv_caches):
            x, kv = layer(x, batch.positions, kv, batch)
            new_caches.append(kv)
        return self.norm(x), new_caches

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """Pure. Float32 logits [N, vocab] of hidden states [N, E]."""
        if self.config.tie_word_embeddings:  # [V, E] used transposed: XLA's dot reads it in place
            return jnp.dot(hidden, self.embed_tokens[...].T, preferred_element_type=jnp.float32)
        return matmul(hidden, self.lm_head[...], jnp.float32)

    def screened_greedy(self, hidden: jax.Array, num_rows: jax.Array) -> jax.Array | None:
        """Pure. int32 [N]: the argmax of each row's logits (lowest id on ties) for the first `num_rows[0]` rows of
        hidden states [N, E] (the rest 0), from the head's int8 screen (`add_head_screen`); None where it cannot
        run (no screen, too many rows, or the native kernels unavailable in this trace)."""
        if self.head_screen is None:
            return None
        return cpu_weights.screened_greedy(hidden, self.head_screen[...], self.head_screen_bounds[...],
                                           self._head(), self.config.tie_word_embeddings, num_rows)

    def _head(self) -> jax.Array:
        """The LM head as held: the embedding table [V, E] when tied, else lm_head [E, V] (maybe packed)."""
        return self.embed_tokens[...] if self.config.tie_word_embeddings else self.lm_head[...]

    def add_head_screen(self) -> bool:
        """Builds the int8 screen of the LM head for the native CPU kernels' greedy head
        (`pallas_kernels.matmul.head_screen`); returns whether it could. Call it before `pack_for_cpu_kernels`: it
        reads the head as loaded."""
        screen = cpu_weights.head_screen(self._head(), self.config.tie_word_embeddings)
        if screen is None:
            return False
        self.head_screen, self.head_screen_bounds = screen
        return True

    def packing_groups(self) -> list[tuple]:
        """The dense matmul weights, grouped as `pallas_kernels.matmul.pack_groups` takes them: weights that read the
        same input fused (q|k|v -> `qkv_proj`, gate|up -> `gate_up_proj`); the attention output, down projection
        and an untied LM head alone. MoE experts and the embedding table are not matmul weights of this kind."""
        cfg = self.config
        e, d = cfg.hidden_size, cfg.head_dim
        groups = []  # (owner, fused attribute or None, [param names], rows)
        for layer in self.layers:
            a = layer.self_attn
            groups += [(a, "qkv_proj", ["q_proj", "k_proj", "v_proj"], e), (a, None, ["o_proj"], cfg.num_heads * d)]
            mlps = [layer.mlp] if isinstance(layer.mlp, MLP) else \
                ([layer.mlp.shared_expert] if getattr(layer.mlp, "has_shared", False) else [])
            for m in mlps:
                groups += [(m, "gate_up_proj", ["gate_proj", "up_proj"], e),
                           (m, None, ["down_proj"], m.down_proj.shape[0])]
        if not cfg.tie_word_embeddings:
            groups.append((self, None, ["lm_head"], e))
        return groups

    def add_lora_slots(self, max_loras: int, max_rank: int, dtype, sharding=None) -> int:
        """Gives every projection LoRA may adapt (`models.lora.lora_targets`) `max_loras` zeroed adapter slots of
        rank `max_rank` in `dtype`, placed by `sharding(axes, shape)` when given; returns how many projections."""
        count = 0
        for i, layer in enumerate(self.layers):
            targets = lora_targets(self.config, i)
            parts = [(layer.self_attn, ATTENTION_TARGETS)] + ([(layer.mlp, MLP_TARGETS)] if isinstance(layer.mlp, MLP)
                                                              else [])
            for part, names in parts:
                part.lora = LoRAStacks({n: targets[n] for n in names}, max_loras, max_rank, dtype, sharding)
                count += len(names)
        return count

    def lora_projections(self) -> list[tuple[int, str, LoRAProjection]]:
        """(layer, projection name, its LoRA slots) of every projection that has them (`add_lora_slots`)."""
        out = []
        for i, layer in enumerate(self.layers):
            for part in (layer.self_attn, layer.mlp):
                stacks = getattr(part, "lora", None)
                if stacks is not None:
                    out += [(i, name, getattr(stacks, name)) for name in lora_targets(self.config, i)
                            if hasattr(stacks, name)]
        return out

    def pack_for_cpu_kernels(self) -> int:
        """Repacks the dense matmul weights and the MoE layers' routed experts into the native CPU kernels' panels,
        in place (single-device CPU serving: the kernels then stream each weight sequentially); returns how many
        packed matrices (and expert stacks) there are."""
        moes = [layer.mlp for layer in self.layers if hasattr(layer.mlp, "replica_slots")]
        return cpu_weights.pack_groups(self.packing_groups()) + cpu_weights.pack_experts(moes)


def kv_cache_shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, int, int, int]:
    """Shape of one layer's KV pages: K and V interleaved on the head axis (of a quantized cache: its values; its
    scales are this shape less head_dim)."""
    return (num_pages, page_size, 2 * cfg.num_kv_heads, cfg.head_dim)


def init_kv_caches(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32, sharding=None,
                   kv_cache_dtype: str = "auto") -> list[jax.Array | QuantizedKV]:
    """One zeroed KV cache per layer: for kv_cache_dtype "auto" an array in the storage dtype the attention backend
    wants for `dtype` (`pallas_kernels.kv_storage_dtype`: uint16 bits for 16-bit floats on CPU); for "int8" or
    "fp8_e4m3" a `QuantizedKV` (values in that backend's storage dtype, float32 scales). `sharding` is the pages'
    (`sharding.mesh.kv_cache_sharding`); the scales take it less its head_dim entry."""
    shape = kv_cache_shape(cfg, num_pages, page_size)
    storage = pallas_kernels.kv_storage_dtype(dtype, kv_cache_dtype)
    # Committed to a device from the start, so the step's output caches match its inputs (one compile).
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if kv_cache_dtype == "auto":
        return [jnp.zeros(shape, storage, device=sharding) for _ in range(cfg.num_layers)]
    return [QuantizedKV(jnp.zeros(shape, storage, device=sharding),
                        jnp.zeros(shape[:-1], jnp.float32, device=kv_quant.scales_sharding(sharding, len(shape))))
            for _ in range(cfg.num_layers)]
