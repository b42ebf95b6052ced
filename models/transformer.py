"""The decoder-only transformer (Llama, Mistral, Qwen2/2.5, Qwen3, Mixtral, Qwen2/3-MoE, Phi-3, Gemma 3's layers from
`models.gemma3`, DeepSeek-V2 / V3 with multi-head latent attention: models/mla.py, GPT-OSS) in Flax NNX: `DecoderLayer`,
`CausalLM` (forward over a RaggedBatch, logits, the hooks for the native CPU kernels' weight packing and head screen)
and the KV cache it declares (`kv_cache_specs`: a `models.kv_cache.KVCacheSpec` per layer). Details: docs/models.md."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import Attention
from models.batch import RaggedBatch
from models.config import ModelConfig
from models.gemma3 import GemmaDecoderLayer, scale_embeddings, soft_cap
from models.kv_cache import KVCacheSpec
from models.layers import MLP, RMSNorm, embed_lookup, param
from models.mla import MLAttention
from models.lora import ATTENTION_TARGETS, MLP_TARGETS, LoRAProjection, LoRAStacks, lora_targets
from models.moe import MoE
from pallas_kernels import matmul as cpu_weights
from pallas_kernels.matmul import matmul
from sharding.axes import EMBED, VOCAB



def embed_inputs(config, table: jax.Array, input_ids: jax.Array) -> jax.Array:
    """Pure. The input embeddings as the model takes them: the table's rows (Gemma 3 scales them by sqrt(hidden))."""
    x = embed_lookup(table, input_ids)
    return scale_embeddings(x, config.hidden_size) if config.family == "gemma3" else x

class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, EMBED, dtype)
        self.self_attn = (MLAttention if cfg.is_mla else Attention)(cfg, layer, dtype, rngs)
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
        layer = GemmaDecoderLayer if cfg.family == "gemma3" else DecoderLayer
        self.layers = nnx.List([layer(cfg, i, dtype, rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, EMBED, dtype, cfg.rms_norm_unit_offset)
        if not cfg.tie_word_embeddings:
            self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), (EMBED, VOCAB), dtype)
        self.head_screen = nnx.data(None)  # int8 screen of the head, set by `add_head_screen` (serving, CPU)
        self.head_screen_bounds = nnx.data(None)

    def __call__(self, batch: RaggedBatch, kv_caches: list) -> tuple[jax.Array, list]:
        """Pure given the module state. Returns final-normed hidden states [T, E] and the updated caches (one per
        layer: an array or a `QuantizedKV`, as `models.kv_cache.init_kv_caches` makes them from `kv_cache_specs`)."""
        x = embed_inputs(self.config, self.embed_tokens[...], batch.input_ids)
        new_caches = []
        for layer, kv in zip(self.layers, kv_caches):
            x, kv = layer(x, batch.positions, kv, batch)
            new_caches.append(kv)
        return self.norm(x), new_caches

    def kv_cache_specs(self, *, dtype, kv_cache_dtype: str = "auto") -> tuple[KVCacheSpec, ...]:
        """The KV cache this model reads and writes, one spec per layer (`kv_cache_specs`)."""
        return kv_cache_specs(self.config, dtype=dtype, kv_cache_dtype=kv_cache_dtype)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """Pure. Float32 logits [N, vocab] of hidden states [N, E] (soft-capped where the config says)."""
        if self.config.tie_word_embeddings:  # [V, E] used transposed: XLA's dot reads it in place
            logits = jnp.dot(hidden, self.embed_tokens[...].T, preferred_element_type=jnp.float32)
        else:
            logits = matmul(hidden, self.lm_head[...], jnp.float32)
        return soft_cap(logits, self.config.final_logit_softcapping)

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
        reads the head as loaded. Not with a final soft-cap: its tanh can round two logits to one value, where the
        argmax of the raw ones would pick another token than the capped logits' lowest id."""
        if self.config.final_logit_softcapping is not None:
            return False
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
            if isinstance(a, MLAttention):
                groups += a.packing_groups()
            else:
                groups += [(a, "qkv_proj", ["q_proj", "k_proj", "v_proj"], e),
                           (a, None, ["o_proj"], cfg.num_heads * d)]
            mlps = [layer.mlp] if isinstance(layer.mlp, MLP) else \
                ([layer.mlp.shared_expert] if getattr(layer.mlp, "has_shared", False) else [])
            for m in mlps:
                groups += [(m, "gate_up_proj", ["gate_proj", "up_proj"], e),
                           (m, None, ["down_proj"], m.down_proj.shape[0])]
        if not cfg.tie_word_embeddings:
            groups.append((self, None, ["lm_head"], e))
        return groups

    def add_lora_slots(self, max_loras: int, max_rank: int, dtype, sharding=None, int8: bool = False) -> int:
        """Gives every projection LoRA may adapt (`models.lora.lora_targets`) `max_loras` zeroed adapter slots of
        rank `max_rank` in `dtype` (`int8`: int8 stacks, `models.lora.LoRAProjection`), placed by
        `sharding(axes, shape)` when given; returns how many projections."""
        count = 0
        for i, layer in enumerate(self.layers):
            targets = lora_targets(self.config, i)
            parts = [(layer.self_attn, ATTENTION_TARGETS)] + ([(layer.mlp, MLP_TARGETS)] if isinstance(layer.mlp, MLP)
                                                              else [])
            for part, names in parts:
                part.lora = LoRAStacks({n: targets[n] for n in names}, max_loras, max_rank, dtype, sharding, int8)
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
        # GPT-OSS's experts (biases, clamped SwiGLU) run on the XLA paths, which read them row-major: not packed
        moes = [layer.mlp for layer in self.layers if hasattr(layer.mlp, "replica_slots")
                and not layer.mlp.expert_bias_on and layer.mlp.swiglu is None]
        return cpu_weights.pack_groups(self.packing_groups()) + cpu_weights.pack_experts(moes)



def kv_cache_specs(cfg: ModelConfig, *, dtype, kv_cache_dtype: str = "auto") -> tuple[KVCacheSpec, ...]:
    """The KV cache of a model of `cfg`, as each layer's attention declares it (`Attention.kv_cache_spec`): values
    in `dtype` ("auto") or a quantized format of `pallas_kernels.kv_quant`. A config is enough, so the ledger sizes
    a cache without building the model."""
    attention = MLAttention if cfg.is_mla else Attention
    return tuple(attention.kv_cache_spec(cfg, layer, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
                 for layer in range(cfg.num_layers))
