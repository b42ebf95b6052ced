"""BlockManager: allocation, reference counts, forks, prefix cache (chain keys, exact hits, LRU eviction), roll-back.

Every test ends with the idle invariant: every page free or held by the prefix cache, none leaked.
"""
import pytest

from serving.core import BlockManager, Request, SamplingParams
from serving.core.block_manager import prefix_root
from serving.core.lora import Adapter

PS = 4


@pytest.fixture
def bm():
    managers = []

    def make(num_pages=16, **kw):
        m = BlockManager(num_pages, PS, **kw)
        managers.append(m)
        return m
    yield make
    for m in managers:
        m.check_idle()


def req(tokens, rid="r"):
    return Request(rid, tokens, SamplingParams(), arrival_time=0.0)


def run_prefill(m, r):
    """Admits `r` like the scheduler: prefix hits, then pages for the rest, then registers its full blocks."""
    n = len(r.token_ids)
    pages, ids = m.match_prefix(r.token_ids, (n - 1) // PS)
    m.acquire_cached(r, pages, ids)
    assert m.allocate(r, n)
    r.num_computed_tokens = n
    m.cache_full_blocks(r, n)
    return len(pages) * PS


def test_allocate_and_free(bm):
    m = bm(num_pages=4)
    r = req(list(range(10)))
    assert m.allocate(r, 10) and len(r.block_table) == 3 and m.num_free_pages == 1
    assert m.allocate(r, 12) and len(r.block_table) == 3  # still fits
    assert not m.allocate(r, 17) and len(r.block_table) == 3  # all or nothing
    m.check_invariants([r])
    m.free(r)
    assert r.block_table == [] and m.num_free_pages == 4


def test_free_keeps_old_table_list_intact(bm):
    m = bm()
    r = req(list(range(8)))
    m.allocate(r, 8)
    table = r.block_table
    m.free(r)
    assert len(table) == 2  # a batch built from the old list is not corrupted


def test_prefix_hit_shares_pages_and_counts_refs(bm):
    m = bm()
    a, b = req(list(range(13)), "a"), req(list(range(12)) + [99, 98], "b")
    assert run_prefill(m, a) == 0
    assert run_prefill(m, b) == 12  # three full blocks shared
    assert a.block_table[:3] == b.block_table[:3] and a.block_table[3] != b.block_table[3]
    assert [m.ref_counts[p] for p in a.block_table[:3]] == [2, 2, 2]
    m.check_invariants([a, b])
    m.free(a)
    m.free(b)
    assert len(m.evictable) == 3  # cached blocks stay, idle


def test_hit_needs_at_least_one_token_left(bm):
    m = bm()
    a, b = req(list(range(8)), "a"), req(list(range(8)), "b")
    run_prefill(m, a)
    assert run_prefill(m, b) == 4  # the last block is recomputed so the step has a token to sample from
    m.free(a)
    m.free(b)


def test_chain_key_distinguishes_same_block_after_different_prefix(bm):
    m = bm()
    a = req([1, 1, 1, 1, 5, 5, 5, 5, 0], "a")
    b = req([2, 2, 2, 2, 5, 5, 5, 5, 0], "b")  # second block equal, first differs
    run_prefill(m, a)
    assert run_prefill(m, b) == 0
    m.free(a)
    m.free(b)


def test_hit_compares_tokens_even_when_hash_collides(bm):
    m = bm()
    a = req([-1, -1, -1, -1, 0], "a")  # hash(-1) == hash(-2) in CPython: the two first blocks' keys collide
    b = req([-2, -2, -2, -2, 0], "b")
    run_prefill(m, a)
    assert hash((0, (-1,) * 4)) == hash((0, (-2,) * 4))
    assert run_prefill(m, b) == 0  # the token comparison rejects the colliding entry
    m.free(a)
    m.free(b)


def test_lru_eviction_of_unreferenced_cached_pages(bm):
    m = bm(num_pages=4)
    a = req(list(range(9)), "a")  # 2 full blocks cached + 1 partial
    run_prefill(m, a)
    m.free(a)
    assert len(m.evictable) == 2 and len(m.free_pages) == 2
    b = req([50 + i for i in range(13)], "b")  # needs 4 pages: takes 2 free, evicts 2 cached (tail first)
    run_prefill(m, b)
    assert len(m.evictable) == 0 and m.match_prefix(list(range(9)), 2) == ([], [])
    m.check_invariants([b])
    m.free(b)


def test_eviction_order_is_lru_and_tail_first(bm):
    m = bm(num_pages=6)
    a = req(list(range(9)), "a")
    run_prefill(m, a)
    first, second = a.block_table[:2]
    m.free(a)
    assert list(m.evictable) == [second, first]  # the tail block is evicted before the head block
    c = req([70 + i for i in range(17)], "c")  # 5 pages: 4 free + evicts `second` only
    run_prefill(m, c)
    assert m.match_prefix(list(range(9)), 2)[0] == [first]
    m.free(c)


def test_duplicate_block_chains_through_existing_entry(bm):
    m = bm()
    a, b = req(list(range(9)), "a"), req(list(range(9)), "b")
    # both computed without seeing each other's cache entries (same step)
    for r in (a, b):
        assert m.allocate(r, 9)
        r.num_computed_tokens = 9
    m.cache_full_blocks(a, 9)
    m.cache_full_blocks(b, 9)
    assert a.block_prefix_ids == b.block_prefix_ids and len(m.cache) == 2
    m.check_invariants([a, b])
    m.free(a)
    m.free(b)
    assert len(m.evictable) == 2 and len(m.free_pages) == 14


def test_truncate_frees_tail_and_spares_shared_blocks(bm):
    m = bm()
    a = req(list(range(16)), "a")
    run_prefill(m, a)  # 4 full blocks, all cached
    assert m.truncate(a, 9) == 8  # block 2 is cached (shared-able): roll back to its start
    assert len(a.block_table) == 2 and a.num_computed_tokens == 8 and len(a.block_prefix_ids) == 2
    m.check_invariants([a])
    b = req(list(range(100, 111)), "b")
    assert m.allocate(b, 11)
    b.num_computed_tokens = 11
    assert m.truncate(b, 6) == 6 and len(b.block_table) == 2  # private partial page kept
    m.check_invariants([a, b])
    m.free(a)
    m.free(b)


def test_reset_prefix_cache(bm):
    m = bm()
    a = req(list(range(9)))
    run_prefill(m, a)
    m.free(a)
    assert m.reset_prefix_cache() == 2 and not m.cache and m.num_free_pages == 16


def test_prefix_caching_disabled(bm):
    m = bm(enable_prefix_caching=False)
    a, b = req(list(range(9)), "a"), req(list(range(9)), "b")
    run_prefill(m, a)
    assert run_prefill(m, b) == 0 and not m.cache
    m.free(a)
    m.free(b)
    assert len(m.free_pages) == 16


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_fork_shares_pages_by_reference_count(bm, prefix_caching):
    m = bm(enable_prefix_caching=prefix_caching)
    a = req(list(range(10)), "a")
    run_prefill(m, a)
    b = req(list(range(10)), "b")
    m.fork(b, a, 2)  # the two full pages; b computes the last two tokens itself
    assert b.block_table == a.block_table[:2] and b.num_computed_tokens == 8
    assert b.block_prefix_ids == a.block_prefix_ids[:2]
    assert [m.ref_counts[p] for p in a.block_table] == [2, 2, 1]
    assert m.allocate(b, 10) and b.block_table[2] not in a.block_table
    b.num_computed_tokens = 10
    m.cache_full_blocks(b, 10)
    m.check_invariants([a, b])  # shared pages need not be cached when forked
    assert m.truncate(b, 6) == 4 and b.block_table == a.block_table[:1]  # a forked page is never written again
    m.free(a)
    assert m.ref_counts[b.block_table[0]] == 1
    m.check_invariants([b])
    m.free(b)
    assert not any(m.forked)


def test_check_invariants_catches_leak_and_bad_sharing():
    m = BlockManager(4, PS)
    a = req(list(range(4)))
    m.allocate(a, 4)
    with pytest.raises(AssertionError):
        m.check_invariants([])  # a's page is referenced by nobody we know of
    b = req(list(range(4)), "b")
    b.block_table = list(a.block_table)
    m.ref_counts[a.block_table[0]] += 1
    with pytest.raises(AssertionError, match="not cached"):
        m.check_invariants([a, b])


def test_a_salt_parts_the_prefix_cache(bm):
    """Requests share cached blocks only under the same cache_salt (a tenant's): another salt, or none, misses."""
    m = bm()
    prompt = list(range(9))

    def prefill(rid, salt):
        r = Request(rid, prompt, SamplingParams(), arrival_time=0.0, cache_salt=salt)
        n = len(prompt)
        pages, ids = m.match_prefix(r.token_ids, (n - 1) // PS, prefix_root(r))
        m.acquire_cached(r, pages, ids)
        assert m.allocate(r, n)
        r.num_computed_tokens = n
        m.cache_full_blocks(r, n)
        m.free(r)
        return len(pages) * PS
    assert [prefill("a1", "alpha"), prefill("b1", "beta"), prefill("n1", ""), prefill("a2", "alpha"),
            prefill("n2", "")] == [0, 0, 0, 8, 8]


def test_host_tier_books(bm):
    """The host tier under the prefix cache: the device's LRU block moves to a host slot (an offload queued), a hit
    reaching into it takes a device page back (a load queued), a block is in one tier at a time, the host tier's
    own LRU drops the oldest block when full, and reset empties both tiers."""
    m = bm(num_pages=4, host_pages=2)
    a, b = list(range(1, 9)), list(range(20, 28))  # two blocks each
    r = req(a + [99])
    run_prefill(m, r)
    m.free(r)
    assert m.host.ops == [] and len(m.evictable) == 2
    r = req(b + [98])
    run_prefill(m, r)  # needs 3 pages: 1 free, a's LRU block (its second: tail blocks go first) evicted to host
    assert [op[0] for op in m.host.ops] == ["offload"] and m.host.num_used == 1
    m.check_invariants([r])
    m.free(r)
    m.host.ops.clear()
    pages, _ = m.match_prefix(a + [99], 2)
    assert pages[0] >= 0 and pages[1] < 0  # block 0 on the device, block 1 in the host tier
    r = req(a + [99])
    assert run_prefill(m, r) == 2 * PS and m.host.hit_blocks == 1
    kinds = [op[0] for op in m.host.ops]
    assert "load" in kinds and kinds.index("load") == len(kinds) - 1 - kinds[::-1].index("load")
    assert m.match_prefix(a + [99], 2)[0] == r.block_table[:2]  # both back on the device
    m.check_invariants([r])
    assert m.is_loading(r) and m.loading == {r.block_table[1]}  # the load holds its page until it lands
    m.free(r)
    assert m.num_free_pages == 3  # the loading page stays held
    m.loaded(list(m.loading))
    m.check_invariants(())
    for i in range(3):  # three new prompts of 2 blocks through 4 device pages: the host tier (2 slots) overflows
        r = req([100 + 10 * i + j for j in range(8)] + [97], f"x{i}")
        run_prefill(m, r)
        m.free(r)
    assert m.host.dropped_blocks > 0 and m.host.num_used == 2
    m.check_invariants(())
    assert m.reset_prefix_cache() > 0 and m.host.num_used == 0 and not m.cache


def test_kv_transfer_pin_holds_cached_blocks_and_adopt_registers_received_ones(bm):
    from serving.core.kv_transfer import PageHolder
    src, dst = bm(num_pages=8), bm(num_pages=4)
    prompt = list(range(1, 12))  # 2 full blocks + 3 tokens
    r = req(prompt)
    run_prefill(src, r)
    src.free(r)
    held = PageHolder()
    assert src.pin_prefix(held, prompt, prefix_root(r)) == 2
    assert src.num_free_pages == 6  # held pages are not evictable while the transfer lasts
    src.check_invariants([held])
    src.free(held)
    assert src.num_free_pages == 8 and not held.block_table

    # the decode side: 2 received blocks become prefix-cache entries; a hit then covers them
    d = PageHolder()
    writes = dst.adopt_blocks(d, prompt + [99], prefix_root(r), 2)
    assert [i for i, _ in writes] == [0, 1] and d.block_table == [p for _, p in writes]
    dst.check_invariants([d])
    dst.free(d)
    pages, _ = dst.match_prefix(prompt + [99], 3)
    assert pages == [p for _, p in writes]
    again = PageHolder()
    assert dst.adopt_blocks(again, prompt + [99], prefix_root(r), 2) == []  # already cached: nothing to write
    assert again.block_table == pages
    dst.free(again)

    # short of pages: the run stops (the request recomputes the rest)
    busy = req(list(range(100, 112)), "busy")
    assert dst.allocate(busy, 12)  # 3 of the 4 pages held by a running request
    other = PageHolder()
    other_prompt = list(range(200, 212))
    writes = dst.adopt_blocks(other, other_prompt, prefix_root(r), 3)
    assert len(writes) == 1 and len(other.block_table) == 1  # one page left (an idle cached one, evicted)
    dst.free(other)
    dst.free(busy)


def _events_tiers(events):
    """{medium: {hash: tokens}} from a block manager's events."""
    tiers = {}
    for e in events:
        if e[0] == "stored":
            tiers.setdefault(e[4], {})[e[1]] = tuple(e[3])
        elif e[0] == "removed":
            del tiers[e[2]][e[1]]
        else:
            tiers.clear()
    return {k: v for k, v in tiers.items() if v}


def test_events_vllm_block_hash_and_all_cleared(bm):
    """With vLLM's block hash, each stored event names a block by sha256 over canonical CBOR of (parent digest or
    sha256_cbor(seed), token ids, extra keys: a LoRA adapter's name on each of its blocks, then the cache salt on a
    first block), as a 64-bit integer, the same in both tiers and in its removed events, and carries the adapter
    (lora id, lora name) and those extra keys; a reset that empties both tiers is one AllBlocksCleared, one that
    leaves a block in use is per-block removals."""
    import hashlib

    import cbor2

    from serving.core.block_hash import vllm_block_hasher

    def digest(value):
        return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()

    m = bm(num_pages=4, host_pages=4)
    m.events = []
    m.use_block_hasher(vllm_block_hasher("0"))
    a = list(range(1, 9))
    r = req(a + [99])
    run_prefill(m, r)
    d0 = digest((digest("0"), tuple(a[:4]), None))
    d1 = digest((d0, tuple(a[4:]), None))
    h0, h1 = (int.from_bytes(d, "big") & ((1 << 64) - 1) for d in (d0, d1))
    assert m.events == [("stored", h0, None, tuple(a[:4]), "GPU", None, None, None),
                        ("stored", h1, h0, tuple(a[4:]), "GPU", None, None, None)]
    m.free(r)
    salted = Request("s", a + [99], SamplingParams(), arrival_time=0.0, cache_salt="tenant-x")
    m.acquire_cached(salted, *m.match_prefix(salted.token_ids, 2, prefix_root(salted)))  # no hit: another root
    assert not salted.block_table and m.allocate(salted, 9)  # 3 pages: a's tail block moves to the host tier
    salted.num_computed_tokens = 9
    m.cache_full_blocks(salted, 9)
    s0 = digest((digest("0"), tuple(a[:4]), ("tenant-x",)))
    assert ("stored", int.from_bytes(s0, "big") & ((1 << 64) - 1), None, tuple(a[:4]), "GPU", None, None,
            ("tenant-x",)) in m.events
    assert ("removed", h1, "GPU") in m.events
    assert ("stored", h1, h0, tuple(a[4:]), "CPU", None, None, None) in m.events
    m.free(salted)
    m.events.clear()
    # an adapter's request under the same salt: its name leads every block's extra keys, then the first one's salt
    lora = Request("l", a + [99], SamplingParams(), arrival_time=0.0, cache_salt="tenant-x")
    lora.adapter = Adapter("sql", "/adapters/sql", 7, None)
    m.acquire_cached(lora, *m.match_prefix(lora.token_ids, 2, prefix_root(lora)))
    assert not lora.block_table and m.allocate(lora, 9)  # no hit: the salted blocks are another adapter's
    lora.num_computed_tokens = 9
    m.cache_full_blocks(lora, 9)
    l0 = digest((digest("0"), tuple(a[:4]), ("sql", "tenant-x")))
    l1 = digest((l0, tuple(a[4:]), ("sql",)))
    l0, l1 = (int.from_bytes(d, "big") & ((1 << 64) - 1) for d in (l0, l1))
    stored = [e for e in m.events if e[0] == "stored" and e[4] == "GPU"]
    assert stored == [("stored", l0, None, tuple(a[:4]), "GPU", 7, "sql", ("sql", "tenant-x")),
                      ("stored", l1, l0, tuple(a[4:]), "GPU", 7, "sql", ("sql",))]
    assert len({h0, h1, l0, l1, int.from_bytes(s0, "big") & ((1 << 64) - 1)}) == 5
    m.events.clear()
    m.reset_prefix_cache()  # `lora` still holds its blocks: per-block removals
    assert m.events and all(e[0] == "removed" for e in m.events)
    m.free(lora)
    m.events.clear()
    m.reset_prefix_cache()
    assert m.events == [("cleared",)] and not m._digests


def test_events_block_chained_through_a_dropped_host_block(bm):
    """A request that computed a block the host tier also held chains through the host block's id; once the host
    tier drops it, the request's next block is still published (vLLM hashes: under a parent no stored event named,
    so a router's index leaves it out) instead of failing the step."""
    from serving.core.block_hash import vllm_block_hasher
    m = bm(num_pages=3, host_pages=2)
    m.events = []
    m.use_block_hasher(vllm_block_hasher("0"))
    a = list(range(1, 5))
    first = req(a + [9], "first")
    run_prefill(m, first)
    m.free(first)
    m.allocate(other := req(list(range(20, 32)), "other"), 12)  # 3 pages: a's block goes to the host tier
    other.num_computed_tokens = 12
    m.cache_full_blocks(other, 12)
    m.free(other)
    r = req(list(a), "r")  # 4 tokens: no hit (one token is always computed); it computes block 0 itself
    run_prefill(m, r)  # block 0's key is in the host tier: r chains through the host block's id
    assert r.block_prefix_ids == [m.host.prefix_id[m.host.cache[(0, tuple(a))]]]
    assert m.allocate(r, 8)  # evicts one of other's blocks to the host tier, which drops a's
    assert (0, tuple(a)) not in m.host.cache
    r.token_ids.extend([5, 6, 7, 8])
    r.num_computed_tokens = 8
    m.events.clear()
    m.cache_full_blocks(r, 8)
    [stored] = [e for e in m.events if e[0] == "stored" and e[4] == "GPU"]
    assert stored[3] == (5, 6, 7, 8) and stored[2] is not None and stored[1] != stored[2]
    m.free(r)
