"""HybridBlockManager: a window pool beside the page table's pages. A sliding-window block's page goes as the window
slides past it (kept while the prefix cache holds the block), a prefix hit is only as long as every pool holds what
the next query reads, forks share the window pages, roll-backs release them. (Scheduling with it under random traffic:
test_scheduler_property; through the engine with Gemma 3: tests/models/test_gemma3.py.)"""
import pytest

from serving.core import Request, SamplingParams
from serving.core.hybrid_block_manager import HybridBlockManager

PS, WINDOW = 4, 6  # a query reads itself and the 5 tokens before: 2 or 3 blocks


@pytest.fixture
def bm():
    managers = []

    def make(num_pages=32, window_pages=12, **kw):
        m = HybridBlockManager(num_pages, PS, window_pages={WINDOW: window_pages}, **kw)
        managers.append(m)
        return m
    yield make
    for m in managers:
        m.check_idle()


def req(tokens, rid="r"):
    return Request(rid, tokens, SamplingParams(), arrival_time=0.0)


def window_blocks(m, r):
    """The blocks of r's table whose window page is held (not idle in the prefix cache)."""
    pool = m.pools[0]
    return [i for i, p in enumerate(r.block_table) if pool.page_of[p] >= 0 and pool.refs[pool.page_of[p]]]


def test_pages_go_as_the_window_slides(bm):
    m = bm()
    r = req(list(range(40)))
    assert m.allocate(r, 8) and m.pages_held() == [2, 2]
    for pos in range(8, 40):  # decode one token at a time, as the scheduler does
        m.slide(r, pos)
        assert m.allocate(r, pos + 1)
        first = max(0, pos - WINDOW + 1) // PS  # the first block the query at pos reads
        assert window_blocks(m, r) == list(range(first, pos // PS + 1))
        m.check_invariants([r])
    # 40 tokens: 10 primary pages, 2 window pages (the window of the query at 39 is 34..39)
    assert m.pages_held() == [10, 2] and m.pools[0].num_free == 10
    m.free(r)


def test_long_prefill_chunk_holds_every_block_it_writes_then_slides(bm):
    m = bm(window_pages=12)
    r = req(list(range(45)))
    assert m.allocate(r, 40) and m.pages_held() == [10, 10]  # the chunk writes all 10 blocks
    m.slide(r, 40)  # the next query at 40 reads 35..40
    assert window_blocks(m, r) == [8, 9] and m.pages_held() == [10, 2]
    assert not m.allocate(req(list(range(48)), "big"), 48)  # 12 new blocks: the window pool has 10 free
    assert m.num_growable_blocks == 10 and m.num_free_pages == 22
    m.free(r)


def test_window_pool_limits_allocation_all_or_nothing(bm):
    m = bm(num_pages=32, window_pages=3)
    a = req(list(range(12)), "a")
    assert m.allocate(a, 12) and m.pools[0].num_free == 0
    b = req(list(range(8)), "b")
    assert not m.allocate(b, 4) and b.block_table == [] and m.num_free_pages == 29
    m.slide(a, 12)  # a's next query reads 7..12: blocks 1, 2 (and 3, once allocated)
    assert m.allocate(b, 4) and m.pages_held() == [4, 3]
    m.free(a)
    m.free(b)


def prefill(m, r, chunk=None):
    """Admits r like the scheduler (prefix hit, then chunks of `chunk` tokens, sliding before each) and registers
    its full blocks; returns the tokens the hit covered."""
    n = len(r.token_ids)
    pages, ids = m.match_prefix(r.token_ids, (n - 1) // PS)
    m.acquire_cached(r, pages, ids)
    start = len(pages) * PS
    while start < n:
        end = min(n, start + (chunk or n))
        m.slide(r, start)
        assert m.allocate(r, end)
        start = end
        m.cache_full_blocks(r, start)
    r.num_computed_tokens = n
    return len(pages) * PS


def test_prefix_hit_needs_the_window_pages_of_its_last_blocks(bm):
    m = bm(num_pages=32, window_pages=6)
    prompt = list(range(100, 130))
    a = req(prompt + [1], "a")
    prefill(m, a, chunk=4)
    m.slide(a, 31)
    table = list(a.block_table)
    m.free(a)
    # a's 7 full blocks are cached; of their window pages the pool (6 pages) keeps the 5 released last, idle
    pool = m.pools[0]
    assert [i for i, p in enumerate(table) if pool.page_of[p] >= 0] == [2, 3, 4, 5, 6]
    assert len(pool.evictable) == 5 and len(m.evictable) == 7
    # the whole prompt: the next query (at 28) reads 23..28, blocks 5 and 6, which are there
    b = req(prompt + [2, 3], "b")
    assert prefill(m, b) == 28
    m.check_invariants([b])
    m.free(b)
    # its first 12 tokens: primary blocks 0-2 are cached, but the window of a query at 12 (blocks 1, 2) is not
    # whole, nor at 8 or 4: no hit
    c = req(prompt[:12] + [9, 9], "c")
    assert m.match_prefix(c.token_ids, 3)[0] == [] and prefill(m, c) == 0
    m.free(c)


def test_prefix_hit_is_exact_when_the_window_pages_are_gone(bm):
    m = bm(num_pages=64, window_pages=8)
    prompt = list(range(100, 132))
    a = req(prompt + [1], "a")
    prefill(m, a, chunk=4)
    m.free(a)
    # evict every idle window page (a request that fills the pool), the primary blocks stay cached
    c = req(list(range(300, 332)), "c")
    prefill(m, c)
    assert not m.pools[0].evictable and len(m.evictable) == 8
    m.free(c)
    b = req(prompt + [2], "b")
    assert len(m.match_prefix(b.token_ids, 8)[0]) == 0  # primary blocks cached, no window page for any query
    assert prefill(m, b, chunk=4) == 0
    m.free(b)


def test_fork_shares_the_window_pages_and_both_release(bm):
    m = bm()
    a = req(list(range(21)), "a")
    prefill(m, a)  # (the scheduler forks right after the chunk that completes the shared pages)
    group = req([], "group")
    assert m.can_fork(a, 5)
    m.fork(group, a, 5)  # the next query (at 20) reads 15..20: blocks 3, 4
    pool = m.pools[0]
    assert [pool.refs[pool.page_of[p]] for p in a.block_table[3:5]] == [2, 2]
    m.check_invariants([a, group])
    m.slide(a, 40)  # far ahead: a's window pages of blocks 3, 4 are released, the group keeps them
    assert not m.can_fork(a, 5) and m.can_fork(group, 5)
    m.check_invariants([a, group])
    m.free(a)
    m.free(group)


def test_rollback_releases_tail_window_pages_and_back_before_the_window_goes_to_zero(bm):
    m = bm()
    r = req(list(range(30)))
    prefill(m, r, chunk=8)
    m.slide(r, 30)
    assert m.allocate(r, 34)  # 4 drafts
    r.num_computed_tokens = 34
    assert m.truncate(r, 31) == 31 and len(r.block_table) == 8
    assert window_blocks(m, r) == [6, 7]
    m.check_invariants([r])
    assert m.truncate(r, 20) == 0 and r.block_table == []  # the window of position 20 (blocks 3, 4) is gone
    m.check_invariants([r])
    m.free(r)


def test_reset_prefix_cache_frees_idle_window_pages(bm):
    m = bm()
    a = req(list(range(17)), "a")
    prefill(m, a)
    m.free(a)
    assert m.pools[0].evictable and m.evictable
    assert m.reset_prefix_cache() == 4
    assert not m.pools[0].evictable and m.pools[0].num_free == 12
