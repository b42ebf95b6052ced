"""Attention with rotary positions over the paged KV cache: q/k/v projections (fused into one packed matrix on the
native CPU kernels), the KV write and ragged paged attention (`pallas_kernels`), per tensor-parallel shard under a
mesh."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from models.batch import RaggedBatch
from models.config import ModelConfig
from models.kv_cache import KVCacheSpec, attention_spec
from models.layers import RMSNorm, linear, linear_param, zeros
from models.lora import apply_lora, apply_lora_parts
from models.rope import apply_rope, inverse_frequencies, longrope_long_tokens
from pallas_kernels import kv_quant
from sharding.axes import EMBED, HEAD_DIM, HEADS, KV_HEADS
from sharding.mesh import axis_size, mesh_axis


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype, rngs: nnx.Rngs):
        e, hq, hkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        quant = cfg.weight_quant
        linear_param(self, "q_proj", rngs, (e, hq, d), (EMBED, HEADS, HEAD_DIM), dtype, (0,), quant)
        linear_param(self, "k_proj", rngs, (e, hkv, d), (EMBED, KV_HEADS, HEAD_DIM), dtype, (0,), quant)
        linear_param(self, "v_proj", rngs, (e, hkv, d), (EMBED, KV_HEADS, HEAD_DIM), dtype, (0,), quant)
        linear_param(self, "o_proj", rngs, (hq, d, e), (HEADS, HEAD_DIM, EMBED), dtype, (0, 1), quant)
        self.quant_group = quant.group if quant else 0
        if cfg.qkv_bias:
            self.q_bias = zeros((hq, d), (HEADS, HEAD_DIM), dtype)
            self.k_bias = zeros((hkv, d), (KV_HEADS, HEAD_DIM), dtype)
            self.v_bias = zeros((hkv, d), (KV_HEADS, HEAD_DIM), dtype)
        if cfg.o_bias:
            self.o_bias = zeros((e,), (EMBED,), dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, HEAD_DIM, dtype, cfg.rms_norm_unit_offset)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, HEAD_DIM, dtype, cfg.rms_norm_unit_offset)
        self.qkv_bias, self.o_bias_on, self.qk_norm = cfg.qkv_bias, cfg.o_bias, cfg.qk_norm
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, d
        self.qkv_proj = nnx.data(None)  # q|k|v fused and packed by `pallas_kernels.matmul.pack_groups` (then q/k/v_proj are None)
        if cfg.attention_sinks:  # GPT-OSS: a learned logit per query head in the softmax's denominator
            self.sinks = zeros((hq,), (HEADS,), jnp.float32)
        self.sinks_on = cfg.attention_sinks
        self.sm_scale = 1.0 / math.sqrt(cfg.query_pre_attn_scalar or d)
        self.logit_soft_cap = cfg.attn_logit_softcapping
        self.sliding_window = cfg.sliding_windows[layer]
        # Gemma 3's local layers rotate with their own base (rope_local), its global ones with the scaled `rope`
        rope = cfg.rope_local if self.sliding_window is not None and cfg.rope_local is not None else cfg.rope
        self.inv_freq = tuple(float(f) for f in inverse_frequencies(rope, d))
        self.rope_attention_factor = rope.attention_factor  # yarn / longrope scale cos and sin by it
        # longrope: a sequence longer than the original context rotates by the long factors (models.rope)
        self.long_inv_freq = (tuple(float(f) for f in inverse_frequencies(rope, d, long=True))
                              if rope.rope_type == "longrope" else None)
        self.rope_original = rope.original_max_position_embeddings
        self.lora = nnx.data(None)  # adapter slots of q/k/v/o (models.lora.LoRAStacks), set when serving LoRA

    @staticmethod
    def kv_cache_spec(cfg: ModelConfig, layer: int, *, dtype, kv_cache_dtype: str = "auto") -> KVCacheSpec:
        """The cache layer `layer` reads and writes: K and V of every KV head (row 2h: K of head h, 2h + 1: its
        V), over the layer's sliding window if it has one."""
        return attention_spec(cfg.num_kv_heads, cfg.head_dim, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                              sliding_window=cfg.sliding_windows[layer])

    def __call__(self, x, positions, kv_pages, batch: RaggedBatch):
        t, e = x.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        g = self.quant_group
        if self.qkv_proj is not None:
            qkv = linear(x, self, "qkv_proj", e, g)
            q = qkv[:, :hq * d].reshape(t, hq, d)
            k = qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d)
            v = qkv[:, (hq + hkv) * d:(hq + 2 * hkv) * d].reshape(t, hkv, d)
        else:
            q = linear(x, self, "q_proj", e, g).reshape(t, hq, d)
            k = linear(x, self, "k_proj", e, g).reshape(t, hkv, d)
            v = linear(x, self, "v_proj", e, g).reshape(t, hkv, d)
        slots = batch.lora_slots
        if self.lora is not None and slots is not None:
            q, k, v = apply_lora_parts(self.lora, ("q_proj", "k_proj", "v_proj"), x, (q, k, v), slots)
        if self.qkv_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        use_long = None
        if self.long_inv_freq is not None:
            use_long = batch.rope_long if batch.rope_long is not None else longrope_long_tokens(
                batch.attention.kv_lens, batch.attention.cu_q_lens, t, self.rope_original)
        q = apply_rope(q, positions, self.inv_freq, self.rope_attention_factor, self.long_inv_freq, use_long)
        k = apply_rope(k, positions, self.inv_freq, self.rope_attention_factor, self.long_inv_freq, use_long)
        # a sliding-window layer reads its window's own page pool when the batch carries one (hybrid KV cache)
        out, kv_pages = paged_attention(q, k, v, kv_pages, batch.attention_for(self.sliding_window),
                                        sm_scale=self.sm_scale, sliding_window=self.sliding_window,
                                        logit_soft_cap=self.logit_soft_cap,
                                        sinks=self.sinks[...] if self.sinks_on else None)
        # As one 2-D matmul: the einsum made XLA copy o_proj into (d, h) order every step.
        y = linear(out.reshape(t, -1), self, "o_proj", hq * d, g)
        y = apply_lora(self.lora, "o_proj", out, y, slots)
        if self.o_bias_on:
            y = y + self.o_bias[...]
        return y, kv_pages


def paged_attention(q, k, v, kv_pages, md, *, sm_scale, sliding_window, logit_soft_cap=None, sinks=None):
    """Pure. Writes this step's K/V into the pages (an array, or a `QuantizedKV`: quantised as written), then
    attends. Under a mesh that splits the heads (the rules' mesh axis for HEADS) it runs per shard (heads are
    independent): q heads split; KV heads split too when the degree divides them, else replicated, each shard
    reading only the KV heads its q heads use (a quantized cache's scales split and sliced as its values); `sinks[Hq]`
    split as the q heads."""
    tp, heads_axis = axis_size(HEADS), mesh_axis(HEADS)
    hq, hkv = q.shape[1], k.shape[1]

    def local(q, k, v, kv_pages, slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs, sinks):
        kv_pages = pallas_kernels.write_kv(kv_pages, k, v, slot_mapping)
        view = kv_pages
        if tp > 1 and k.shape[1] == hkv:  # KV replicated: slice the heads these q heads read
            group = hq // hkv
            hq_local = q.shape[1]
            first = jax.lax.axis_index(heads_axis) * hq_local // group
            view = kv_quant.slice_heads(kv_pages, 2 * first, 2 * max(1, hq_local // group))
        out = pallas_kernels.ragged_paged_attention(q, view, kv_lens, page_indices, cu_q_lens, num_seqs,
                                                    sm_scale=sm_scale, sliding_window=sliding_window,
                                                    logit_soft_cap=logit_soft_cap, sinks=sinks)
        return out, kv_pages

    args = (q, k, v, kv_pages, md.slot_mapping, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs, sinks)
    P = jax.sharding.PartitionSpec
    if tp == 1:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or mesh.size == 1 or all(t == jax.sharding.AxisType.Manual for t in mesh.axis_types):
            return local(*args)
        # A mesh that does not split the heads (e.g. experts only): every device attends on its whole copy, inside
        # shard_map (a Mosaic kernel cannot be partitioned by the compiler).
        return jax.shard_map(local, in_specs=(P(),) * len(args), out_specs=(P(), P()), check_vma=False)(*args)
    if hq % tp:
        raise ValueError(f"tensor parallelism {tp} does not divide the {hq} attention heads")
    heads = P(None, heads_axis, None)
    kv_heads = heads if hkv % tp == 0 else P()
    pages = kv_quant.partition_spec(kv_pages, P(None, None, heads_axis, None) if hkv % tp == 0 else P())
    sink_spec = None if sinks is None else P(heads_axis)
    return jax.shard_map(local, in_specs=(heads, kv_heads, kv_heads, pages, P(), P(), P(), P(), P(), sink_spec),
                         out_specs=(heads, pages), check_vma=False)(*args)
