"""build_batch_arrays: a vectorised twin of models.batch.build_ragged_batch for the host's hot path.

Same inputs (anything with `token_ids`, `start`, `block_table`, e.g. ScheduledSequence or SeqChunk) and the same
dict of numpy arrays, built with a handful of NumPy calls instead of a Python loop of them per sequence.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def build_batch_arrays(chunks: Sequence, *, page_size: int, num_tokens: int, num_seqs: int,
                       max_pages: int) -> dict[str, np.ndarray]:
    """Stateless: a fresh BatchBuilder's arrays (the engine loop keeps one BatchBuilder across steps)."""
    return BatchBuilder(page_size=page_size, max_pages=max_pages, max_seqs=max(num_seqs, len(chunks), 1)).build(
        chunks, num_tokens=num_tokens, num_seqs=num_seqs)


class BatchBuilder:
    """Stateful build_batch_arrays for the engine loop: keeps a numpy copy of each scheduled block table and copies
    only the pages appended since the last step, so page_indices is one gather instead of a Python pass over
    every page of every sequence.

    Relies on the BlockManager's contract: a block-table list only grows in place; any other change (free,
    truncate, preemption) replaces the list, which shows here as a new identity and a full copy.
    """

    def __init__(self, *, page_size: int, max_pages: int, max_seqs: int):
        self.page_size, self.max_pages = page_size, max_pages
        self.tables = np.zeros((max_seqs, max_pages), np.int32)
        self._entries: dict[int, list] = {}  # id(block_table) -> [block_table (kept alive), row, pages copied]
        self._free_rows = list(range(max_seqs - 1, -1, -1))

    def build(self, chunks: Sequence, *, num_tokens: int, num_seqs: int) -> dict[str, np.ndarray]:
        s, ps, width = len(chunks), self.page_size, self.max_pages
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

        lens_a, starts_a = np.array(lens, np.int64), np.array(starts, np.int64)
        total = len(ids)
        if total > num_tokens:
            raise ValueError(f"{total} tokens / {s} seqs do not fit bucket ({num_tokens}, {num_seqs})")
        if s and lens_a.min() == 0:
            raise ValueError(f"sequence {int(np.argmin(lens_a))} schedules no tokens")
        ends = starts_a + lens_a
        pages_needed = -(-ends // ps)
        bad = (pages_needed > width) | (pages_needed > np.array(table_lens))
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
            cu = np.cumsum(lens_a)
            cu_q_lens[1:s + 1] = cu
            cu_q_lens[s + 1:] = total
            input_ids[:total] = ids
            gathered = tables[np.array(rows)]
            page_indices[:s] = np.where(np.arange(width) < pages_needed[:, None], gathered, 0)
            if total == s:  # decode-only step: one token per sequence
                pos = starts_a
                seq_of_token = np.arange(s)
            else:
                seq_of_token = np.repeat(np.arange(s), lens_a)
                pos = np.arange(total) - (cu - lens_a)[seq_of_token] + starts_a[seq_of_token]
            positions[:total] = pos
            slot_mapping[:total] = page_indices[seq_of_token, pos // ps] * ps + pos % ps
            kv_lens[:s] = ends
            logits_indices[:s] = cu - 1
        return dict(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, kv_lens=kv_lens,
                    page_indices=page_indices, cu_q_lens=cu_q_lens, num_seqs=np.array([s], np.int32),
                    logits_indices=logits_indices)

    def _steal_row(self, old: dict) -> int:
        """All rows are taken: reuse the row of a sequence not seen yet this step (it is re-copied if it shows)."""
        key, entry = next(iter(old.items()))
        del old[key]
        return entry[1]
