"""`HybridBlockManager`: the BlockManager of a KV cache whose sliding-window layers hold only their window (Gemma 3's
local layers). A request's page table holds the primary pool's pages (the full-attention layers read them all); each
sliding window has a pool of its own (`WindowPool`), in which a block has a page only while a query still to run can
read it; the prefix cache hits only where every pool still holds what the next query reads. Details: docs/engine.md.
"""
from __future__ import annotations

import collections
from typing import Iterable, Mapping

import numpy as np

from serving.core.block_manager import ROOT_PREFIX_ID, BlockManager


class WindowPool:
    """One sliding window's page pool. `page_of[p]` is the window page of the block held in primary page p (-1: none);
    a window page is referenced by each holder whose window still covers that block, kept while no one does if p is
    in the prefix cache (evictable, least recently released first), else freed."""

    def __init__(self, window: int, num_pages: int, num_primary_pages: int):
        if window < 1 or num_pages < 1:
            raise ValueError(f"a window pool needs window >= 1 and num_pages >= 1, got {window}, {num_pages}")
        self.window, self.num_pages = window, num_pages
        self.page_of = np.full(num_primary_pages, -1, np.int32)  # the batch builder gathers page tables through it
        self.owner = [-1] * num_pages  # window page -> its primary page
        self.refs = [0] * num_pages
        self.free: list[int] = list(range(num_pages - 1, -1, -1))
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()

    @property
    def num_free(self) -> int:
        """Pages it can give now: free ones plus idle cached ones (evicted on demand)."""
        return len(self.free) + len(self.evictable)

    def first_block(self, position: int, page_size: int) -> int:
        """The first block a query at `position` or later reads (`KVCacheSpec.first_needed_position`)."""
        return max(0, position - self.window + 1) // page_size

    def add(self, page: int) -> None:
        """A window page for the block just given primary page `page`."""
        w = self.free.pop() if self.free else self._evict_lru()
        self.page_of[page], self.owner[w], self.refs[w] = w, page, 1

    def take(self, page: int) -> None:
        """One more reference to primary page `page`'s window page (it must have one)."""
        w = int(self.page_of[page])
        assert w >= 0, f"primary page {page} has no page in the window-{self.window} pool"
        if self.refs[w] == 0:
            del self.evictable[w]
        self.refs[w] += 1

    def release(self, page: int, cached: bool) -> None:
        """Drops one reference to primary page `page`'s window page; unreferenced, it stays while `cached`."""
        w = int(self.page_of[page])
        self.refs[w] -= 1
        if self.refs[w] == 0:
            if cached:
                self.evictable[w] = None
            else:
                self._unmap(w)
                self.free.append(w)

    def forget(self, page: int) -> None:
        """Primary page `page` left the prefix cache (it is idle): its window page, idle too, is freed."""
        w = int(self.page_of[page])
        if w >= 0:
            del self.evictable[w]
            self._unmap(w)
            self.free.append(w)

    def _evict_lru(self) -> int:
        w, _ = self.evictable.popitem(last=False)
        self._unmap(w)
        return w

    def _unmap(self, w: int) -> None:
        self.page_of[self.owner[w]] = -1
        self.owner[w] = -1


class HybridBlockManager(BlockManager):
    """A BlockManager (the primary pool: page tables, reference counts, prefix cache) plus a `WindowPool` per sliding
    window. A holder (request, or n > 1 group) references the window pages of its blocks from its window's first
    block (`_live`) to its table's end; `slide` moves that start as it advances, releasing the blocks behind."""
    slides = True

    def __init__(self, num_pages: int, page_size: int, *, window_pages: Mapping[int, int],
                 enable_prefix_caching: bool = True, host_pages: int = 0):
        super().__init__(num_pages, page_size, enable_prefix_caching=enable_prefix_caching, host_pages=host_pages)
        if not window_pages:
            raise ValueError("HybridBlockManager needs at least one window pool (window -> pages)")
        self.pools = [WindowPool(w, n, num_pages) for w, n in window_pages.items()]
        self._live: dict[object, list[int]] = {}  # holder -> per pool, the first block whose window page it holds
        # Primary page -> the window pages its host load writes (-1: none): each holds the load's reference until
        # `loaded`, like the primary page, so nothing else gets it before the copy lands
        self._window_loads: dict[int, tuple] = {}

    @property
    def window_maps(self) -> list[tuple[int, np.ndarray]]:
        """(window, primary page -> window page) per pool, for the batch builder (updated in place)."""
        return [(pool.window, pool.page_of) for pool in self.pools]

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def num_growable_blocks(self) -> int:
        """The scarcest pool's free pages (`num_free_pages` stays the primary pool's)."""
        return min(self.num_free_pages, *(pool.num_free for pool in self.pools))

    @property
    def usage(self) -> float:
        """The fullest pool's share of pages in use."""
        return max(super().usage, *(1.0 - pool.num_free / pool.num_pages for pool in self.pools))

    def pages_held(self) -> list[int]:
        """Pages in use (referenced) per pool, the primary first."""
        return [sum(1 for r in self.ref_counts if r)] + [sum(1 for r in pool.refs if r) for pool in self.pools]

    def match_prefix(self, token_ids: list[int], max_blocks: int, root=ROOT_PREFIX_ID) -> tuple[list[int], list[int]]:
        """The longest cached prefix of full blocks after which every window pool still holds the blocks the next
        query reads (its window's); no side effects."""
        pages, ids = super().match_prefix(token_ids, max_blocks, root)
        ps, k = self.page_size, len(pages)
        for i, pool in enumerate(self.pools):
            run = 0  # blocks with a window page (or one in the host tier: `_window_held`) ending at block i
            runs = []
            for p in pages[:k]:
                run = run + 1 if self._window_held(pool, i, p) else 0
                runs.append(run)
            while k and runs[k - 1] < k - pool.first_block(k * ps, ps):
                k -= 1
        return pages[:k], ids[:k]

    def _window_held(self, pool: WindowPool, i: int, page: int) -> bool:
        """Whether the block in `page` (a host hit: negative) has its page of window pool `i`."""
        return pool.page_of[page] >= 0 if page >= 0 else self.host.windows[-1 - page][i]

    def shortfall(self, hit: list[int], num_tokens: int) -> list[int]:
        new = self.pages_for(num_tokens) - len(hit)
        out = super().shortfall(hit, num_tokens)  # the primary pool's (a host hit takes a page)
        for pool in self.pools:
            read = hit[pool.first_block(len(hit) * self.page_size, self.page_size):]
            revived = sum(1 for p in read if p >= 0 and pool.refs[pool.page_of[p]] == 0)
            loads = sum(1 for p in read if p < 0)  # a host hit the next query reads: a window page to load into
            out.append(new + loads - (pool.num_free - revived))
        return out

    def released_by(self, holder, keep: set[int]) -> list[int]:
        out = super().released_by(holder, keep)
        table, live = holder.block_table, self._live.get(holder)
        for i, pool in enumerate(self.pools):
            start = len(table) if live is None else live[i]
            out.append(sum(1 for p in table[start:] if pool.refs[pool.page_of[p]] == 1 and p not in keep))
        return out

    def can_fork(self, source, num_pages: int) -> bool:
        live = self._live.get(source)
        if not super().can_fork(source, num_pages) or live is None:
            return num_pages == 0
        return all(live[i] <= pool.first_block(num_pages * self.page_size, self.page_size)
                   for i, pool in enumerate(self.pools))

    # ---- mutations -----------------------------------------------------------------------------------------
    def acquire_cached(self, request, pages: list[int], prefix_ids: list[int]) -> None:
        """Starts the request's tables with prefix-cache hits (or a fork's pages): the primary pages, and in each
        window pool the pages of the blocks the next query reads (which must be there: match_prefix, can_fork)."""
        ps, n = self.page_size, len(pages)
        live = []
        for pool in self.pools:  # the device hits' window pages first: the loads' may evict idle ones
            first = pool.first_block(n * ps, ps)
            for p in pages[first:]:
                if p >= 0:
                    pool.take(p)
            live.append(first if n else 0)
        super().acquire_cached(request, pages, prefix_ids)  # host hits: `_load_windows` gives their window pages
        self._live[request] = live

    def _load_windows(self, index: int, num_blocks: int, slot: int, page: int) -> tuple:
        """A window page in each pool whose window the next query reads block `index` in (the host tier holds it
        there: match_prefix checked), held by the request and by the load."""
        out = []
        for pool in self.pools:
            if index < pool.first_block(num_blocks * self.page_size, self.page_size):
                out.append(-1)
                continue
            assert self.host.windows[slot][len(out)], f"host slot {slot} lacks its window-{pool.window} page"
            pool.add(page)
            w = int(pool.page_of[page])
            pool.refs[w] = 2
            out.append(w)
        self._window_loads[page] = tuple(out)
        return tuple(out)

    def _offload_windows(self, page: int) -> tuple:
        """Its window pages that are still there (a dead one, released and reused, is not offloaded)."""
        return tuple(int(pool.page_of[page]) for pool in self.pools)

    def loaded(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        for page in pages:
            for pool, w in zip(self.pools, self._window_loads.pop(page, ())):
                if w >= 0:
                    pool.release(page, self.page_key[page] is not None)
        super().loaded(pages)

    def allocate(self, request, num_tokens: int) -> bool:
        """Grows the page table to hold `num_tokens` tokens, each new block with a page in every pool (the step
        writes it). All or nothing: False if a pool is short."""
        old = len(request.block_table)
        need = self.pages_for(num_tokens) - old
        if need <= 0:
            return True
        if any(need > pool.num_free for pool in self.pools) or not super().allocate(request, num_tokens):
            return False
        self._live.setdefault(request, [old] * len(self.pools))  # nothing held before: the window starts here
        for p in request.block_table[old:]:
            for pool in self.pools:
                pool.add(p)
        return True

    def slide(self, holder, position: int) -> None:
        """Releases each window pool's blocks that no query from `position` on reads (oldest first, so the
        prefix cache keeps the newest longest)."""
        live = self._live.get(holder)
        if live is None:
            return
        table, ps, keys = holder.block_table, self.page_size, self.page_key
        for i, pool in enumerate(self.pools):
            first = min(pool.first_block(position, ps), len(table))
            for j in range(live[i], first):
                pool.release(table[j], keys[table[j]] is not None)
            if first > live[i]:
                live[i] = first

    def free(self, holder) -> None:
        self._release_windows(holder, holder.block_table, 0)
        self._live.pop(holder, None)
        super().free(holder)

    def truncate(self, request, num_computed_tokens: int) -> int:
        """BlockManager.truncate; back before the blocks a window pool still holds for it (never for rejected
        drafts: they follow the step's first query, where it slid to) the window K/V the next query reads is gone,
        and so is what would recompute it (each window reads the one before): then back to 0."""
        table, live = request.block_table, self._live.get(request)
        if live is not None and any(pool.first_block(num_computed_tokens, self.page_size) < live[i]
                                    for i, pool in enumerate(self.pools)):
            num_computed_tokens = 0
        n = super().truncate(request, num_computed_tokens)
        keep = len(request.block_table)
        self._release_windows(request, table, keep)
        if live is not None:
            live[:] = [min(first, keep) for first in live]
        return n

    def _release_windows(self, holder, table: list[int], start: int) -> None:
        """Releases the holder's window pages of blocks `start..` of `table`."""
        live, keys = self._live.get(holder), self.page_key
        if live is None:
            return
        for i, pool in enumerate(self.pools):
            for j in range(max(start, live[i]), len(table)):
                pool.release(table[j], keys[table[j]] is not None)

    def _evict_lru(self) -> int:
        page = super()._evict_lru()
        for pool in self.pools:
            pool.forget(page)
        return page

    def reset_prefix_cache(self) -> int:
        for page in self.evictable:
            for pool in self.pools:
                pool.forget(page)
        return super().reset_prefix_cache()

    # ---- invariants (tests) --------------------------------------------------------------------------------
    def check_invariants(self, requests: Iterable) -> None:
        requests = list(requests)
        super().check_invariants(requests)
        assert set(self._live) <= set(requests), "a holder no one lists still holds window pages"
        free_primary = set(self.free_pages)
        for i, pool in enumerate(self.pools):
            counts = [0] * pool.num_pages
            for ws in self._window_loads.values():  # a load in flight holds its window pages
                if ws[i] >= 0:
                    counts[ws[i]] += 1
            for r in requests:
                live = self._live.get(r)
                if live is None:
                    assert not r.block_table, f"{r} holds pages but no window pages"
                    continue
                for p in r.block_table[live[i]:]:
                    w = int(pool.page_of[p])
                    assert w >= 0, f"{r}: block of page {p} has no window-{pool.window} page"
                    counts[w] += 1
            assert counts == pool.refs, f"window-{pool.window} reference counts disagree with the holders"
            free = set(pool.free)
            assert len(free) == len(pool.free), f"window-{pool.window} free list holds a page twice"
            for w in range(pool.num_pages):
                states = (w in free) + (w in pool.evictable) + (pool.refs[w] > 0)
                assert states == 1, f"window-{pool.window} page {w} is in {states} states"
                p = pool.owner[w]
                assert (p < 0) == (w in free), f"window-{pool.window} page {w}: owner {p} disagrees with its state"
                if p >= 0:
                    assert pool.page_of[p] == w, f"window-{pool.window} page {w} and primary page {p} disagree"
                    assert p not in free_primary, f"free primary page {p} keeps window page {w}"
                if w in pool.evictable:
                    assert self.page_key[p] is not None, f"idle window page {w} of an uncached block"
            mapped = np.flatnonzero(pool.page_of >= 0)
            assert all(pool.owner[pool.page_of[p]] == p for p in mapped), "page_of disagrees with owner"

    def check_idle(self) -> None:
        self.check_invariants(())
        assert self.num_free_pages == self.num_pages, "pages leaked"
        for pool in self.pools:
            assert pool.num_free == pool.num_pages, f"window-{pool.window} pages leaked"
