"""RaggedBatch: the input of one forward step, and a host-side builder that pads it to a shape bucket.

One step runs `T` tokens from `S` sequences (prefill chunks and decode tokens mixed). `T` and `S` are padded
to bucket sizes so the number of compiled programs stays bounded.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import numpy as np

from pallas_kernels.metadata import AttentionMetadata


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["input_ids", "positions", "attention", "logits_indices"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class RaggedBatch:
    input_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    attention: AttentionMetadata
    logits_indices: jax.Array  # [S] int32: index in T of each sequence's last token this step

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seq_slots(self) -> int:
        return self.logits_indices.shape[0]


@dataclasses.dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's share of a step: `token_ids` are new tokens at positions `start .. start+len-1`."""
    token_ids: Sequence[int]
    start: int  # number of tokens already in the KV cache
    block_table: Sequence[int]  # page ids holding positions 0 .. start+len-1 (and maybe more)


def build_ragged_batch(chunks: Sequence[SeqChunk], *, page_size: int, num_tokens: int, num_seqs: int,
                       max_pages: int) -> dict[str, np.ndarray]:
    """Host-side. Lays `chunks` out as numpy arrays padded to `num_tokens` tokens and `num_seqs` sequences.

    Returns a flat dict of numpy arrays; `ragged_batch_from_arrays` turns it into a RaggedBatch.
    """
    total = sum(len(c.token_ids) for c in chunks)
    if total > num_tokens or len(chunks) > num_seqs:
        raise ValueError(f"{total} tokens / {len(chunks)} seqs do not fit bucket ({num_tokens}, {num_seqs})")
    input_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.full(num_tokens, -1, np.int32)
    kv_lens = np.zeros(num_seqs, np.int32)
    page_indices = np.zeros((num_seqs, max_pages), np.int32)
    cu_q_lens = np.zeros(num_seqs + 1, np.int32)
    logits_indices = np.zeros(num_seqs, np.int32)
    off = 0
    for i, c in enumerate(chunks):
        n = len(c.token_ids)
        if n == 0:
            raise ValueError(f"sequence {i} schedules no tokens")
        end = c.start + n
        pages_needed = -(-end // page_size)
        if pages_needed > max_pages or pages_needed > len(c.block_table):
            raise ValueError(f"sequence {i} needs {pages_needed} pages; block table has {len(c.block_table)},"
                             f" max_pages={max_pages}")
        pos = np.arange(c.start, end, dtype=np.int32)
        table = np.asarray(c.block_table[:pages_needed], np.int32)
        input_ids[off:off + n] = c.token_ids
        positions[off:off + n] = pos
        slot_mapping[off:off + n] = table[pos // page_size] * page_size + pos % page_size
        kv_lens[i] = end
        page_indices[i, :pages_needed] = table
        cu_q_lens[i + 1] = off + n
        logits_indices[i] = off + n - 1
        off += n
    cu_q_lens[len(chunks) + 1:] = off
    return dict(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, kv_lens=kv_lens,
                page_indices=page_indices, cu_q_lens=cu_q_lens, num_seqs=np.array([len(chunks)], np.int32),
                logits_indices=logits_indices)


def ragged_batch_from_arrays(a: dict) -> RaggedBatch:
    """Wraps the arrays of `build_ragged_batch` (numpy or device arrays) as a RaggedBatch pytree."""
    return RaggedBatch(
        input_ids=a["input_ids"], positions=a["positions"], logits_indices=a["logits_indices"],
        attention=AttentionMetadata(slot_mapping=a["slot_mapping"], kv_lens=a["kv_lens"],
                                    page_indices=a["page_indices"], cu_q_lens=a["cu_q_lens"],
                                    num_seqs=a["num_seqs"]))
