"""Paged attention over a multi-head latent attention cache (DeepSeek's MLA, in its absorbed form): the pure-JAX
reference (`latent_attention_reference`, the test oracle) and the shape checks every backend shares. The cache holds
per token one row [kv_lora_rank + qk_rope_head_dim]: the compressed latent c and the decoupled RoPE key; every query
head reads it, its key the whole row and its value the first `value_dim` (= kv_lora_rank) values. Details:
docs/attention.md."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import reference
from pallas_kernels.kv_quant import QuantizedKV


def check_latent_shapes(q, latent_pages, value_dim: int) -> None:
    """Static. Raises ValueError naming the shape unless q is [T, H, D] and the pages [P, page_size, 1, D] with
    0 < value_dim <= D."""
    if q.ndim != 3 or len(latent_pages.shape) != 4 or latent_pages.shape[2] != 1 or \
            latent_pages.shape[3] != q.shape[2]:
        raise ValueError(f"latent attention: q {tuple(q.shape)} and pages {tuple(latent_pages.shape)}: expected "
                         f"q [T, H, D] over pages [P, page_size, 1, D]")
    if not 0 < value_dim <= q.shape[2]:
        raise ValueError(f"latent attention: value_dim={value_dim} must be in [1, {q.shape[2]}]")


def latent_attention_reference(q, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale: float,
                               value_dim: int):
    """Pure. Causal attention of `q[T, H, D]` (queries already absorbed into the latent space: [W_UK q_nope, q_pe])
    over each token's own sequence's latent rows [P, page_size, 1, D] (an array, or a `QuantizedKV`) ->
    `[T, H, value_dim]`: scores q . row, values row[:value_dim]. Simple and memory-hungry (each token's whole KV
    range gathered); rows of padding tokens are zero."""
    check_latent_shapes(q, latent_pages, value_dim)
    t, h, d = q.shape
    page_size = latent_pages.shape[1]
    s, max_pages = page_indices.shape
    seq, pos, valid = reference.token_positions(cu_q_lens, kv_lens, num_seqs, t)
    kv_dtype = jnp.float32 if isinstance(latent_pages, QuantizedKV) else q.dtype
    rows = reference.read_pages(latent_pages, page_indices, kv_dtype).reshape(s, max_pages * page_size, d)
    rows = rows[seq].astype(jnp.float32)  # [T, L, D]
    scores = jnp.einsum("thd,tld->thl", q.astype(jnp.float32), rows) * sm_scale
    kv_pos = jnp.arange(max_pages * page_size, dtype=jnp.int32)
    mask = (kv_pos[None, :] <= pos[:, None]) & (kv_pos[None, :] < kv_lens[seq][:, None]) & valid[:, None]
    scores = jnp.where(mask[:, None, :], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask[:, None, :], jnp.exp(scores - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("thl,tlv->thv", p / jnp.where(denom == 0, 1.0, denom), rows[..., :value_dim])
    return out.astype(q.dtype)


def latent_rows(c: jax.Array, k_pe: jax.Array) -> jax.Array:
    """Pure. The cache rows of this step's tokens, [T, 1, kv_lora_rank + qk_rope_head_dim]: the normed latent
    c [T, kv_lora_rank] and the rotated key k_pe [T, qk_rope_head_dim] side by side."""
    return jnp.concatenate([c, k_pe], axis=-1)[:, None, :]
