"""Scheduler policy with a fake model: budget, decodes first, chunked prefill, priority with ageing, queue bound,
deadlines, long lane, preemption order and recompute, caps, aborts, stop tokens, the engine seam.

Every test ends with the idle invariant (all requests ended, every page free or cached, none leaked).
"""
import zlib

import numpy as np
import pytest

from serving.core import (FinishReason, Priority, PromptTooLongError, QueueFullError, Request, RequestStatus,
                          SamplingParams, Scheduler, SchedulerConfig)
from serving.core.fake_model import FakeModel

EOS = 0


class Harness:
    """A scheduler, a fake model and a clock; `step()` runs one engine step and checks every invariant."""

    def __init__(self, **cfg):
        cfg.setdefault("max_model_len", 512)
        cfg.setdefault("num_pages", 256)
        cfg.setdefault("page_size", 4)
        cfg.setdefault("max_num_batched_tokens", 64)
        cfg.setdefault("max_num_seqs", 16)
        self.config = SchedulerConfig(**cfg)
        self.sched = Scheduler(self.config)
        self.model = FakeModel(self.config.num_pages, self.config.page_size, vocab_size=1000)
        self.now = 0.0
        self.added: dict[str, Request] = {}
        self.outputs: dict[str, list] = {}

    def add(self, rid, prompt, *, max_tokens=8, priority=Priority.INTERACTIVE, deadline=None, arrival=None,
            **sp):
        if isinstance(prompt, int):
            # zlib's CRC, not hash(): str hashes differ per process (PYTHONHASHSEED), and so would the prompts
            prompt = [(zlib.crc32(rid.encode()) + 7 * i) % 900 + 1 for i in range(prompt)]
        sp.setdefault("temperature", 0.0)
        r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **sp), priority=priority, deadline=deadline,
                    arrival_time=self.now if arrival is None else arrival, eos_token_ids=(EOS,))
        self.sched.add_request(r)
        self.added[rid] = r
        return r

    def step(self, tokens=None):
        self.now += 1.0
        out = self.sched.schedule(self.now)
        self.sched.check_invariants()
        assert out.num_scheduled_tokens == sum(len(s.token_ids) for s in out.scheduled)
        assert out.num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert len(out.scheduled) <= self.config.max_num_seqs
        sampled = self.model.step(out.scheduled) if tokens is None else tokens(out)
        results = self.sched.update(out, sampled, self.now)
        self.sched.check_invariants()
        for o in results + out.finished:
            self.outputs.setdefault(o.request_id, []).append(o)
        return out, results

    def run(self, max_steps=10_000):
        steps = 0
        while self.sched.has_unfinished_requests():
            self.step()
            steps += 1
            assert steps < max_steps, "no progress"
        return steps

    def run_look_ahead(self, max_steps=10_000):
        """The engine's look-ahead loop: step N is scheduled and run before step N-1's update(), its placeholder
        decodes fed with N-1's sampled tokens (as the device does). Returns the number of placeholder decodes."""
        import dataclasses
        from serving.core.scheduler import PLACEHOLDER_TOKEN
        prev, placeholders, steps = None, 0, 0
        while self.sched.has_unfinished_requests() or prev is not None:
            self.now += 1.0
            out = self.sched.schedule(self.now)
            self.sched.check_invariants()
            sampled = None
            if out.scheduled:
                feed = []
                for s in out.scheduled:
                    if s.token_ids[0] == PLACEHOLDER_TOKEN:
                        assert len(s.token_ids) == 1 and prev is not None
                        s = dataclasses.replace(s, token_ids=[prev[2][s.request_id]])
                        placeholders += 1
                    feed.append(s)
                sampled = self.model.step(feed)
            if prev is not None:
                for o in self.sched.update(prev[0], prev[1], self.now):
                    self.outputs.setdefault(o.request_id, []).append(o)
                self.sched.check_invariants()
            for o in out.finished:
                self.outputs.setdefault(o.request_id, []).append(o)
            prev = None if sampled is None else (
                out, sampled, {s.request_id: t for s, t in zip(out.scheduled, sampled)})
            steps += 1
            assert steps < max_steps, "no progress"
        return placeholders

    def check_greedy(self, r):
        assert r.output_token_ids == self.model.greedy_continuation(r.prompt_token_ids, r.num_output_tokens)
        streamed = [t for o in self.outputs.get(r.request_id, []) for t in o.new_token_ids]
        assert streamed == r.output_token_ids


@pytest.fixture
def harness():
    made = []

    def make(**cfg):
        h = Harness(**cfg)
        made.append(h)
        return h
    yield make
    for h in made:  # the idle invariant, after every test
        for rid in list(h.sched.requests):
            h.sched.abort(rid)
        h.sched.check_invariants()
        h.sched.block_manager.check_idle()


# ---- budget and chunked prefill ----------------------------------------------------------------------------
def test_budget_respected_and_outputs_exact(harness):
    h = harness(max_num_batched_tokens=32, max_num_seqs=8)
    rng = np.random.default_rng(0)
    for i in range(30):
        h.add(f"r{i}", int(rng.integers(1, 100)), max_tokens=int(rng.integers(1, 20)))
    h.run()
    for r in h.added.values():
        assert r.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        h.check_greedy(r)


def test_decodes_never_stalled_by_30k_prompt(harness):
    h = harness(max_model_len=32768, num_pages=2200, page_size=16, max_num_batched_tokens=512, max_num_seqs=16,
                long_prompt_threshold=8192)
    decoders = [h.add(f"d{i}", 20, max_tokens=200, ignore_eos=True) for i in range(8)]
    while any(r.num_output_tokens == 0 for r in decoders):
        h.step()
    long = h.add("long", 30_000, max_tokens=2)
    chunks = 0
    while long.num_output_tokens == 0:
        out, _ = h.step()
        scheduled = {s.request_id: s for s in out.scheduled}
        assert all(scheduled[d.request_id].token_ids == [d.token_ids[-2]] for d in decoders)  # one decode each
        assert len(scheduled["long"].token_ids) <= 512 - 8
        chunks += 1
    assert chunks == -(-30_000 // 504)
    h.run()
    h.check_greedy(long)
    for d in decoders:
        h.check_greedy(d)


def test_max_prefill_chunk(harness):
    h = harness(max_prefill_chunk=10)
    r = h.add("a", 35, max_tokens=1)
    sizes = [len(h.step()[0].scheduled[0].token_ids) for _ in range(4)]
    assert sizes == [10, 10, 10, 5] and r.is_finished


def test_running_decodes_scheduled_before_admissions(harness):
    h = harness(max_num_batched_tokens=16, max_num_seqs=16)
    for i in range(4):
        h.add(f"d{i}", 4, max_tokens=50, ignore_eos=True)
    h.step()  # all four prefills (16 tokens)
    h.add("big", 100, max_tokens=1)
    out, _ = h.step()
    kinds = [(s.request_id, len(s.token_ids)) for s in out.scheduled]
    assert kinds[:4] == [(f"d{i}", 1) for i in range(4)] and kinds[4] == ("big", 12)


# ---- priority, ageing, queue bound -------------------------------------------------------------------------
def admission_order(h):
    order = []
    while h.sched.has_unfinished_requests():
        out, _ = h.step()
        order += [s.request_id for s in out.scheduled if s.start == 0]
    return order


def test_priority_with_ageing(harness):
    h = harness(max_num_seqs=1, max_num_batched_tokens=8, priority_ageing_s=10.0)
    h.add("busy", 4, max_tokens=1)
    h.add("batch", 4, max_tokens=1, priority=Priority.BATCH, arrival=0.0)  # queues as if it arrived at 10
    h.add("i5", 4, max_tokens=1, arrival=5.0)
    h.add("i12", 4, max_tokens=1, arrival=12.0)
    assert admission_order(h) == ["busy", "i5", "batch", "i12"]


def test_batch_never_starved_by_interactive_stream(harness):
    h = harness(max_num_seqs=1, max_num_batched_tokens=8, priority_ageing_s=5.0)
    b = h.add("batch", 4, max_tokens=1, priority=Priority.BATCH)
    served_before = []
    for i in range(40):  # a new interactive request every step, twice what the instance can serve
        h.add(f"i{i}", 4, max_tokens=2)
        out, _ = h.step()
        if b.is_finished:
            break
        served_before += [h.added[s.request_id] for s in out.scheduled if s.start == 0]
    # the batch request waited only behind interactive work that arrived less than ageing_s after it
    assert b.is_finished and all(r.arrival_time < b.arrival_time + 5.0 for r in served_before)
    assert len(served_before) == 5
    h.run()


def test_without_ageing_interactive_always_first(harness):
    h = harness(max_num_seqs=1, max_num_batched_tokens=8, priority_ageing_s=1e9)
    h.add("busy", 4, max_tokens=1)
    h.add("batch", 4, max_tokens=1, priority=Priority.BATCH)
    h.add("i1", 4, max_tokens=1, arrival=100.0)
    assert admission_order(h) == ["busy", "i1", "batch"]


def test_queue_bound_rejects_busy(harness):
    h = harness(max_waiting_requests=2, max_waiting_tokens=100)
    h.add("a", 10)
    h.add("b", 10)
    with pytest.raises(QueueFullError, match="busy"):
        h.add("c", 10)
    assert "c" not in h.sched.requests
    h.step()  # both admitted: the queue has room again
    h.add("c", 80)
    with pytest.raises(QueueFullError, match="max_waiting_tokens"):
        h.add("d", 30)
    h.run()


def test_invalid_requests_rejected_before_queueing(harness):
    h = harness(max_model_len=64)
    with pytest.raises(PromptTooLongError, match="context is 64"):
        h.add("long", 64)
    with pytest.raises(ValueError, match="empty"):
        h.add("empty", [])
    h.add("dup", 3)
    with pytest.raises(ValueError, match="already"):
        h.add("dup", 3)
    assert list(h.sched.requests) == ["dup"]
    h.run()


# ---- deadlines, aborts -------------------------------------------------------------------------------------
def test_deadline_aborts_and_frees(harness):
    h = harness()
    running = h.add("run", 10, max_tokens=100, ignore_eos=True, deadline=4.5)
    h.add("wait", 10, max_tokens=5, deadline=2.5, priority=Priority.BATCH, arrival=-1.0)
    h.sched.config.max_num_seqs = 1  # only "run" is admitted; "wait" waits
    h.step()
    h.step()
    out, _ = h.step()  # now = 3: the waiting request has expired
    assert [(o.request_id, o.finish_reason) for o in out.finished] == [("wait", FinishReason.TIMEOUT)]
    h.step()
    out, _ = h.step()  # now = 5
    assert [(o.request_id, o.finish_reason) for o in out.finished] == [("run", FinishReason.TIMEOUT)]
    assert running.block_table == [] and running.num_output_tokens == 4 and not h.sched.requests
    assert running.metrics.finished_time == 5.0


def test_abort_at_any_moment(harness):
    h = harness(max_num_batched_tokens=8, max_num_seqs=4)
    w = h.add("waiting", 5)
    p = h.add("prefill", 30)
    d = h.add("decode", 3, max_tokens=50)
    assert h.sched.abort("waiting").finish_reason is FinishReason.ABORT and w.is_finished
    h.step()
    h.step()
    assert 0 < p.num_computed_tokens < 30
    h.sched.abort("prefill")
    out = h.sched.schedule(h.now + 1)  # abort between schedule and update: the in-flight tokens are dropped
    assert any(s.request_id == "decode" for s in out.scheduled)
    assert h.sched.abort("decode").finished
    assert h.sched.update(out, h.model.step(out.scheduled), h.now + 1) == []
    assert h.sched.abort("decode") is None  # already gone
    assert all(r.block_table == [] for r in (w, p, d))


def test_finish_request_for_stop_string(harness):
    h = harness()
    r = h.add("a", 5, max_tokens=50)
    h.step()
    out = h.sched.finish_request("a", FinishReason.STOP, stop_reason="###")
    assert out.finished and out.finish_reason is FinishReason.STOP and r.stop_reason == "###"
    assert r.status is RequestStatus.FINISHED and r.block_table == []


# ---- long lane ---------------------------------------------------------------------------------------------
def test_long_lane_caps_concurrent_long_prefills(harness):
    h = harness(max_model_len=2048, num_pages=1024, max_num_batched_tokens=256, long_prompt_threshold=100,
                max_long_prefills=1, max_prefill_chunk=200)
    for i in range(3):
        h.add(f"long{i}", 500, max_tokens=2)
    h.add("short", 20, max_tokens=2)
    first, _ = h.step()
    assert sorted(s.request_id for s in first.scheduled) == ["long0", "short"]
    while h.sched.has_unfinished_requests():
        h.step()
        in_prefill = [r for r in h.sched.running if r.num_computed_tokens < r.num_tokens - 1
                      and r.num_tokens > 100]
        assert len(in_prefill) <= 1


# ---- preemption --------------------------------------------------------------------------------------------
def test_preemption_victim_lowest_priority_then_newest(harness):
    h = harness(num_pages=16, max_model_len=64, page_size=4, preempt_for_priority=False)
    a = h.add("old_interactive", 8, max_tokens=40, ignore_eos=True)
    b = h.add("old_batch", 8, max_tokens=40, ignore_eos=True, priority=Priority.BATCH)
    h.now += 1
    c = h.add("new_batch", 8, max_tokens=40, ignore_eos=True, priority=Priority.BATCH)
    h.now += 1
    d = h.add("new_interactive", 8, max_tokens=40, ignore_eos=True)
    preempted = []
    while h.sched.has_unfinished_requests():
        out, _ = h.step()
        preempted += out.preempted
    assert preempted[:3] == ["new_batch", "old_batch", "new_interactive"]
    for r in (a, b, c, d):
        h.check_greedy(r)  # a preempted request resumes and finishes with the same greedy output
        assert r.finish_reason is FinishReason.LENGTH
    assert c.metrics.num_preemptions >= 1 and h.sched.num_preemptions == sum(
        r.metrics.num_preemptions for r in (a, b, c, d))


def test_preempted_request_resumes_through_prefix_cache(harness):
    h = harness(num_pages=20, max_model_len=48, page_size=4)
    a = h.add("a", 16, max_tokens=30, ignore_eos=True)
    b = h.add("b", 16, max_tokens=30, ignore_eos=True)
    h.run()
    preempted = [r for r in (a, b) if r.metrics.num_preemptions]
    assert preempted and h.sched.prefix_cache_hits > 0
    h.check_greedy(a)
    h.check_greedy(b)


def test_interactive_admission_preempts_batch(harness):
    h = harness(num_pages=16, max_model_len=64, page_size=4)
    b = h.add("batch", 40, max_tokens=20, ignore_eos=True, priority=Priority.BATCH)
    h.step()
    h.step()
    i = h.add("interactive", 30, max_tokens=4)
    out, _ = h.step()
    assert out.preempted == ["batch"] and [s.request_id for s in out.scheduled] == ["interactive"]
    h.run()
    h.check_greedy(b)
    h.check_greedy(i)
    assert i.metrics.finished_time < b.metrics.finished_time


# ---- caps and stops ----------------------------------------------------------------------------------------
def test_max_tokens_and_context_are_hard_caps(harness):
    h = harness(max_model_len=32)
    a = h.add("a", 10, max_tokens=5, ignore_eos=True)
    b = h.add("b", 10, max_tokens=None, ignore_eos=True)
    c = h.add("c", 31, max_tokens=100, ignore_eos=True)
    h.run()
    assert (a.num_output_tokens, a.finish_reason) == (5, FinishReason.LENGTH)
    assert (b.num_tokens, b.finish_reason) == (32, FinishReason.LENGTH)
    assert (c.num_output_tokens, c.finish_reason) == (1, FinishReason.LENGTH)


def scripted(tokens_by_id):
    """A fake step that samples the scripted tokens (in order) for each request."""
    def step(out):
        return [tokens_by_id[s.request_id].pop(0) if s.sample else -1 for s in out.scheduled]
    return step


def test_stop_tokens_eos_ignore_eos_min_tokens(harness):
    h = harness()
    eos = h.add("eos", 3, max_tokens=10)
    stop = h.add("stop", 3, max_tokens=10, stop_token_ids=[42])
    ign = h.add("ignore", 3, max_tokens=4, ignore_eos=True)
    mn = h.add("min", 3, max_tokens=10, min_tokens=2)
    script = scripted({"eos": [5, EOS], "stop": [42], "ignore": [EOS, EOS, EOS, EOS], "min": [EOS, EOS, 9]})
    h.step(script)
    h.step(script)
    assert (eos.output_token_ids, eos.finish_reason, eos.stop_reason) == ([5, EOS], FinishReason.STOP, EOS)
    assert (stop.output_token_ids, stop.finish_reason, stop.stop_reason) == ([42], FinishReason.STOP, 42)
    assert (mn.output_token_ids, mn.finish_reason) == ([EOS, EOS], FinishReason.STOP)  # 2nd EOS counts
    h.step(script)
    h.step(script)
    assert (ign.num_output_tokens, ign.finish_reason) == (4, FinishReason.LENGTH)


def test_several_tokens_per_step_and_rollback(harness):
    """The speculative-decoding seam: update() takes a list per sequence; truncate_computed() rolls K/V back."""
    h = harness()
    r = h.add("a", 8, max_tokens=20, stop_token_ids=[77])
    h.step()
    out = h.sched.schedule(h.now + 1)
    (res,) = h.sched.update(out, [[11, 12, 13]], h.now + 1)
    assert res.new_token_ids == [11, 12, 13] and r.output_token_ids[-3:] == [11, 12, 13]
    # roll back into block [4, 8): it is cached (shared-able), so the roll-back goes to its start
    assert h.sched.truncate_computed("a", 7) == 4 and len(r.block_table) == 1
    h.sched.check_invariants()
    out = h.sched.schedule(h.now + 2)
    assert out.scheduled[0].start == 4 and out.scheduled[0].token_ids == r.token_ids[4:]
    (res,) = h.sched.update(out, [[1, 77, 3]], h.now + 2)  # stops at 77; the token after it is dropped
    assert res.new_token_ids == [1, 77] and res.finish_reason is FinishReason.STOP
    with pytest.raises(ValueError, match="sampled entries"):
        h.sched.update(out, [], h.now + 3)


# ---- metrics and the engine seam ---------------------------------------------------------------------------
def test_metrics_and_prefix_cache_counters(harness):
    h = harness()
    shared = list(range(1, 33))
    a = h.add("a", shared + [5], max_tokens=3)
    h.run()
    b = h.add("b", shared + [6, 7], max_tokens=3)
    h.run()
    assert a.metrics.num_cached_prompt_tokens == 0 and b.metrics.num_cached_prompt_tokens == 32
    assert h.sched.prefix_cache_hits == 32 and h.sched.prefix_cache_queries == 33 + 34
    m = b.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert len(m.token_times) == b.num_output_tokens == 3
    h.check_greedy(b)
    stats = h.sched.stats()
    assert stats["num_running"] == stats["num_waiting"] == stats["kv_cache_usage"] == 0  # cached pages are free
    assert len(h.sched.block_manager.evictable) == 9  # 8 shared blocks + b's ninth


def test_numpy_sampled_tokens_and_scheduled_sequence_fields(harness):
    h = harness()
    h.add("a", 9, max_tokens=3)
    h.add("b", 2, max_tokens=3)
    out = h.sched.schedule(1.0)
    s = out.scheduled[0]
    assert (s.start, len(s.token_ids), s.sample, s.request_id) == (0, 9, True, "a")
    assert len(s.block_table) * 4 >= 9
    res = h.sched.update(out, np.array([3, 4], np.int32), 1.0)
    assert [(o.request_id, o.new_token_ids) for o in res] == [("a", [3]), ("b", [4])]
    assert all(type(t) is int for o in res for t in o.new_token_ids)
    h.run()


# ---- n > 1: samples sharing their prompt's pages -----------------------------------------------------------
def _prompt_tokens(out, group=None) -> int:
    """Prompt tokens a step computes (its prefill), of one n > 1 request's samples if `group` is given."""
    return sum(max(0, min(s.start + len(s.token_ids), s.request.num_prompt_tokens) - s.start) for s in out.scheduled
               if group is None or s.request.group is group)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_samples_compute_the_prompt_once_sharing_its_pages(harness, prefix_caching):
    h = harness(enable_prefix_caching=prefix_caching)  # page_size 4
    r = h.add("g", 30, max_tokens=6, n=3, ignore_eos=True)
    assert [(s.request_id, s.sample_index, s.parent_id) for s in r.samples] == [
        ("g", 0, "g"), ("g#1", 1, "g"), ("g#2", 2, "g")]
    assert len({s.sampling_params.seed for s in r.samples}) == 1  # no seed given (the engine draws one)
    bm, full = h.sched.block_manager, (30 - 1) // 4  # 7 full pages are shared, the last (2 tokens) is not
    out, _ = h.step()
    assert [s.request_id for s in out.scheduled] == ["g"]  # the others wait for sample 0's pages
    assert r.group.block_table == r.block_table[:full]  # held (a fork) until both have taken them
    prompt_tokens, peak = _prompt_tokens(out), 0
    out, _ = h.step()
    assert sorted((s.request_id, s.start, len(s.token_ids)) for s in out.scheduled) == [
        ("g", 30, 1), ("g#1", 28, 2), ("g#2", 28, 2)]  # each recomputes the prompt's last partial page only
    assert r.group.block_table == [] and all(s.block_table[:full] == r.block_table[:full] for s in r.samples)
    assert all(bm.ref_counts[p] == 3 for p in r.block_table[:full])
    prompt_tokens += _prompt_tokens(out)
    while h.sched.has_unfinished_requests():
        peak = max(peak, bm.num_pages - bm.num_free_pages)
        prompt_tokens += _prompt_tokens(h.step()[0])
    assert prompt_tokens == 30 + 2 * 2
    assert peak == bm.pages_for(36) + 2 * (bm.pages_for(36) - full) < 3 * bm.pages_for(36)
    for s in r.samples:  # the fake model's greedy continuation: any wrong or unwritten page would change it
        h.check_greedy(s)
        assert s.finish_reason is FinishReason.LENGTH and s.num_output_tokens == 6
    assert [s.metrics.num_cached_prompt_tokens for s in r.samples] == [0, 28, 28]
    assert h.sched.prefix_cache_queries == 30  # forks are not prefix-cache lookups


def test_samples_fork_from_the_hold_after_sample_0_has_finished(harness):
    """Sample 0 ends at its first token, before the others are admitted: the group's fork kept the prompt's pages
    (no prefix cache here), so they still compute only the last partial page."""
    h = harness(enable_prefix_caching=False, max_num_seqs=2)
    r = h.add("g", 21, max_tokens=1, n=3)
    h.add("other", 3, max_tokens=3)  # takes the second slot, so sample 2 waits longer
    prompt_tokens = 0
    while h.sched.has_unfinished_requests():
        out, _ = h.step()
        prompt_tokens += _prompt_tokens(out, r.group)
    assert r.samples[2].metrics.first_scheduled_time > r.metrics.finished_time
    assert prompt_tokens == 21 + 2 * 1
    for s in r.samples:
        h.check_greedy(s)


@pytest.mark.parametrize("when", [0, 1, 3])
def test_abort_of_an_n_request_ends_every_sample(harness, when):
    h = harness()
    r = h.add("g", 14, max_tokens=20, n=3)
    for _ in range(when):
        h.step()
    if when == 1:
        assert r.group.block_table  # the fork is held: the abort must release it too
    out = h.sched.abort("g")
    assert out is not None and out.finish_reason is FinishReason.ABORT
    assert all(s.finish_reason is FinishReason.ABORT and s.block_table == [] for s in r.samples)
    assert not h.sched.requests and not h.sched.groups and r.group.block_table == []
    h.sched.block_manager.check_idle()


def test_deadline_and_queue_bound_count_every_sample(harness):
    h = harness(max_waiting_requests=4)
    r = h.add("g", 10, max_tokens=50, n=3, deadline=3.5)
    with pytest.raises(QueueFullError, match="adds 2 samples"):
        h.add("h", 10, n=2)
    with pytest.raises(ValueError, match="'g#1' is already in flight"):
        h.add("g#1", 5)
    for _ in range(4):
        h.step()
    assert all(s.finish_reason is FinishReason.TIMEOUT for s in r.samples) and not h.sched.groups


@pytest.mark.parametrize("look_ahead", [False, True])
def test_samples_under_preemption_pressure_all_complete(harness, look_ahead):
    """Few pages: samples are preempted and recomputed (forking the prompt from a running sample where one has it),
    every one of them still gives the exact continuation, and no page leaks."""
    h = harness(max_model_len=64, num_pages=20, max_num_batched_tokens=16, max_num_seqs=6)
    groups = [h.add(f"g{i}", 18 + 3 * i, max_tokens=30, n=3, ignore_eos=True) for i in range(2)]
    solo = h.add("solo", 9, max_tokens=25, ignore_eos=True)
    h.run_look_ahead() if look_ahead else h.run()
    assert h.sched.num_preemptions > 0
    for r in [s for g in groups for s in g.samples] + [solo]:
        assert r.finish_reason is FinishReason.LENGTH and r.num_tokens == r.max_num_tokens
        h.check_greedy(r)


# ---- look-ahead (the engine schedules step N before step N-1's tokens are applied) ---------------------------
def _mixed_requests(h, n=24, seed=0, **extra):
    rng = np.random.default_rng(seed)
    for i in range(n):
        h.add(f"r{i}", int(rng.integers(1, 60)), max_tokens=int(rng.integers(1, 30)), **extra)


@pytest.mark.parametrize("cfg", [dict(), dict(max_num_batched_tokens=16, max_num_seqs=8),
                                 dict(num_pages=40, max_model_len=160, max_num_batched_tokens=32)])
def test_look_ahead_gives_the_synchronous_outputs(harness, cfg):
    ref = harness(**cfg)
    _mixed_requests(ref)
    ref.run()
    h = harness(**cfg)
    _mixed_requests(h)
    assert h.run_look_ahead() > 0
    for rid, r in h.added.items():
        assert r.finish_reason is ref.added[rid].finish_reason
        assert r.output_token_ids == ref.added[rid].output_token_ids
        h.check_greedy(r)
    if cfg.get("num_pages") == 40:
        assert h.sched.num_preemptions > 0  # a request preempted with a token in flight recomputes it


def test_look_ahead_drops_the_token_after_a_stop_and_skips_a_surely_last_token(harness):
    h = harness()
    r = h.add("a", 5, max_tokens=3)
    prompt = [11, 12, 13, 14, 15]
    expected = h.model.greedy_continuation(prompt, 2)
    assert expected[0] != expected[1]
    stopper = h.add("b", prompt, max_tokens=10, stop_token_ids=[expected[1]])
    h.run_look_ahead()
    assert r.output_token_ids == h.model.greedy_continuation(r.prompt_token_ids, 3)
    assert r.finish_reason is FinishReason.LENGTH
    # its 2nd token stops it; the decode already scheduled on that token is dropped
    assert stopper.output_token_ids == expected
    assert stopper.finish_reason is FinishReason.STOP
    assert [t for o in h.outputs["b"] for t in o.new_token_ids] == stopper.output_token_ids


def test_look_ahead_schedules_placeholders_only_for_pending_tokens(harness):
    from serving.core.scheduler import PLACEHOLDER_TOKEN
    h = harness()
    a = h.add("a", 6, max_tokens=4)
    first = h.sched.schedule(1.0)  # a's prefill: samples its first token
    assert first.scheduled[0].token_ids == a.prompt_token_ids and a.num_pending == 1
    second = h.sched.schedule(2.0)  # before update(first): a decodes on the token still in flight
    assert [s.token_ids for s in second.scheduled] == [[PLACEHOLDER_TOKEN]] and a.num_pending == 2
    assert h.sched.schedule(3.0).scheduled == []  # never two steps ahead
    h.sched.update(first, [7])
    assert a.token_ids[-1] == 7 and a.num_pending == 1
    third = h.sched.schedule(4.0)
    assert [s.token_ids for s in third.scheduled] == [[PLACEHOLDER_TOKEN]]
    h.sched.update(second, [8])
    h.sched.update(third, [9])
    assert a.output_token_ids == [7, 8, 9] and a.num_pending == 0
    # with one token left, the token in flight surely ends it by length: nothing is scheduled on it
    fourth = h.sched.schedule(5.0)
    assert fourth.scheduled[0].token_ids == [9]
    assert h.sched.schedule(6.0).scheduled == []
    (out,) = h.sched.update(fourth, [10])
    assert out.finished and out.finish_reason is FinishReason.LENGTH and a.output_token_ids == [7, 8, 9, 10]
    h.sched.check_invariants()


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_model_len=64, num_pages=64, max_num_batched_tokens=8, max_num_seqs=16)
    with pytest.raises(ValueError, match="max_model_len"):
        SchedulerConfig(max_model_len=4096, num_pages=8, page_size=16)
    with pytest.raises(ValueError, match="page_size"):
        SchedulerConfig(max_model_len=64, num_pages=64, page_size=0)
    with pytest.raises(ValueError, match="priority_ageing_s"):
        SchedulerConfig(max_model_len=64, num_pages=64, priority_ageing_s=-1.0)
