"""`BlockManager`: the KV cache's pages (free list, reference counts, per-request block tables, forks sharing a
request's pages with another) and the prefix cache (full blocks keyed by their parent block's id and their tokens,
compared exactly on a hit, evicted in LRU order). Details: docs/engine.md."""
from __future__ import annotations

import collections
import itertools
from typing import Iterable

from serving.core.request import Request

ROOT_PREFIX_ID = 0


def prefix_root(request: Request) -> int:
    """The prefix-cache parent of a request's first block: ROOT_PREFIX_ID for the base model, for a LoRA adapter
    minus its load's uid (never a block's id, which count up from 1): a page computed under one adapter never serves
    another, nor the base model."""
    adapter = request.adapter
    return ROOT_PREFIX_ID if adapter is None else -adapter.uid


class BlockManager:
    # Whether pages can die before their request ends (a sliding window's: `HybridBlockManager`); the scheduler then
    # calls `slide` as requests advance.
    slides = False

    def __init__(self, num_pages: int, page_size: int, *, enable_prefix_caching: bool = True):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self.free_pages: list[int] = list(range(num_pages - 1, -1, -1))  # a stack; pops page 0 first
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.cache: dict[tuple, int] = {}  # (parent_id, tokens) -> page
        self.page_key: list[tuple | None] = [None] * num_pages
        self.page_prefix_id: list[int] = [ROOT_PREFIX_ID] * num_pages
        self.forked = [False] * num_pages  # shared by fork() (until no one holds it): may be shared uncached
        self._next_prefix_id = itertools.count(ROOT_PREFIX_ID + 1)

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages a request can take now: free ones plus idle cached ones (evicted on demand)."""
        return len(self.free_pages) + len(self.evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_pages / self.num_pages

    @property
    def num_growable_blocks(self) -> int:
        """Blocks the request tables can grow by now (every pool gives each new block a page)."""
        return len(self.free_pages) + len(self.evictable)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def match_prefix(self, token_ids: list[int], max_blocks: int,
                     root: int = ROOT_PREFIX_ID) -> tuple[list[int], list[int]]:
        """Longest run of cached full blocks at the start of `token_ids` (at most `max_blocks`) under `root`
        (`prefix_root`); no side effects.

        Returns (pages, prefix ids), one per matched block.
        """
        pages: list[int] = []
        ids: list[int] = []
        if not self.enable_prefix_caching:
            return pages, ids
        parent, ps = root, self.page_size
        for i in range(min(max_blocks, len(token_ids) // ps)):
            page = self.cache.get((parent, tuple(token_ids[i * ps:(i + 1) * ps])))
            if page is None:
                break
            parent = self.page_prefix_id[page]
            pages.append(page)
            ids.append(parent)
        return pages, ids

    def num_idle_among(self, pages: Iterable[int]) -> int:
        """How many of `pages` are idle cached pages (taking them shrinks num_free_pages)."""
        refs = self.ref_counts
        return sum(1 for p in pages if refs[p] == 0)

    def shortfall(self, hit: list[int], num_tokens: int) -> list[int]:
        """Per page pool, the pages missing for a new request that takes the prefix-cache `hit` (match_prefix's
        pages) and grows to `num_tokens` tokens (> 0: that many must be freed first)."""
        return [self.pages_for(num_tokens) - len(hit) - (self.num_free_pages - self.num_idle_among(hit))]

    def released_by(self, holder, keep: set[int]) -> list[int]:
        """Per page pool, the pages freeing `holder` surely gives back (held by it alone), not counting pages in
        `keep` (a hit about to be taken again)."""
        refs = self.ref_counts
        return [sum(1 for p in holder.block_table if refs[p] == 1 and p not in keep)]

    def can_fork(self, source, num_pages: int) -> bool:
        """Whether `source` holds what `fork(holder, source, num_pages)` shares (its first `num_pages` pages)."""
        return len(source.block_table) >= num_pages

    def slide(self, holder, position: int) -> None:
        """Before a step whose first query of `holder` is at `position`: releases what no query from there on
        reads. One pool of full-attention pages: nothing."""

    # ---- mutations -----------------------------------------------------------------------------------------
    def acquire_cached(self, request: Request, pages: list[int], prefix_ids: list[int]) -> None:
        """Starts an empty request's block table with prefix-cache hits from match_prefix (or pages of a fork)."""
        assert not request.block_table, "acquire_cached on a request that already holds pages"
        refs = self.ref_counts
        for p in pages:
            if refs[p] == 0:
                del self.evictable[p]
            refs[p] += 1
        request.block_table = list(pages)
        request.block_prefix_ids = list(prefix_ids)
        request.num_computed_tokens = len(pages) * self.page_size

    def fork(self, holder, source, num_pages: int) -> None:
        """Shares the first `num_pages` pages of `source`'s block table with `holder` (an empty Request, or a
        SampleGroup), by reference count, with their prefix-cache ids: the samples of an n > 1 request read their
        prompt's K/V from the same pages, prefix caching or not. The pages must hold computed K/V (or be computed
        by a step that runs before any step of `holder`) and are never written again while shared."""
        pages = source.block_table[:num_pages]
        assert len(pages) == num_pages, f"fork of {num_pages} pages from {source}, which holds {len(pages)}"
        for p in pages:
            self.forked[p] = True
        self.acquire_cached(holder, pages, source.block_prefix_ids[:num_pages])

    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Grows the block table to hold `num_tokens` tokens. All or nothing: False if pages are short."""
        need = -(-num_tokens // self.page_size) - len(request.block_table)
        if need <= 0:
            return True
        if need > len(self.free_pages) + len(self.evictable):
            return False
        table, refs = request.block_table, self.ref_counts
        for _ in range(need):
            page = self.free_pages.pop() if self.free_pages else self._evict_lru()
            refs[page] = 1
            table.append(page)
        return True

    def _evict_lru(self) -> int:
        """Forgets the least recently used idle cached block; returns its page."""
        page, _ = self.evictable.popitem(last=False)
        del self.cache[self.page_key[page]]
        self.page_key[page] = None
        return page

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Registers the request's full blocks whose K/V is computed (call after the step that wrote them)."""
        if not self.enable_prefix_caching:
            return
        ps, ids = self.page_size, request.block_prefix_ids
        full = num_computed_tokens // ps
        if full <= len(ids):
            return
        tokens, table = request.token_ids, request.block_table
        for i in range(len(ids), full):
            key = (ids[-1] if ids else prefix_root(request), tuple(tokens[i * ps:(i + 1) * ps]))
            existing = self.cache.get(key)
            if existing is not None:  # the same prefix was computed elsewhere: chain through that entry
                ids.append(self.page_prefix_id[existing])
                continue
            page = table[i]
            if self.page_key[page] is not None:
                # a forked page a sibling sample registered under its own chain (same tokens, the parent block's
                # other cache id): continue along that chain
                assert self.forked[page] and self.page_key[page][1] == key[1], "page registered twice"
                ids.append(self.page_prefix_id[page])
                continue
            prefix_id = next(self._next_prefix_id)
            self.cache[key] = page
            self.page_key[page] = key
            self.page_prefix_id[page] = prefix_id
            ids.append(prefix_id)

    def free(self, request: Request) -> None:
        """Drops the request's references; cached pages become evictable, tail blocks first (they are rarer)."""
        self._release(reversed(request.block_table))
        request.block_table = []  # a new list: a batch already built from the old one stays valid
        request.block_prefix_ids = []
        request.num_computed_tokens = 0

    def truncate(self, request: Request, num_computed_tokens: int) -> int:
        """Rolls the request's K/V back to `num_computed_tokens` (e.g. rejected draft tokens), freeing tail pages.

        A partly kept page that is a shared cached (or forked) block must not be written again, so the roll-back
        then goes to that block's start. Returns the new num_computed_tokens.
        """
        n = min(num_computed_tokens, request.num_computed_tokens)
        ps = self.page_size
        keep = -(-n // ps)
        if n % ps and (self.page_key[request.block_table[keep - 1]] is not None
                       or self.forked[request.block_table[keep - 1]]):
            keep -= 1
            n = keep * ps
        self._release(reversed(request.block_table[keep:]))
        request.block_table = request.block_table[:keep]
        del request.block_prefix_ids[n // ps:]
        request.num_computed_tokens = n
        return n

    def _release(self, pages: Iterable[int]) -> None:
        """Drops one reference to each page; a page no one holds becomes evictable (cached) or free."""
        refs = self.ref_counts
        for page in pages:
            refs[page] -= 1
            if refs[page] == 0:
                self.forked[page] = False
                if self.page_key[page] is not None:
                    self.evictable[page] = None
                else:
                    self.free_pages.append(page)

    def reset_prefix_cache(self) -> int:
        """Forgets every idle cached block (e.g. after new weights are loaded). Returns how many were dropped."""
        n = len(self.evictable)
        for page in self.evictable:
            del self.cache[self.page_key[page]]
            self.page_key[page] = None
            self.free_pages.append(page)
        self.evictable.clear()
        return n

    # ---- invariants (tests) --------------------------------------------------------------------------------
    def check_invariants(self, requests: Iterable[Request]) -> None:
        """Raises AssertionError if the books disagree with the block tables of `requests` (all live requests, and
        every other holder of pages: a SampleGroup's fork)."""
        counts = [0] * self.num_pages
        for r in requests:
            assert len(set(r.block_table)) == len(r.block_table), f"{r} holds a page twice"
            assert len(r.block_table) * self.page_size >= r.num_computed_tokens, f"{r} computed beyond its pages"
            for p in r.block_table:
                counts[p] += 1
        assert counts == self.ref_counts, "reference counts disagree with block tables"
        free, idle = set(self.free_pages), set(self.evictable)
        assert len(free) == len(self.free_pages), "free list holds a page twice"
        for p in range(self.num_pages):
            in_use = counts[p] > 0
            assert (p in free) + (p in idle) + in_use == 1, f"page {p} is in more or less than one state"
            if p in free:
                assert self.page_key[p] is None, f"free page {p} is still cached"
            if p in idle:
                assert self.page_key[p] is not None, f"evictable page {p} is not cached"
            if counts[p] > 1:
                assert self.page_key[p] is not None or self.forked[p], (
                    f"page {p} shared by {counts[p]} requests but not cached (nor forked)")
            if counts[p] == 0:
                assert not self.forked[p], f"page {p} is marked forked but no one holds it"
        assert {self.cache[k]: k for k in self.cache} == {p: k for p, k in enumerate(self.page_key)
                                                          if k is not None}, "cache index disagrees with pages"

    def check_idle(self) -> None:
        """The idle invariant: with no live request, every page is free or held by the prefix cache."""
        self.check_invariants(())
        assert self.num_free_pages == self.num_pages, "pages leaked"
