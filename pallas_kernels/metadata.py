"""`AttentionMetadata`: where each token of a ragged batch reads and writes the paged KV cache; `ragged_layout`, which
lays a step's sequences out as those arrays (with the batch's input ids, positions and logits indices).
Details: docs/attention.md."""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import numpy as np


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


def ragged_layout(token_ids: Sequence[int], starts: np.ndarray, lens: np.ndarray, tables: np.ndarray,
                  table_lens: np.ndarray, *, page_size: int, num_tokens: int, num_seqs: int) -> dict[str, np.ndarray]:
    """Host-side. The arrays of a ragged batch of S = len(lens) sequences padded to `num_tokens` tokens and
    `num_seqs` sequences: sequence i feeds `lens[i]` tokens (its share of `token_ids`, laid end to end) at
    positions starts[i] .. starts[i]+lens[i]-1, its pages the first `table_lens[i]` of `tables[i]` ([S, max_pages]).
    Returns input_ids, positions, logits_indices (each sequence's last token) and the AttentionMetadata fields,
    as numpy arrays; raises ValueError naming the sequence that does not fit."""
    s, ps, width = len(lens), page_size, tables.shape[1] if tables.ndim == 2 else 0
    lens, starts = np.asarray(lens, np.int64), np.asarray(starts, np.int64)
    total = len(token_ids)
    if total > num_tokens or s > num_seqs:
        raise ValueError(f"{total} tokens / {s} seqs do not fit bucket ({num_tokens}, {num_seqs})")
    if s and lens.min() == 0:
        raise ValueError(f"sequence {int(np.argmin(lens))} schedules no tokens")
    ends = starts + lens
    pages_needed = -(-ends // ps)
    bad = (pages_needed > width) | (pages_needed > np.asarray(table_lens))
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"sequence {i} needs {pages_needed[i]} pages; block table has {table_lens[i]},"
                         f" max_pages={width}")
    input_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.full(num_tokens, -1, np.int32)
    kv_lens = np.zeros(num_seqs, np.int32)
    page_indices = np.zeros((num_seqs, width), np.int32)
    cu_q_lens = np.zeros(num_seqs + 1, np.int32)
    logits_indices = np.zeros(num_seqs, np.int32)
    if s:
        cu = np.cumsum(lens)
        cu_q_lens[1:s + 1] = cu
        cu_q_lens[s + 1:] = total
        input_ids[:total] = token_ids
        page_indices[:s] = np.where(np.arange(width) < pages_needed[:, None], tables, 0)
        if total == s:  # decode-only step: one token per sequence
            pos = starts
            seq_of_token = np.arange(s)
        else:
            seq_of_token = np.repeat(np.arange(s), lens)
            pos = np.arange(total) - (cu - lens)[seq_of_token] + starts[seq_of_token]
        positions[:total] = pos
        slot_mapping[:total] = page_indices[seq_of_token, pos // ps] * ps + pos % ps
        kv_lens[:s] = ends
        logits_indices[:s] = cu - 1
    return dict(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, kv_lens=kv_lens,
                page_indices=page_indices, cu_q_lens=cu_q_lens, num_seqs=np.array([s], np.int32),
                logits_indices=logits_indices)
