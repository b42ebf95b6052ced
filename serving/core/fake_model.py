"""`FakeModel`: a deterministic stand-in for the engine step, for scheduler tests and host benchmarks, whose output
changes on a wrong page, a stale prefix-cache hit or a token lost in preemption (`greedy_continuation`: the right one);
with `window_maps` (a `HybridBlockManager`'s) it also reads a sliding window of tokens through each window pool's pages,
so a window page freed too early, mapped wrong or missing on a hit changes it too. Details: docs/engine.md."""
from __future__ import annotations

from typing import Sequence

import numpy as np


class FakeModel:
    def __init__(self, num_pages: int, page_size: int, *, vocab_size: int = 1000, seed: int = 0,
                 window_maps: Sequence[tuple[int, np.ndarray]] = (), window_pages: Sequence[int] = ()):
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.kv = np.full((num_pages, page_size), -1, np.int64)
        self.window_maps = list(window_maps)  # (window, primary page -> window page), updated by the block manager
        self.window_kv = [np.full((n, page_size), -1, np.int64) for n in window_pages]
        self._rng = np.random.default_rng(seed)
        self._weights = np.zeros(0, np.int64)

    def _next_token(self, context: np.ndarray, windows: Sequence[np.ndarray] = ()) -> int:
        n = len(context)
        if n > len(self._weights):
            extra = self._rng.integers(1, 1 << 31, size=max(n, 2 * len(self._weights)) - len(self._weights))
            self._weights = np.concatenate([self._weights, extra])
        # a window's tokens weigh differently from the whole context's, so reading them wrong shows
        mixed = sum(int(np.dot(w, self._weights[:len(w)][::-1])) * (i + 3) for i, w in enumerate(windows))
        return int((int(np.dot(context, self._weights[:n])) + mixed + n) % self.vocab_size)

    def step(self, scheduled: Sequence) -> list[int]:
        """Runs one step over ScheduledSequence-like chunks; returns one token per chunk (-1 where not sampled)."""
        ps, out = self.page_size, []
        for seq in scheduled:
            table = np.asarray(seq.block_table, np.int64)
            end = seq.start + len(seq.token_ids)
            pos = np.arange(seq.start, end)
            self.kv[table[pos // ps], pos % ps] = seq.token_ids
            for (_, page_of), kv in zip(self.window_maps, self.window_kv):
                pages = page_of[table[pos // ps]]
                assert (pages >= 0).all(), f"a written block has no window page: {seq}"
                kv[pages, pos % ps] = seq.token_ids
            if not seq.sample:
                out.append(-1)
                continue
            pos = np.arange(end)
            windows = []
            for (window, page_of), kv in zip(self.window_maps, self.window_kv):
                wpos = pos[max(0, end - window):]
                pages = page_of[table[wpos // ps]]
                assert (pages >= 0).all(), f"a block in the window has no window page: {seq}"
                windows.append(kv[pages, wpos % ps])
            out.append(self._next_token(self.kv[table[pos // ps], pos % ps], windows))
        return out

    def greedy_continuation(self, prompt: Sequence[int], num_tokens: int) -> list[int]:
        """The tokens an uncorrupted run emits after `prompt` (ignoring stop conditions)."""
        tokens = list(prompt)
        for _ in range(num_tokens):
            context = np.asarray(tokens, np.int64)
            windows = [context[max(0, len(tokens) - window):] for window, _ in self.window_maps]
            tokens.append(self._next_token(context, windows))
        return tokens[len(prompt):]
