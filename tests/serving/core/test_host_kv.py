"""The host KV tier end to end on a real (small) model: a prefix evicted to host memory and hit again gives the same
greedy tokens and counts a host hit; cycling more prefixes than the device pool holds gives the outputs of an
unbounded pool with no page leaked in either tier; an int8 cache moves values and scales as stored, a tp=2 cache
shard by shard; the host tier's metrics; the KV-event stream (pyzmq subscriber) matches both tiers."""
import time

import jax
import pytest
import transformers as tf
from prometheus_client import generate_latest

from serving.core.block_manager import DEVICE_MEDIUM, HOST_MEDIUM
from serving.core.host_kv import page_bytes
from serving.core.kv_events import REPLAY_END, check_endpoint
from serving.core.llm import LLM
from serving.core.request import FinishReason
from serving.core.sampling_params import SamplingParams
from serving.telemetry.metrics import ServerMetrics
from tests.support import hf_models

PS = 8
BASE = dict(page_size=PS, max_num_seqs=4, max_num_batched_tokens=64, min_token_bucket=32)  # 2 buckets to warm


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("hostkv") / "llama")
    hf_models.save_hf_model("llama", d)
    return d


def _prefixes(n: int, length: int = 5 * PS) -> list[list[int]]:
    return [hf_models.random_prompt(length, 160, seed=1000 + i) for i in range(n)]


def _gen(llm: LLM, prompts, max_tokens: int = 6) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, [params] * len(prompts))
    assert all(o.finish_reason is FinishReason.LENGTH for o in outs)
    return [o.token_ids for o in outs]


def _host_gb(pages: int, llm: LLM) -> float:
    return pages * page_bytes(llm.engine.runner.kv_caches) / (1 << 30)


@pytest.fixture(scope="module")
def reference(llama):
    """An unbounded device pool, no host tier: the tokens every run below must give."""
    return LLM(llama, warmup=False, num_pages=512, **BASE)


@pytest.mark.parametrize("kv_cache_dtype, tp", [("auto", 1), ("int8", 1), ("auto", 2)])
def test_evicted_prefix_hits_host_tier(llama, kv_cache_dtype, tp):
    """A's 5 full blocks are pushed out of a 16-page device pool by 3 other prompts, land in the host tier, and A's
    next request hits them there: the greedy tokens of a device-tier hit on an engine whose pool never evicts (and
    HF's for float32), a host hit of its 5 blocks counted, the pages moved both ways (an int8 cache's values and
    scales; a tp=2 cache's shards), no compile on the serving path after the warm-up, and the host tier's Prometheus
    series."""
    opts = dict(BASE, kv_cache_dtype=kv_cache_dtype, tp=tp)
    plain = LLM(llama, warmup=False, num_pages=512, **opts)
    warm = kv_cache_dtype == "auto" and tp == 1  # the warm-up's cost once
    llm = LLM(llama, warmup=warm, num_pages=16, host_kv_cache_gb=_host_gb(64, plain), **opts)
    engine, pool = llm.engine, llm.engine.host_kv
    assert pool.num_slots == 64
    assert pool.staging_memory == "pinned_host"  # XLA:CPU lists pinned host memory too (plain host memory there)
    compiled = (pool.compiled_programs, engine.runner._forward_fn._cache_size())
    assert compiled[0] == 2 * len(pool.buckets) * warm
    a, *others = _prefixes(4)
    a = a + [7, 8, 9]
    first = _gen(llm, [a])
    for p in others:
        _gen(llm, [p])
    host = engine.scheduler.block_manager.host
    assert host.offloaded_pages >= 5 and host.hit_blocks == 0
    again = _gen(llm, [a])
    assert first == _gen(plain, [a]) and again == _gen(plain, [a])  # plain's second: a device-tier hit
    if kv_cache_dtype == "auto" and tp == 1:
        hf = tf.AutoModelForCausalLM.from_pretrained(llama, attn_implementation="eager").eval()
        assert first[0] == hf_models.hf_greedy(hf, a, 6)
    assert host.hit_blocks == 5 and host.loaded_pages == 5
    for h, leaf in zip(pool.leaves, jax.tree.leaves(engine.runner.kv_caches)):  # a host array per distinct shard
        assert [a.shape[1:] for a in h.shards.values()] == [s.data.shape[1:] for s in leaf.addressable_shards[:tp]]
        assert len(h.shards) == tp and h.nbytes == pool.num_slots * h.page_bytes
    assert pool.bytes_to_device == 5 * pool.page_bytes and pool.bytes_to_host == host.offloaded_pages * pool.page_bytes
    if warm:  # no program compiled while serving
        assert (pool.compiled_programs, engine.runner._forward_fn._cache_size()) == compiled
    engine.scheduler.block_manager.check_idle()
    if tp == 1 and kv_cache_dtype == "auto":
        metrics = ServerMetrics("m", lambda: {**engine.scheduler.stats(), **engine.host_kv_stats()})
        metrics.refresh()
        text = generate_latest(metrics.registry).decode()
        assert 'meshserve:host_prefix_cache_hits_total{model_name="m"} 40.0' in text
        assert f'meshserve:kv_offload_bytes_to_device_total{{model_name="m"}} {5.0 * pool.page_bytes}' in text
        assert 'meshserve:host_kv_cache_pages{model_name="m"} 64.0' in text


def test_pressure_cycles_through_host_tier(llama, reference):
    """8 prefixes of 5 blocks cycled 3 times, 2 at a time, through a 16-page device pool over a 24-page host tier
    (so the host LRU drops blocks too): every output equals the unbounded pool's; no page leaks in either tier."""
    llm = LLM(llama, warmup=False, num_pages=16, host_kv_cache_gb=_host_gb(24, reference), **BASE)
    prefixes = _prefixes(8)
    rounds = [[p + [r, i] for i, p in enumerate(prefixes)] for r in range(3)]
    bm = llm.engine.scheduler.block_manager
    for prompts in rounds:
        for k in range(0, len(prompts), 2):
            batch = prompts[k:k + 2]
            assert _gen(llm, batch) == _gen(reference, batch)
            bm.check_idle()
    host = bm.host
    assert host.hit_blocks > 0 and host.dropped_blocks > 0
    assert len(host.free) + host.num_used == host.num_slots
    reference.engine.scheduler.block_manager.check_idle()


def _tiers(events_by_medium: dict, batch: list) -> None:
    """Applies one KVEventBatch [ts, events, rank] to {medium: {block hash: tokens}}."""
    _, events, rank = batch
    assert rank == 0
    for e in events:
        if e[0] == "BlockStored":
            (h,), parent, tokens, size, lora_id, medium, lora_name, extra_keys = e[1:]
            assert size == len(tokens) == PS and h not in events_by_medium.setdefault(medium, {})
            assert lora_id is None and lora_name is None and extra_keys is None  # the base model, unsalted
            events_by_medium[medium][h] = tuple(tokens)
        elif e[0] == "BlockRemoved":
            (h,), medium = e[1:]
            del events_by_medium[medium][h]
        else:
            events_by_medium.clear()


def test_kv_events_match_both_tiers(llama, reference):
    """A pyzmq subscriber of the KV-event stream rebuilds, per tier, exactly the blocks the block manager holds
    after prefixes cycle through the device pool and the host tier; the replay socket gives the same from 0."""
    import msgpack
    import zmq
    llm = LLM(llama, warmup=False, num_pages=16, host_kv_cache_gb=_host_gb(12, reference),
              kv_events_endpoint="tcp://127.0.0.1:*", kv_events_replay_endpoint="tcp://127.0.0.1:*", **BASE)
    pub = llm.engine.kv_events
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    time.sleep(0.5)  # PUB/SUB: a subscriber sees only messages sent after it joined
    prefixes = _prefixes(7)  # 5 of 5 blocks twice (host hits), then 2 more (the host LRU drops): 16 + 12 pages
    for group in (prefixes[:5], prefixes[:5], prefixes[5:]):
        for k in range(0, len(group), 2):
            _gen(llm, [p + [k] for p in group[k:k + 2]])
    bm = llm.engine.scheduler.block_manager
    expected = {
        DEVICE_MEDIUM: {bm.page_prefix_id[p]: k[1] for p, k in enumerate(bm.page_key) if k is not None},
        HOST_MEDIUM: {bm.host.prefix_id[s]: bm.host.key[s][1] for s in bm.host.lru}}
    assert bm.host.hit_blocks > 0 and bm.host.dropped_blocks > 0 and expected[HOST_MEDIUM]
    live, seqs = {}, []
    while sub.poll(1000):
        topic, seq, payload = sub.recv_multipart()
        seqs.append(int.from_bytes(seq, "big", signed=True))
        _tiers(live, msgpack.unpackb(payload))
    assert seqs == list(range(len(seqs))) and seqs
    assert live == expected
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    dealer.send_multipart((b"", (0).to_bytes(8, "big", signed=True)))
    replayed = {}
    while True:
        assert dealer.poll(5000)
        _, seq, payload = dealer.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == REPLAY_END:
            break
        _tiers(replayed, msgpack.unpackb(payload))
    assert replayed == expected
    sub.close(), dealer.close(), ctx.term(), pub.close()


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5557", "tcp://10.1.2.3:1", "udp://127.0.0.1:1", "tcp://x"])
def test_kv_events_endpoint_refused(endpoint):
    with pytest.raises(ValueError, match="KV-events endpoint"):
        check_endpoint(endpoint, allow_remote=False)


@pytest.mark.parametrize("name, options, params", [
    ("chunked prefill, n=3", dict(max_prefill_chunk=16),
     SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)),
    ("ngram speculation", dict(speculative_method="ngram", num_speculative_tokens=2),
     SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)),
])
def test_host_tier_under_scheduler_features(llama, reference, name, options, params):
    """Prefixes cycled through a 16-page device pool and the host tier with 16-token prefill chunks and n=3 seeded
    samples (forks of the prompt's pages), or n-gram speculation (rolled-back drafts): every sample equals the run
    with an unbounded pool and the same options; host hits happen; no page leaks."""
    opts = dict(BASE, **options)
    ref = LLM(llama, warmup=False, num_pages=512, **opts)
    llm = LLM(llama, warmup=False, num_pages=16, host_kv_cache_gb=_host_gb(32, reference), **opts)
    prefixes = _prefixes(5)
    for r in range(2):
        for k in range(0, len(prefixes), 2):
            batch = [p + [r, k] for p in prefixes[k:k + 2]]
            got = [[o.token_ids for o in c.outputs] for c in llm.generate(batch, params)]
            assert got == [[o.token_ids for o in c.outputs] for c in ref.generate(batch, params)], name
            llm.engine.scheduler.block_manager.check_idle()
    assert llm.engine.scheduler.block_manager.host.hit_blocks > 0


def test_host_tier_with_draft_model(llama, reference):
    """A draft model's cache shares the target's page ids: a host slot holds both pages, and a host hit brings both
    back. The model drafts for itself, so its proposals are the target's greedy tokens only where the draft K/V of
    the loaded pages is right: the host-hit request's drafts are accepted (a lost draft page would be rejected),
    its tokens equal the unbounded non-speculative pool's, a host hit of its 5 blocks is counted, no compile while
    serving, no page leaks in either tier."""
    opts = dict(BASE, speculative_method="draft", speculative_model=llama, num_speculative_tokens=2,
                speculative_min_acceptance=0.0)
    llm = LLM(llama, warmup=True, num_pages=16, host_kv_cache_gb=_host_gb(64, reference), **opts)
    engine, pool, spec = llm.engine, llm.engine.host_kv, llm.engine.spec
    assert pool.num_slots == 32 and pool.page_bytes == 2 * page_bytes(engine.runner.kv_caches)  # + the draft's
    compiled = (pool.compiled_programs, engine.runner._forward_fn._cache_size(), spec._step_fn._cache_size())
    a, *others = _prefixes(4)
    a = a + [7, 8, 9]
    first = _gen(llm, [a], 8)
    for p in others:
        _gen(llm, [p], 8)
    host = engine.scheduler.block_manager.host
    assert host.offloaded_pages >= 5 and host.hit_blocks == 0
    before = spec.stats()
    again = _gen(llm, [a], 8)
    after = spec.stats()
    assert first == again == _gen(reference, [a], 8)
    assert host.hit_blocks == 5 and host.loaded_pages == 5
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert drafted >= 4 and accepted >= 0.9 * drafted, (accepted, drafted)
    assert (pool.compiled_programs, engine.runner._forward_fn._cache_size(), spec._step_fn._cache_size()) == compiled
    engine.scheduler.block_manager.check_idle()


def test_host_load_in_flight_does_not_stall_others(llama, reference):
    """A request whose prefix hit is in the host tier waits in the loading state while its pages' copy is in flight
    (the pool holds the landed copy until released: a real copy, observable), and a running decode keeps stepping
    meanwhile; once the load lands both give the unbounded pool's tokens. A request aborted while its load is in
    flight leaks nothing in either tier. The samples of an n = 3 request that fork its loading prompt pages wait too,
    then give the unbounded pool's samples."""
    llm = LLM(llama, warmup=False, num_pages=16, host_kv_cache_gb=_host_gb(64, reference), **BASE)
    engine, pool = llm.engine, llm.engine.host_kv
    sched, bm = engine.scheduler, engine.scheduler.block_manager
    a, *others = _prefixes(4)
    a = a + [7, 8, 9]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    long_params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    b_prompt = hf_models.random_prompt(10, 160, seed=99)

    def evict_a():  # runs A, then pushes its blocks out of the device pool
        _gen(llm, [a])
        for p in others:
            _gen(llm, [p])
        hit = bm.match_prefix(a, 5)[0]
        assert len(hit) == 5 and any(p < 0 for p in hit), "some of A's blocks should be in the host tier"

    evict_a()
    b = engine.make_request("b", b_prompt, long_params)
    engine.add_request(b)
    while b.num_output_tokens < 2:
        engine.step()
    pool.hold_loads = True
    late = engine.make_request("a-late", a, params)
    engine.add_request(late)
    outputs = {"b": list(b.output_token_ids)}
    for _ in range(2):
        engine.step()  # admits the late request: its load starts, it is not scheduled
    before = b.num_output_tokens
    for _ in range(5):
        engine.step()
        sched.check_invariants()
        assert bm.is_loading(late) and late.num_output_tokens == 0 and pool.loads_in_flight == 1
    assert b.num_output_tokens == before + 5  # one token per step while the load is in flight
    pool.hold_loads = False
    engine.run_until_idle()
    assert late.output_token_ids == _gen(reference, [a])[0]
    assert b.output_token_ids == _gen(reference, [b_prompt], 24)[0] and outputs["b"] == b.output_token_ids[:2]
    assert bm.host.hit_blocks == 5 and pool.load_time_s > 0
    bm.check_idle()

    evict_a()
    pool.hold_loads = True
    gone = engine.make_request("a-aborted", a, params)
    engine.add_request(gone)
    for _ in range(2):
        engine.step()
    assert bm.is_loading(gone)
    engine.abort("a-aborted")
    assert bm.loading, "the load's own reference keeps its pages until the copy lands"
    pool.hold_loads = False
    engine.step()
    assert not bm.loading and pool.loads_in_flight == 0
    bm.check_idle()
    assert _gen(llm, [a]) == _gen(reference, [a])  # the aborted request's load landed in the device prefix cache

    evict_a()  # n = 3: samples 1 and 2 fork sample 0's prompt pages while they are still loading: all three wait
    pool.hold_loads = True
    forked = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=4, ignore_eos=True)
    group = engine.make_request("a-n3", a, forked)
    engine.add_request(group)
    for _ in range(4):
        engine.step()
        sched.check_invariants()
    assert [s.status.name for s in group.samples] == ["RUNNING"] * 3
    assert all(bm.is_loading(s) and s.num_output_tokens == 0 for s in group.samples)
    pool.hold_loads = False
    engine.run_until_idle()
    want = reference.generate([a], forked)[0].outputs
    assert [s.output_token_ids for s in group.samples] == [o.token_ids for o in want]
    bm.check_idle()


def test_hybrid_cache_moves_window_pages_with_their_blocks(tmp_path_factory):
    """Gemma 3's hybrid cache (window-12 layers in a pool of their own) over the host tier: prompts cycled through a
    24-page table pool and a 24-page window pool; a block leaves with the window pages it still has (the blocks
    its last query read), and a prompt whose hit reaches host blocks the next query reads through their window
    brings both back: the greedy tokens of an unbounded pool, host hits counted, no page leaked in any pool."""
    d = str(tmp_path_factory.mktemp("hostkv") / "gemma3")
    hf_models.save_hf_model("gemma3", d)
    opts = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=16, min_token_bucket=16)
    ref = LLM(d, warmup=False, num_pages=256, **opts)
    llm = LLM(d, warmup=False, num_pages=24, host_kv_cache_gb=_host_gb(48, ref), **opts)
    bm = llm.engine.scheduler.block_manager
    assert llm.engine.runner.window_pages == {12: 24} and bm.host.num_slots == 48
    prefixes = [hf_models.random_prompt(40, 160, seed=2000 + i) for i in range(4)]
    window_hits = 0
    for r in range(2):
        for k, p in enumerate(prefixes):
            prompt = p + [r, k, 3]
            hit = bm.match_prefix(prompt, (len(prompt) - 1) // 4)[0]
            window_hits += len(hit) == 10 and all(page < 0 for page in hit[7:])  # the window's blocks from the host
            before = bm.host.hit_blocks
            assert _gen(llm, [prompt], 4) == _gen(ref, [prompt], 4), (r, k)
            assert bm.host.hit_blocks - before == sum(1 for page in hit if page < 0)
            bm.check_idle()
            bm.host.check_invariants()
    assert window_hits > 0 and bm.host.hit_blocks > 0
