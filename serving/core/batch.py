"""The one batch builder (`BatchBuilder`, `build_batch`, `build_layout`, `SeqChunk`): a step's scheduled sequences ->
the RaggedBatch the jitted step takes, and the micro-batches a pipelined step cuts them into (`split_micro_batches`,
`micro_batch_tokens`). Details: docs/engine.md."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from models.batch import RaggedBatch
from pallas_kernels.metadata import ragged_layout


@dataclasses.dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's share of a step: `token_ids` are new tokens at positions `start .. start+len-1`."""
    token_ids: Sequence[int]
    start: int  # number of tokens already in the KV cache
    block_table: Sequence[int]  # page ids holding positions 0 .. start+len-1 (and maybe more)


class BatchBuilder:
    """Builds a step's arrays, keeping a numpy copy of each scheduled block table from step to step and copying
    only the pages appended since the last step, so page_indices is one gather instead of a Python pass over every
    page of every sequence.

    Relies on the BlockManager's contract: a block-table list only grows in place; any other change (free,
    truncate, preemption) replaces the list, which shows here as a new identity and a full copy.
    """

    def __init__(self, *, page_size: int, max_pages: int, max_seqs: int):
        self.page_size, self.max_pages = page_size, max_pages
        # Hybrid KV cache: (window, primary page -> window page) per window pool, the block manager's (updated in
        # place); each step's arrays then carry every pool's slots and page table (`window_arrays`)
        self.window_maps: list[tuple[int, np.ndarray]] = []
        self.tables = np.zeros((max_seqs, max_pages), np.int32)
        self._entries: dict[int, list] = {}  # id(block_table) -> [block_table (kept alive), row, pages copied]
        self._free_rows = list(range(max_seqs - 1, -1, -1))

    def build(self, chunks: Sequence, *, num_tokens: int, num_seqs: int,
              lora_slots: Sequence[int] | None = None, rope_long: Sequence[bool] | None = None) -> RaggedBatch:
        """The step's batch of `chunks`, padded to `num_tokens` tokens and `num_seqs` sequences (numpy arrays);
        `lora_slots`: each chunk's LoRA adapter slot (-1: none; `lora_token_slots`); `rope_long`: longrope, each
        chunk's factor set (True: long; `RaggedBatch.rope_long`)."""
        return RaggedBatch.from_layout(self.layout(chunks, num_tokens=num_tokens, num_seqs=num_seqs,
                                                   lora_slots=lora_slots, rope_long=rope_long))

    def layout(self, chunks: Sequence, *, num_tokens: int, num_seqs: int,
               lora_slots: Sequence[int] | None = None, rope_long: Sequence[bool] | None = None
               ) -> dict[str, np.ndarray]:
        """`build`'s arrays by name (`ragged_layout`'s dict, `lora_slots` when a chunk has an adapter, `rope_long`
        when given)."""
        s, width = len(chunks), self.max_pages
        if s > num_seqs or s > len(self.tables):
            raise ValueError(f"{s} seqs do not fit bucket {num_seqs} (rows: {len(self.tables)})")
        lens, starts, table_lens, rows = [0] * s, [0] * s, [0] * s, [0] * s
        ids: list[int] = []
        old, new, free_rows, tables = self._entries, {}, self._free_rows, self.tables
        for i, c in enumerate(chunks):
            t, bt = c.token_ids, c.block_table
            ids += t
            lens[i], starts[i], n = len(t), c.start, len(bt)
            table_lens[i] = n
            key = id(bt)
            entry = old.pop(key, None)
            if entry is None:
                entry = new.get(key)  # the same table twice in one step: share the row
                if entry is None:
                    entry = [bt, free_rows.pop() if free_rows else self._steal_row(old), 0]
            if entry[2] < n:
                m = min(n, width)
                if entry[2] < m:
                    tables[entry[1], entry[2]:m] = bt[entry[2]:m]
                entry[2] = n
            new[key] = entry
            rows[i] = entry[1]
        for entry in old.values():
            free_rows.append(entry[1])
        self._entries = new
        arrays = ragged_layout(ids, np.array(starts, np.int64), np.array(lens, np.int64),
                               tables[np.array(rows, np.int64)], np.array(table_lens, np.int64),
                               page_size=self.page_size, num_tokens=num_tokens, num_seqs=num_seqs)
        if self.window_maps:
            window_arrays(arrays, self.window_maps, self.page_size)
        token_slots = lora_token_slots(lora_slots, lens, num_tokens)
        if token_slots is not None:
            arrays["lora_slots"] = token_slots
        if rope_long is not None:
            arrays["rope_long"] = np.zeros(num_tokens, bool)
            arrays["rope_long"][:sum(lens)] = np.repeat(np.asarray(rope_long, bool), np.asarray(lens, np.int64))
        return arrays

    def _steal_row(self, old: dict) -> int:
        """All rows are taken: reuse the row of a sequence not seen yet this step (it is re-copied if it shows)."""
        key, entry = next(iter(old.items()))
        del old[key]
        return entry[1]


def lora_token_slots(lora_slots: Sequence[int] | None, lens: Sequence[int], num_tokens: int) -> np.ndarray | None:
    """[num_tokens] int32: each token's LoRA adapter slot from its sequence's (`lora_slots`, one per sequence of
    `lens` tokens; -1: none), padding -1; None when no sequence has one (the step runs without LoRA)."""
    if lora_slots is None or not any(s >= 0 for s in lora_slots):
        return None
    if len(lora_slots) != len(lens):
        raise ValueError(f"{len(lora_slots)} LoRA slots for {len(lens)} sequences")
    out = np.full(num_tokens, -1, np.int32)
    per_token = np.repeat(np.asarray(lora_slots, np.int32), np.asarray(lens, np.int64))
    out[:len(per_token)] = per_token
    return out


def window_arrays(arrays: dict[str, np.ndarray], window_maps, page_size: int) -> None:
    """Adds to a step's arrays, per window pool, its slot mapping and page table (`RaggedBatch.window_pages`): the
    primary pages' window pages; a block without one (no query of the step reads it) points at page 0, which the
    kernels never read for it (before the window), and a token whose block has none writes nothing (-1)."""
    pages, slots = arrays["page_indices"], arrays["slot_mapping"]
    valid = slots >= 0
    block, offset = np.where(valid, slots // page_size, 0), slots % page_size
    for window, page_of in window_maps:
        arrays[f"window_page_indices_{window}"] = np.maximum(page_of[pages], 0)
        window_page = page_of[block]
        arrays[f"window_slot_mapping_{window}"] = np.where(valid & (window_page >= 0),
                                                            window_page * page_size + offset, -1).astype(np.int32)
    arrays["windows"] = tuple(window for window, _ in window_maps)


def build_layout(chunks: Sequence, *, page_size: int, num_tokens: int, num_seqs: int,
                 max_pages: int) -> dict[str, np.ndarray]:
    """Stateless: a fresh BatchBuilder's arrays by name (the engine loop keeps one BatchBuilder across steps)."""
    return BatchBuilder(page_size=page_size, max_pages=max_pages, max_seqs=max(num_seqs, len(chunks), 1)).layout(
        chunks, num_tokens=num_tokens, num_seqs=num_seqs)


def build_batch(chunks: Sequence, *, page_size: int, num_tokens: int, num_seqs: int, max_pages: int) -> RaggedBatch:
    """Stateless: `build_layout` as the RaggedBatch the jitted step takes."""
    return RaggedBatch.from_layout(build_layout(chunks, page_size=page_size, num_tokens=num_tokens,
                                                num_seqs=num_seqs, max_pages=max_pages))


def split_micro_batches(chunks: Sequence, num_tokens: int, num_micro: int) -> list[list[SeqChunk]]:
    """Cuts a step's chunks, laid end to end, into `num_micro` runs of `micro_batch_tokens(num_tokens, num_micro)`
    tokens each (when `num_micro` does not divide `num_tokens`, the step is padded to num_micro such runs: only the
    trailing ones are short or empty, and their padding writes no KV, as a bucket's padding). A chunk crossing a
    boundary is split into two pieces (the second runs after the first on every pipeline stage, so its K/V is
    already written)."""
    size = micro_batch_tokens(num_tokens, num_micro)
    total = sum(len(c.token_ids) for c in chunks)
    if total > num_tokens:
        raise ValueError(f"{total} tokens do not fit a {num_tokens}-token step")
    out: list[list[SeqChunk]] = [[] for _ in range(num_micro)]
    offset = 0
    for c in chunks:
        ids, start = list(c.token_ids), c.start
        while ids:
            m = offset // size
            take = min(len(ids), size - offset % size)
            out[m].append(SeqChunk(ids[:take], start, c.block_table))
            ids, start, offset = ids[take:], start + take, offset + take
    return out


def micro_batch_tokens(num_tokens: int, num_micro: int) -> int:
    """Tokens per micro-batch of a `num_tokens` step cut into `num_micro`: ceil(num_tokens / num_micro), so the
    padded step is num_micro times that (at most num_micro - 1 padding tokens more than the bucket)."""
    if num_micro < 1 or num_tokens < 1:
        raise ValueError(f"a step of {num_tokens} tokens cannot be cut into {num_micro} micro-batches "
                         "(both must be >= 1)")
    return -(-num_tokens // num_micro)
