"""The work plan the attention kernels share (`WorkPlan`, `make_plan`): a ragged batch cut into query blocks of at most
`block_tokens` tokens, each of one sequence, and the gather / scatter of their query rows.
Details: docs/attention.md."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class WorkPlan:
    block_tokens: int  # static: tokens per item
    num_items: jax.Array  # [] int32: real items; items beyond are empty
    item_seq: jax.Array  # [I] int32: the sequence of each item
    item_q_start: jax.Array  # [I] int32: index in T of the item's first token
    item_q_len: jax.Array  # [I] int32: tokens in the item (0 for empty items)
    item_first_pos: jax.Array  # [I] int32: absolute position of the item's first token
    token_item: jax.Array  # [T] int32: item of each token
    token_row: jax.Array  # [T] int32: index of each token inside its item
    token_valid: jax.Array  # [T] bool: real token (not padding)

    @property
    def max_items(self) -> int:
        return self.item_seq.shape[0]


def max_items(num_tokens: int, num_seqs: int, block_tokens: int) -> int:
    """Static bound on the items of any batch of this bucket: each item has >= 1 token, each seq adds <= 1."""
    return max(1, min(num_tokens, -(-num_tokens // block_tokens) + num_seqs))


def choose_block_tokens(num_tokens: int, num_seqs: int, rows_per_token: int, max_rows: int) -> int:
    """Static. Tokens per item: about the bucket's mean query length (1 for decode buckets), capped by rows."""
    mean = -(-num_tokens // max(num_seqs, 1))
    pow2 = 1 << max(0, (mean - 1).bit_length())
    return max(1, min(pow2, max_rows // rows_per_token, num_tokens))


def make_plan(cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, num_tokens: int,
              block_tokens: int) -> WorkPlan:
    """Pure. Cuts the batch into items of <= `block_tokens` consecutive tokens of one sequence."""
    s = kv_lens.shape[0]
    n = jnp.reshape(num_seqs, ()).astype(jnp.int32)
    cu = cu_q_lens.astype(jnp.int32)
    seq_ids = jnp.arange(s, dtype=jnp.int32)
    q_lens = jnp.where(seq_ids < n, cu[1:] - cu[:-1], 0)
    blocks = (q_lens + block_tokens - 1) // block_tokens
    block_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(blocks, dtype=jnp.int32)])
    num_items = block_start[s]
    i = jnp.arange(max_items(num_tokens, s, block_tokens), dtype=jnp.int32)
    item_seq = jnp.minimum(jnp.searchsorted(block_start[1:], i, side="right").astype(jnp.int32), s - 1)
    local = (i - block_start[item_seq]) * block_tokens
    real = i < num_items
    item_q_len = jnp.where(real, jnp.clip(q_lens[item_seq] - local, 0, block_tokens), 0)
    item_q_start = jnp.where(real, cu[item_seq] + local, 0)
    item_first_pos = jnp.where(real, kv_lens[item_seq] - q_lens[item_seq] + local, 0)

    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    tok_seq = jnp.minimum(jnp.searchsorted(cu[1:], tok, side="right").astype(jnp.int32), s - 1)
    tok_local = tok - cu[tok_seq]
    token_valid = tok < cu[n]
    token_item = jnp.where(token_valid, block_start[tok_seq] + tok_local // block_tokens, 0)
    token_row = jnp.where(token_valid, tok_local % block_tokens, 0)
    return WorkPlan(block_tokens, num_items, item_seq, item_q_start, item_q_len, item_first_pos,
                    token_item, token_row, token_valid)


def gather_queries(q: jax.Array, plan: WorkPlan, kv_heads: int) -> jax.Array:
    """Pure. `q[T, Hq, D]` -> `[I, Hkv, block_tokens * G, D]`; rows past an item's length are zero."""
    t, hq, d = q.shape
    g = hq // kv_heads
    bt = plan.block_tokens
    j = jnp.arange(bt, dtype=jnp.int32)
    tok = jnp.minimum(plan.item_q_start[:, None] + j, t - 1)  # [I, Bt]
    qi = q.reshape(t, kv_heads, g, d)[tok]  # [I, Bt, Hkv, G, D]
    qi = jnp.where((j[None, :] < plan.item_q_len[:, None])[:, :, None, None, None], qi, 0)
    return qi.transpose(0, 2, 1, 3, 4).reshape(-1, kv_heads, bt * g, d)


def scatter_outputs(out_items: jax.Array, plan: WorkPlan, num_query_heads: int) -> jax.Array:
    """Pure. `[I, Hkv, block_tokens * G, D]` -> `[T, Hq, D]`; padding tokens get zeros."""
    i, hkv, rows, d = out_items.shape
    g = num_query_heads // hkv
    o = out_items.reshape(i, hkv, plan.block_tokens, g, d)
    out = o[plan.token_item, :, plan.token_row]  # [T, Hkv, G, D]
    out = jnp.where(plan.token_valid[:, None, None, None], out, 0)
    return out.reshape(-1, num_query_heads, d)


def sink_rows(sinks: jax.Array, kv_heads: int, block_tokens: int, rows: int) -> jax.Array:
    """Pure. Each query head's sink logit `sinks[Hq]` laid out as an item's rows (token * G + g) per KV head:
    float32 `[Hkv, rows]`, the rows past `block_tokens * G` 0 (padding rows attend to nothing)."""
    per_head = sinks.astype(jnp.float32).reshape(kv_heads, -1)  # [Hkv, G]
    tiled = jnp.tile(per_head, (1, block_tokens))
    return jnp.pad(tiled, ((0, 0), (0, rows - tiled.shape[1])))


def pad_page_indices(page_indices: jax.Array, multiple: int) -> jax.Array:
    """Pure. Pads the block table's columns to a multiple, so fixed-size windows never run off its end."""
    s, p = page_indices.shape
    pad = (-p) % multiple
    return jnp.pad(page_indices, ((0, 0), (0, pad))) if pad else page_indices
