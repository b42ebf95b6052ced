"""`BlockManager`: the KV cache's pages (free list, reference counts, per-request block tables, forks sharing a
request's pages with another) and the prefix cache (full blocks keyed by their parent block's id and their tokens,
compared exactly on a hit, evicted in LRU order), with an optional host-memory tier under it (`HostTier`: evicted
blocks go there and come back on a hit). Details: docs/engine.md."""
from __future__ import annotations

import collections
import itertools
from typing import Iterable

from serving.core.request import Request

ROOT_PREFIX_ID = 0
# The tiers as KV events name them (vLLM's medium names: the device's, the host's)
DEVICE_MEDIUM, HOST_MEDIUM = "GPU", "CPU"


def host_hit(slot: int) -> int:
    """match_prefix's entry for a block held in host slot `slot` (negative: never a device page)."""
    return -1 - slot


class HostTier:
    """The host tier's books (the data lives in `serving.core.host_kv.HostKVPool`): `num_slots` host pages, each
    free or holding one idle cached block (LRU order); a block lives in one tier at a time. `ops` lists the copies
    the books already assume, in order, for the engine to run before the step: ("offload", device page, slot,
    windows) and ("load", slot, device page, windows), `windows` the block's page in each sliding-window pool (a
    hybrid cache's; -1: none moves) and () without one."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a host tier needs >= 1 page, got {num_slots}")
        self.num_slots = num_slots
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.cache: dict[tuple, int] = {}  # (parent_id, tokens) -> slot
        self.key: list[tuple | None] = [None] * num_slots
        self.prefix_id: list[int] = [ROOT_PREFIX_ID] * num_slots
        self.ops: list[tuple[str, int, int, tuple]] = []
        self.windows: list[tuple[bool, ...]] = [()] * num_slots  # per slot, per window pool: whether it holds it
        self.hit_blocks = self.offloaded_pages = self.loaded_pages = self.dropped_blocks = 0

    @property
    def num_used(self) -> int:
        return len(self.lru)

    def store(self, key: tuple, prefix_id: int, page: int, windows: tuple = ()) -> int | None:
        """Device page `page` (idle, cached under `key`; `windows`: its window pools' pages, -1 where it has none)
        is leaving the device: keep its block here (evicting the host LRU block if full). Returns the prefix id of
        the block it dropped, if any."""
        dropped = None
        if self.free:
            slot = self.free.pop()
        else:
            slot, _ = self.lru.popitem(last=False)
            del self.cache[self.key[slot]]
            dropped = self.prefix_id[slot]
            self.dropped_blocks += 1
        self.cache[key], self.key[slot], self.prefix_id[slot] = slot, key, prefix_id
        self.lru[slot] = None
        self.windows[slot] = tuple(w >= 0 for w in windows)
        self.ops.append(("offload", page, slot, windows))
        self.offloaded_pages += 1
        return dropped

    def take(self, slot: int) -> tuple[tuple, int]:
        """Removes slot's block from the tier (a hit is loading it); returns (key, prefix id). The slot is free
        once the load listed after this is queued (`load`)."""
        del self.lru[slot]
        key = self.key[slot]
        del self.cache[key]
        self.key[slot] = None
        return key, self.prefix_id[slot]

    def load(self, slot: int, page: int, windows: tuple = ()) -> None:
        self.ops.append(("load", slot, page, windows))
        self.free.append(slot)
        self.loaded_pages += 1
        self.hit_blocks += 1

    def reset(self) -> list[int]:
        """Forgets every block; returns their prefix ids."""
        out = [self.prefix_id[s] for s in self.lru]
        for slot in self.lru:
            del self.cache[self.key[slot]]
            self.key[slot] = None
            self.free.append(slot)
        self.lru.clear()
        return out

    def check_invariants(self) -> None:
        free, used = set(self.free), set(self.lru)
        assert len(free) == len(self.free), "host free list holds a slot twice"
        assert not free & used and len(free) + len(used) == self.num_slots, "host slots leaked"
        assert {s: k for k, s in self.cache.items()} == {s: self.key[s] for s in used}, "host index disagrees"


# Longrope: a sequence's K/V rotated by the long factors never serves one rotated by the short ones (and back): the
# long ones cache under their own root, as if salted
LONGROPE_SALT = "\x1flongrope"


def cache_root(salt: str = "", adapter_uid: int = 0):
    """The parent key of a first cached block: requests of different salts (Request.cache_salt) or adapters share no
    entry."""
    base = -adapter_uid if adapter_uid else ROOT_PREFIX_ID
    return ("salt", salt, base) if salt else base


def prefix_root(request: Request):
    """The prefix-cache parent of a request's first block: ROOT_PREFIX_ID for the base model, for a LoRA adapter
    minus its load's uid (never a block's id, which count up from 1), under the request's cache salt if it has one:
    a page computed under one adapter or salt never serves another."""
    adapter = request.adapter
    salt = request.cache_salt + LONGROPE_SALT if request.rope_long else request.cache_salt
    return cache_root(salt, 0 if adapter is None else adapter.uid)


class BlockManager:
    # Whether pages can die before their request ends (a sliding window's: `HybridBlockManager`); the scheduler then
    # calls `slide` as requests advance.
    slides = False

    def __init__(self, num_pages: int, page_size: int, *, enable_prefix_caching: bool = True,
                 host_pages: int = 0):
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
        # The host tier under the prefix cache (None: off): an evicted cached block moves there instead of vanishing
        self.host = HostTier(host_pages) if host_pages and enable_prefix_caching else None
        # Device pages whose host -> device load is in flight: each holds one extra reference (the load's) until the
        # engine's copy lands (`loaded`), so it is never evicted, freed or reused under the copy; a holder of such a
        # page is loading (`is_loading`): the scheduler runs none of its steps yet
        self.loading: set[int] = set()
        # KV events (None: off): ("stored", hash, parent hash | None, tokens, medium, lora id | None, lora name |
        # None, extra keys | None), ("removed", hash, medium), ("cleared",); a block's hash is its prefix id unless
        # `use_block_hasher` set vLLM's
        self.events: list[tuple] | None = None
        self._hasher = None  # (parent digest | None, tokens, extra keys) -> digest; None: prefix ids name blocks
        self._digests: dict[int, bytes] = {}  # prefix id -> its digest while a tier holds the block
        # prefix id -> (adapter uid, 0 for none; its extra keys as vLLM hashes them) while a tier holds the block
        self._scopes: dict[int, tuple[int, tuple | None]] = {}
        self.adapter_names: dict[int, str] = {}  # adapter uid -> name, as requests cached blocks under it

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
                     root=ROOT_PREFIX_ID) -> tuple[list[int], list[int]]:
        """Longest run of cached full blocks at the start of `token_ids` (at most `max_blocks`) under `root`
        (`prefix_root`: the request's cache salt and adapter); no side effects.

        Returns (pages, prefix ids), one per matched block; a block in the host tier is `host_hit(slot)`.
        """
        pages: list[int] = []
        ids: list[int] = []
        if not self.enable_prefix_caching:
            return pages, ids
        parent, ps, host = root, self.page_size, self.host
        for i in range(min(max_blocks, len(token_ids) // ps)):
            key = (parent, tuple(token_ids[i * ps:(i + 1) * ps]))  # the whole token block is compared
            page = self.cache.get(key)
            if page is not None:
                parent = self.page_prefix_id[page]
            elif host is not None and (slot := host.cache.get(key)) is not None:
                parent, page = host.prefix_id[slot], host_hit(slot)
            else:
                break
            pages.append(page)
            ids.append(parent)
        return pages, ids

    def is_loading(self, holder) -> bool:
        """Whether `holder` holds a page whose load from the host tier has not landed (it must not step yet)."""
        loading = self.loading
        return bool(loading) and any(p in loading for p in holder.block_table)

    def num_idle_among(self, pages: Iterable[int]) -> int:
        """How many of `pages` are idle cached pages (taking them shrinks num_free_pages)."""
        refs = self.ref_counts
        return sum(1 for p in pages if p >= 0 and refs[p] == 0)

    def shortfall(self, hit: list[int], num_tokens: int) -> list[int]:
        """Per page pool, the pages missing for a new request that takes the prefix-cache `hit` (match_prefix's
        pages) and grows to `num_tokens` tokens (> 0: that many must be freed first)."""
        on_device = sum(1 for p in hit if p >= 0)  # a host hit needs a device page like a new block
        return [self.pages_for(num_tokens) - on_device - (self.num_free_pages - self.num_idle_among(hit))]

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
            if p < 0:
                continue
            if refs[p] == 0:
                del self.evictable[p]
            refs[p] += 1
        if any(p < 0 for p in pages):
            pages = self._load_host_hits(pages)
        request.block_table = list(pages)
        request.block_prefix_ids = list(prefix_ids)
        request.num_computed_tokens = len(pages) * self.page_size

    def _load_host_hits(self, pages: list[int]) -> list[int]:
        """Gives each host hit of `pages` a device page (queueing its load) and moves its block back to the device
        prefix cache; the device hits are already held. The caller checked that enough device pages are free."""
        host = self.host
        taken = {p: host.take(-1 - p) for p in pages if p < 0}  # out of the host LRU first: evictions spare them
        # Device pages for them first (evictions queue their offloads), then the loads: one batch of each
        targets = {p: self.free_pages.pop() if self.free_pages else self._evict_lru() for p in taken}
        out = []
        for p in pages:
            if p >= 0:
                out.append(p)
                continue
            key, prefix_id = taken[p]
            self._removed(prefix_id, HOST_MEDIUM, gone=False)
            page = targets[p]
            self.ref_counts[page] = 2  # the request's and the load's (until `loaded`)
            self.loading.add(page)
            self.cache[key], self.page_key[page], self.page_prefix_id[page] = page, key, prefix_id
            host.load(-1 - p, page, self._load_windows(len(out), len(pages), -1 - p, page))
            self._stored(key, prefix_id, DEVICE_MEDIUM)
            out.append(page)
        return out

    def _load_windows(self, index: int, num_blocks: int, slot: int, page: int) -> tuple:
        """The window pools' pages block `index` of a `num_blocks`-block hit loads into with device page `page`
        from host `slot` (a hybrid cache's; -1: none)."""
        return ()

    def _offload_windows(self, page: int) -> tuple:
        """The window pools' pages that leave the device with idle cached page `page` (a hybrid cache's)."""
        return ()

    def loaded(self, pages: Iterable[int]) -> None:
        """The engine's loads into `pages` landed (or were dropped with a lost cache): the loads' references go."""
        pages = list(pages)
        self.loading.difference_update(pages)
        self._release(pages)

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

    def pin_prefix(self, holder, token_ids: list[int], root) -> int:
        """Holds the device pages of the cached full blocks that start `token_ids` (under `root`) in `holder`'s
        block table (a transfer keeps them from eviction until `free(holder)`); returns how many. A block in the
        host tier ends the run."""
        pages, ids = self.match_prefix(token_ids, len(token_ids) // self.page_size, root)
        n = next((i for i, p in enumerate(pages) if p < 0), len(pages))
        self.acquire_cached(holder, pages[:n], ids[:n])
        return n

    def pin_more(self, holder, token_ids: list[int], root) -> int:
        """pin_prefix that goes on after the blocks `holder` holds already (a prefill's chunks as they end, each
        step): holds the next cached device blocks of `token_ids`; returns how many it added."""
        ps, refs = self.page_size, self.ref_counts
        held = len(holder.block_table)
        parent, added = (holder.block_prefix_ids[-1] if held else root), 0
        for i in range(held, len(token_ids) // ps):
            page = self.cache.get((parent, tuple(token_ids[i * ps:(i + 1) * ps])))
            if page is None:
                break
            if refs[page] == 0:
                del self.evictable[page]
            refs[page] += 1
            parent = self.page_prefix_id[page]
            holder.block_table.append(page)
            holder.block_prefix_ids.append(parent)
            added += 1
        return added

    def adopt_blocks(self, holder, token_ids: list[int], root, num_blocks: int) -> list[tuple[int, int]]:
        """Puts the first `num_blocks` full blocks of `token_ids` (under `root`) in the prefix cache, held by
        `holder` until `free(holder)`: blocks already cached are only held; the others get a device page (free,
        or an idle cached block's, evicted). Stops at a block in the host tier or when no page is left. Returns
        (block index, page) for each page whose K/V the caller must write. A holder that holds blocks already
        (an earlier call's, the same tokens) goes on after them."""
        ps, refs = self.page_size, self.ref_counts
        held = len(holder.block_table)
        parent, out = (holder.block_prefix_ids[-1] if held else root), []
        for i in range(held, min(num_blocks, len(token_ids) // ps)):
            key = (parent, tuple(token_ids[i * ps:(i + 1) * ps]))
            page = self.cache.get(key)
            if page is not None:
                if refs[page] == 0:
                    del self.evictable[page]
            elif self.host is not None and key in self.host.cache:
                break
            elif self.free_pages or self.evictable:
                page = self.free_pages.pop() if self.free_pages else self._evict_lru()
                prefix_id = next(self._next_prefix_id)
                self.cache[key], self.page_key[page], self.page_prefix_id[page] = page, key, prefix_id
                self._stored(key, prefix_id, DEVICE_MEDIUM)
                out.append((i, page))
            else:
                break
            refs[page] += 1
            holder.block_table.append(page)
            parent = self.page_prefix_id[page]
            holder.block_prefix_ids.append(parent)
        holder.num_computed_tokens = len(holder.block_table) * ps
        return out

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
        key = self.page_key[page]
        del self.cache[key]
        self.page_key[page] = None
        prefix_id = self.page_prefix_id[page]
        self._removed(prefix_id, DEVICE_MEDIUM, gone=self.host is None)
        if self.host is not None:
            dropped = self.host.store(key, prefix_id, page, self._offload_windows(page))
            if dropped is not None:
                self._removed(dropped, HOST_MEDIUM, gone=True)
            self._stored(key, prefix_id, HOST_MEDIUM)
        return page

    def use_block_hasher(self, hasher) -> None:
        """Names blocks in the events by `hasher`'s chain digests (serving.core.block_hash: vLLM's), computed once per
        block as it is first cached, as 64-bit integers."""
        self._hasher = hasher

    def _hash(self, prefix_id) -> int | None:
        """The events' name of block `prefix_id` (None: a root, not a block)."""
        if not isinstance(prefix_id, int) or prefix_id <= ROOT_PREFIX_ID:
            return None
        if self._hasher is None:
            return prefix_id
        from serving.core.block_hash import external_hash
        return external_hash(self._digest(prefix_id))

    def _digest(self, prefix_id: int) -> bytes:
        """Block `prefix_id`'s digest; for one that left both tiers while a request still chains through it (it
        computed the same block as a host one, which the host tier dropped since) a stand-in no stored event named,
        so a router leaves its children out rather than matching them."""
        digest = self._digests.get(prefix_id)
        if digest is None:
            digest = self._hasher(None, (), ("meshserve:dropped", prefix_id))
        return digest

    def note_adapter(self, adapter) -> None:
        """Remembers `adapter`'s name (None: the base model) for the events of the blocks cached under it."""
        if adapter is not None:
            self.adapter_names[adapter.uid] = adapter.name

    def _scope(self, key: tuple, prefix_id: int, adapter_uid: int | None) -> tuple[int, tuple | None]:
        """Block `prefix_id`'s (adapter uid, extra keys): vLLM's extra keys, the adapter's name on every block of an
        adapter's request and the cache salt on its first block, so its hashes tell salts and adapters apart."""
        scope = self._scopes.get(prefix_id)
        if scope is None:
            parent = key[0]
            salt = ""
            if not isinstance(parent, int) or parent <= ROOT_PREFIX_ID:  # a first block: its root says both
                salt, base = (parent[1], parent[2]) if isinstance(parent, tuple) else ("", parent)
                adapter_uid = -base
            elif adapter_uid is None:
                adapter_uid = self._scopes.get(parent, (0,))[0]
            name = self.adapter_names.get(adapter_uid) if adapter_uid else None
            extra = ((name,) if adapter_uid else ()) + ((salt,) if salt else ())
            scope = self._scopes[prefix_id] = (adapter_uid, extra or None)
        return scope

    def _stored(self, key: tuple, prefix_id: int, medium: str, adapter_uid: int | None = None) -> None:
        """A stored event (`adapter_uid`: the caching request's, where the parent key does not say it)."""
        if self.events is None:
            return
        parent = key[0]
        uid, extra = self._scope(key, prefix_id, adapter_uid)
        if self._hasher is not None and prefix_id not in self._digests:
            root = not isinstance(parent, int) or parent <= ROOT_PREFIX_ID
            self._digests[prefix_id] = self._hasher(None if root else self._digest(parent), key[1], extra)
        name = self.adapter_names.get(uid) if uid else None
        self.events.append(("stored", self._hash(prefix_id), self._hash(parent), key[1], medium,
                            uid or None, name, extra))

    def _removed(self, prefix_id: int, medium: str, gone: bool) -> None:
        """A removed event; `gone`: the block left both tiers (its digest goes)."""
        if self.events is not None:
            self.events.append(("removed", self._hash(prefix_id), medium))
            if gone:
                self._digests.pop(prefix_id, None)
                self._scopes.pop(prefix_id, None)

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Registers the request's full blocks whose K/V is computed (call after the step that wrote them)."""
        if not self.enable_prefix_caching:
            return
        ps, ids = self.page_size, request.block_prefix_ids
        full = num_computed_tokens // ps
        if full <= len(ids):
            return
        tokens, table = request.token_ids, request.block_table
        self.note_adapter(request.adapter)
        uid = 0 if request.adapter is None else request.adapter.uid
        for i in range(len(ids), full):
            key = (ids[-1] if ids else prefix_root(request), tuple(tokens[i * ps:(i + 1) * ps]))
            existing = self.cache.get(key)
            if existing is not None:  # the same prefix was computed elsewhere: chain through that entry
                ids.append(self.page_prefix_id[existing])
                continue
            if self.host is not None and (slot := self.host.cache.get(key)) is not None:
                ids.append(self.host.prefix_id[slot])  # likewise in the host tier (a block lives in one tier)
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
            self._stored(key, prefix_id, DEVICE_MEDIUM, uid)
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
        events, self.events = self.events, None if self.events is None else []
        n = len(self.evictable)
        for page in self.evictable:
            self._removed(self.page_prefix_id[page], DEVICE_MEDIUM, gone=True)
            del self.cache[self.page_key[page]]
            self.page_key[page] = None
            self.free_pages.append(page)
        self.evictable.clear()
        if self.host is not None:
            gone = self.host.reset()
            n += len(gone)
            for i in gone:
                self._removed(i, HOST_MEDIUM, gone=True)
        if events is not None:
            # Nothing left in either tier (no request holds a cached block): vLLM's AllBlocksCleared says it at once
            empty = not self.cache and (self.host is None or not self.host.cache)
            events += [("cleared",)] if empty else self.events
            self.events = events
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
        for p in self.loading:  # a load in flight holds its page
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
        if self.host is not None:
            self.host.check_invariants()
            assert not set(self.cache) & set(self.host.cache), "a block is in both tiers"

    def check_idle(self) -> None:
        """The idle invariant: with no live request, every page is free or held by the prefix cache."""
        self.check_invariants(())
        assert self.num_free_pages == self.num_pages, "pages leaked"
