"""Multi-head latent attention (DeepSeek-V2 / V3): queries (q_proj, or q_a_proj -> norm -> q_b_proj), the compressed
latent and the decoupled RoPE key (kv_a_proj_with_mqa -> kv_a_layernorm), one latent row per token in the paged
cache (`latent_spec`), attention in the absorbed form (queries taken into the latent space by W_UK, every head
reading each row once, outputs out of it by W_UV), per tensor-parallel shard of heads under a mesh."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from models.batch import RaggedBatch
from models.config import ModelConfig
from models.kv_cache import KVCacheSpec, latent_spec
from models.layers import RMSNorm, linear, linear_param, param
from models.rope import apply_rope, inverse_frequencies
from pallas_kernels import kv_quant, mla
from sharding.axes import EMBED, HEAD_DIM, HEADS
from sharding.mesh import axis_size, mesh_axis


def softmax_scale(cfg: ModelConfig) -> float:
    """1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), times YaRN's mscale(factor, mscale_all_dim)^2 where the rope is
    scaled and mscale_all_dim set: DeepSeek scales every dimension's logits, not only the rotated ones (HF
    `yarn_apply_mscale`)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = cfg.rope
    if rope.rope_type != "default" and rope.mscale_all_dim and rope.factor > 1:
        mscale = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= mscale * mscale
    return scale


class MLAttention(nnx.Module):
    """Weights in our layout: q_a_proj [E, Rq], q_b_proj [Rq, H, Dn + Dr] (or q_proj [E, H, Dn + Dr]),
    kv_a_proj_with_mqa [E, R + Dr], kv_b_proj [R, H, Dn + Dv] (W_UK = [..., :Dn], W_UV = [..., Dn:]; float: it is
    read by two einsums, never a matmul of its own), o_proj [H, Dv, E]. The RoPE values of each query head and of the
    key are in rotate-half order (the loader de-interleaves DeepSeek's pairs: a dot product is the same)."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype, rngs: nnx.Rngs):
        e, h = cfg.hidden_size, cfg.num_heads
        dn, dr, dv, r, rq = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank,
                             cfg.q_lora_rank)
        quant = cfg.weight_quant
        if rq:
            linear_param(self, "q_a_proj", rngs, (e, rq), (EMBED, None), dtype, (0,), quant)
            self.q_a_layernorm = RMSNorm(rq, cfg.rms_norm_eps, None, dtype)
            linear_param(self, "q_b_proj", rngs, (rq, h, dn + dr), (None, HEADS, HEAD_DIM), dtype, (0,), quant)
        else:
            linear_param(self, "q_proj", rngs, (e, h, dn + dr), (EMBED, HEADS, HEAD_DIM), dtype, (0,), quant)
        linear_param(self, "kv_a_proj_with_mqa", rngs, (e, r + dr), (EMBED, None), dtype, (0,), quant)
        self.kv_a_layernorm = RMSNorm(r, cfg.rms_norm_eps, None, dtype)
        self.kv_b_proj = param(rngs, (r, h, dn + dv), (None, HEADS, HEAD_DIM), dtype)
        linear_param(self, "o_proj", rngs, (h, dv, e), (HEADS, HEAD_DIM, EMBED), dtype, (0, 1), quant)
        self.quant_group = quant.group if quant else 0
        # The first matmuls read x alike: fused and packed by `pallas_kernels.matmul.pack_groups` (parts then None)
        self.fused_a_proj = nnx.data(None)
        self.hidden, self.num_heads, self.dims = e, h, (dn, dr, dv, r, rq)
        self.sm_scale = softmax_scale(cfg)
        self.inv_freq = tuple(float(f) for f in inverse_frequencies(cfg.rope, dr))
        self.rope_attention_factor = cfg.rope.attention_factor

    @staticmethod
    def kv_cache_spec(cfg: ModelConfig, layer: int, *, dtype, kv_cache_dtype: str = "auto") -> KVCacheSpec:
        """One latent row per token: kv_lora_rank + qk_rope_head_dim values (the normed latent, the rotated key)."""
        return latent_spec(cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=dtype, kv_cache_dtype=kv_cache_dtype)

    def packing_groups(self) -> list[tuple]:
        """The matmul weights as `pallas_kernels.matmul.pack_groups` takes them: q_a (or q) | kv_a fused (both read
        x), q_b and o_proj alone."""
        dn, dr, dv, r, rq = self.dims
        first = "q_a_proj" if rq else "q_proj"
        groups = [(self, "fused_a_proj", [first, "kv_a_proj_with_mqa"], self.hidden)]
        if rq:
            groups.append((self, None, ["q_b_proj"], rq))
        return groups + [(self, None, ["o_proj"], self.num_heads * dv)]

    def project(self, x):
        """Pure. Per token: queries q [T, H, Dn + Dr] (RoPE not yet applied), the normed latent c [T, R] and the key's
        RoPE part k_pe [T, Dr] (not yet rotated)."""
        t, e = x.shape
        dn, dr, dv, r, rq = self.dims
        h, g = self.num_heads, self.quant_group
        first = rq or h * (dn + dr)
        if self.fused_a_proj is not None:
            both = linear(x, self, "fused_a_proj", e, g)
            q_a, kv_a = both[:, :first], both[:, first:]
        else:
            q_a = linear(x, self, "q_a_proj" if rq else "q_proj", e, g)
            kv_a = linear(x, self, "kv_a_proj_with_mqa", e, g)
        q = linear(self.q_a_layernorm(q_a), self, "q_b_proj", rq, g) if rq else q_a
        return q.reshape(t, h, dn + dr), self.kv_a_layernorm(kv_a[:, :r]), kv_a[:, r:]

    def __call__(self, x, positions, kv_pages, batch: RaggedBatch):
        t = x.shape[0]
        dn, dr, dv, r, rq = self.dims
        h = self.num_heads
        q, c, k_pe = self.project(x)
        q_pe = apply_rope(q[..., dn:], positions, self.inv_freq, self.rope_attention_factor)
        k_pe = apply_rope(k_pe[:, None, :], positions, self.inv_freq, self.rope_attention_factor)[:, 0]
        w = self.kv_b_proj[...]
        # Absorbed: q_nope . (W_UK^T c) = (W_UK q_nope) . c, so one latent row serves every head.
        q_latent = jnp.einsum("thn,rhn->thr", q[..., :dn], w[..., :dn],
                              preferred_element_type=jnp.float32).astype(q.dtype)
        queries = jnp.concatenate([q_latent, q_pe], axis=-1)  # [T, H, R + Dr]
        out, kv_pages = paged_latent_attention(queries, mla.latent_rows(c, k_pe), kv_pages, batch.attention,
                                               sm_scale=self.sm_scale, value_dim=r)
        o = jnp.einsum("thr,rhv->thv", out, w[..., dn:], preferred_element_type=jnp.float32).astype(x.dtype)
        return linear(o.reshape(t, h * dv), self, "o_proj", h * dv, self.quant_group), kv_pages


def paged_latent_attention(queries, rows, latent_pages, md, *, sm_scale, value_dim):
    """Pure. Writes this step's latent rows [T, 1, D] into the pages (an array or a `QuantizedKV`), then attends.
    Under a mesh that splits the heads every shard holds the whole latent cache (one row serves every head): each
    writes the same rows into its copy and attends its heads."""
    tp, heads_axis = axis_size(HEADS), mesh_axis(HEADS)
    h = queries.shape[1]

    def local(queries, rows, pages, slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs):
        pages = pallas_kernels.write_latent(pages, rows, slot_mapping)
        out = pallas_kernels.ragged_paged_latent_attention(queries, pages, kv_lens, page_indices, cu_q_lens,
                                                           num_seqs, sm_scale=sm_scale, value_dim=value_dim)
        return out, pages

    args = (queries, rows, latent_pages, md.slot_mapping, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs)
    P = jax.sharding.PartitionSpec
    pages = kv_quant.partition_spec(latent_pages, P())
    if tp == 1:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or mesh.size == 1 or all(t == jax.sharding.AxisType.Manual for t in mesh.axis_types):
            return local(*args)
        heads = P()
    elif h % tp:
        raise ValueError(f"tensor parallelism {tp} does not divide the {h} attention heads")
    else:
        heads = P(None, heads_axis, None)
    return jax.shard_map(local, in_specs=(heads, P(), pages, P(), P(), P(), P(), P()), out_specs=(heads, pages),
                         check_vma=False)(*args)
