"""`FakeModel`: a deterministic stand-in for the engine step, for scheduler tests and host benchmarks, whose output
changes on a wrong page, a stale prefix-cache hit or a token lost in preemption (`greedy_continuation`: the right one).
Details: docs/engine.md."""
from __future__ import annotations

from typing import Sequence

import numpy as np


class FakeModel:
    def __init__(self, num_pages: int, page_size: int, *, vocab_size: int = 1000, seed: int = 0):
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.kv = np.full((num_pages, page_size), -1, np.int64)
        self._rng = np.random.default_rng(seed)
        self._weights = np.zeros(0, np.int64)

    def _next_token(self, context: np.ndarray) -> int:
        n = len(context)
        if n > len(self._weights):
            extra = self._rng.integers(1, 1 << 31, size=max(n, 2 * len(self._weights)) - len(self._weights))
            self._weights = np.concatenate([self._weights, extra])
        return int((int(np.dot(context, self._weights[:n])) + n) % self.vocab_size)

    def step(self, scheduled: Sequence) -> list[int]:
        """Runs one step over ScheduledSequence-like chunks; returns one token per chunk (-1 where not sampled)."""
        ps, out = self.page_size, []
        for seq in scheduled:
            table = np.asarray(seq.block_table, np.int64)
            end = seq.start + len(seq.token_ids)
            pos = np.arange(seq.start, end)
            self.kv[table[pos // ps], pos % ps] = seq.token_ids
            if not seq.sample:
                out.append(-1)
                continue
            pos = np.arange(end)
            out.append(self._next_token(self.kv[table[pos // ps], pos % ps]))
        return out

    def greedy_continuation(self, prompt: Sequence[int], num_tokens: int) -> list[int]:
        """The tokens an uncorrupted run emits after `prompt` (ignoring stop conditions)."""
        tokens = list(prompt)
        for _ in range(num_tokens):
            tokens.append(self._next_token(np.asarray(tokens, np.int64)))
        return tokens[len(prompt):]
