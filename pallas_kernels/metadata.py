"""AttentionMetadata: where each token of a ragged batch reads and writes the paged KV cache.

A ragged batch is `T` tokens from `S` sequences laid end to end (prefill chunks and single decode tokens
mixed). Sequence `s` owns tokens `cu_q_lens[s]:cu_q_lens[s+1]`; after this step it holds `kv_lens[s]` tokens
of KV (the new ones included), in the pages `page_indices[s, :]`. Padding tokens have `slot_mapping == -1`;
padding sequences (index >= num_seqs) have zero query length and zero KV length.
"""
from __future__ import annotations

import dataclasses
import functools

import jax


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["slot_mapping", "kv_lens", "page_indices", "cu_q_lens", "num_seqs"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: jax.Array  # [T] int32: page * page_size + offset of each new token's K/V; -1 = padding
    kv_lens: jax.Array  # [S] int32: KV length of each sequence after this step
    page_indices: jax.Array  # [S, max_pages] int32: block table of each sequence
    cu_q_lens: jax.Array  # [S + 1] int32: cumulative query lengths
    num_seqs: jax.Array  # [1] int32: real sequences; the rest of S is padding
