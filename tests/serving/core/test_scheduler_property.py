"""Property test: random arrivals (some of n > 1 samples sharing their prompt's pages), aborts, stop strings,
deadlines, roll-backs and page pressure, with and without the engine's look-ahead (step N scheduled and run before
step N-1's update).

After every operation every book must agree (reference counts, free list, cache index, queues); no page is
shared except through the prefix cache or a fork of an n > 1 request's prompt. At the end: no request lost (each
ended with a finish reason), every output (every sample's) is the fake model's exact greedy continuation
(preemption and prefix hits included), no page leaked. Both with one page pool and with a hybrid KV cache's window
pool beside it (the fake model then also reads a sliding window of tokens through that pool's pages).
"""
import dataclasses

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from serving.core import (FinishReason, Priority, QueueFullError, Request, SamplingParams, Scheduler,
                          SchedulerConfig)
from serving.core.fake_model import FakeModel
from serving.core.hybrid_block_manager import HybridBlockManager
from serving.core.scheduler import PLACEHOLDER_TOKEN

PS, MAX_LEN, EOS, VOCAB = 4, 64, 0, 40

configs = st.builds(
    dict,
    num_pages=st.sampled_from([MAX_LEN // PS, MAX_LEN // PS + 2, 24, 40]),  # mostly tight: page pressure
    max_num_seqs=st.integers(2, 8),
    extra_budget=st.integers(0, 40),
    max_prefill_chunk=st.none() | st.integers(1, 16),
    long_prompt_threshold=st.integers(8, 60),
    max_long_prefills=st.integers(1, 2),
    max_waiting_requests=st.integers(2, 12),
    priority_ageing_s=st.sampled_from([0.0, 3.0, 1e9]),
    preempt_for_priority=st.booleans(),
    enable_prefix_caching=st.booleans(),
    look_ahead=st.booleans(),
    window=st.none() | st.integers(1, 20),  # a hybrid KV cache's sliding window
    window_slack=st.integers(0, 12),  # its pool's pages beyond what one sequence needs
)
adds = st.tuples(st.just("add"), st.integers(1, 60), st.integers(1, 8) | st.integers(20, 60) | st.none(),
                 st.sampled_from(list(Priority)), st.none() | st.integers(1, 40), st.integers(0, 3), st.booleans(),
                 st.sampled_from([1, 1, 2, 3]))
ops = st.lists(st.one_of(
    adds, adds,
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 100)),
    st.tuples(st.just("stop_string"), st.integers(0, 100)),
    st.tuples(st.just("rollback"), st.integers(0, 100), st.integers(1, 9)),
), min_size=20, max_size=60)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, operations=ops)
def test_random_traffic_keeps_every_invariant(cfg, operations):
    extra = cfg.pop("extra_budget")
    look_ahead = cfg.pop("look_ahead")
    window, window_slack = cfg.pop("window"), cfg.pop("window_slack")
    config = SchedulerConfig(max_model_len=MAX_LEN, page_size=PS,
                             max_num_batched_tokens=cfg["max_num_seqs"] + extra, **cfg)
    sched, model = _scheduler_and_model(config, window, window_slack)
    families = [[(f * 13 + i) % (VOCAB - 1) + 1 for i in range(40)] for f in range(4)]
    accepted: dict[str, Request] = {}
    streamed: dict[str, list[int]] = {}
    now = 0.0
    inflight = None  # look-ahead: (output, sampled, token by request id) of the step whose update() waits

    def step():
        nonlocal now, inflight
        now += 1.0
        out = sched.schedule(now)
        sched.check_invariants()
        assert out.num_scheduled_tokens <= config.max_num_batched_tokens
        feed = [dataclasses.replace(s, token_ids=[inflight[2][s.request_id]])
                if s.token_ids[0] == PLACEHOLDER_TOKEN else s for s in out.scheduled]
        sampled = model.step(feed)
        done = (out, sampled)
        if look_ahead:
            done, inflight = inflight, (out, sampled, {s.request_id: t for s, t in zip(out.scheduled, sampled)})
        if done is not None:
            for o in sched.update(done[0], done[1], now):
                streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
        sched.check_invariants()

    for op in operations:
        kind = op[0]
        if kind == "add":
            _, n, max_tokens, priority, deadline, family, shared, samples = op
            prompt = families[family][:n] if shared else [(len(accepted) * 7 + i) % (VOCAB - 1) + 1
                                                          for i in range(n)]
            rid = f"r{len(accepted)}-{now}"
            r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, n=samples),
                        priority=priority, arrival_time=now, deadline=None if deadline is None else now + deadline,
                        eos_token_ids=(EOS,))
            try:
                sched.add_request(r)
                accepted.update((s.request_id, s) for s in r.samples)
            except QueueFullError:
                assert len(sched.waiting) + samples > config.max_waiting_requests
        elif kind == "step":
            for _ in range(op[1]):
                step()
        elif kind in ("abort", "stop_string") + (() if look_ahead else ("rollback",)) and sched.requests:
            rid = list(sched.requests)[op[1] % len(sched.requests)]
            if kind == "abort":
                assert sched.abort(rid, now).finish_reason is FinishReason.ABORT
            elif kind == "stop_string":
                sched.finish_request(rid, FinishReason.STOP, stop_reason="</s>", now=now)
            elif sched.requests[rid].num_computed_tokens:
                r = sched.requests[rid]
                sched.truncate_computed(rid, max(0, r.num_computed_tokens - op[2]))
        sched.check_invariants()

    for _ in range(3000):
        if not sched.has_unfinished_requests() and not (inflight and inflight[0].scheduled):
            break
        step()
    assert not sched.has_unfinished_requests(), "a request never finished"
    for rid, r in accepted.items():
        assert r.is_finished and r.finish_reason is not None, f"{rid} lost"
        assert r.num_tokens <= MAX_LEN
        assert r.output_token_ids == model.greedy_continuation(r.prompt_token_ids, r.num_output_tokens)
        assert streamed.get(rid, []) == r.output_token_ids
        if r.finish_reason is FinishReason.LENGTH:
            assert r.num_tokens == r.max_num_tokens
        if r.finish_reason is FinishReason.STOP and r.stop_reason == EOS:
            assert r.output_token_ids[-1] == EOS
    sched.block_manager.check_idle()


def _scheduler_and_model(config: SchedulerConfig, window: int | None, slack: int):
    """A scheduler on one page pool (`window` None) or on a hybrid KV cache with a window pool of the pages one
    sequence needs at most plus `slack` (capped at the page table's, as the engine sizes it), and the fake model
    reading through its pages."""
    if window is None:
        return Scheduler(config), FakeModel(config.num_pages, PS, vocab_size=VOCAB)
    pages = min(config.num_pages, -(-(window - 1) // PS) + 2 + -(-config.max_num_batched_tokens // PS) + slack)
    bm = HybridBlockManager(config.num_pages, PS, window_pages={window: pages},
                            enable_prefix_caching=config.enable_prefix_caching)
    return Scheduler(config, bm), FakeModel(config.num_pages, PS, vocab_size=VOCAB, window_maps=bm.window_maps,
                                            window_pages=[pages])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_pages=st.integers(MAX_LEN // PS, 24), max_num_seqs=st.integers(2, 8),
       enable_prefix_caching=st.booleans(), preempt_for_priority=st.booleans(),
       window=st.none() | st.integers(1, 20),
       arrivals=st.lists(st.tuples(st.integers(8, 50), st.integers(10, 60), st.sampled_from(list(Priority)),
                                   st.integers(0, 3), st.integers(0, 3), st.sampled_from([1, 1, 3])),
                         min_size=2, max_size=12))
# Found by this test: a sample forked pages from a sibling whose cache chain had gone another way (regression).
@example(num_pages=16, max_num_seqs=2, enable_prefix_caching=True, preempt_for_priority=False, window=None,
         arrivals=[(29, 10, Priority.INTERACTIVE, 0, 0, 1), (25, 10, Priority.BATCH, 0, 0, 3),
                   (8, 10, Priority.INTERACTIVE, 1, 0, 1)])
@example(num_pages=16, max_num_seqs=3, enable_prefix_caching=True, preempt_for_priority=True, window=5,
         arrivals=[(40, 20, Priority.BATCH, 0, 0, 3), (30, 20, Priority.INTERACTIVE, 0, 1, 1),
                   (45, 10, Priority.INTERACTIVE, 0, 0, 1)])
def test_page_pressure_preempts_and_outputs_stay_exact(num_pages, max_num_seqs, enable_prefix_caching,
                                                       preempt_for_priority, window, arrivals):
    config = SchedulerConfig(max_model_len=MAX_LEN, page_size=PS, num_pages=num_pages, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=16, enable_prefix_caching=enable_prefix_caching,
                             preempt_for_priority=preempt_for_priority)
    sched, model = _scheduler_and_model(config, window, 0)
    families = [[(f * 13 + i) % (VOCAB - 1) + 1 for i in range(50)] for f in range(4)]
    requests = []
    now = 0.0
    for i, (n, max_tokens, priority, family, gap, samples) in enumerate(arrivals):
        prompt = families[family][:n - 3] + [i % 7 + 1, i % 5 + 1, 1]
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                    n=samples), priority=priority, arrival_time=now)
        sched.add_request(r)
        requests += r.samples
        for _ in range(gap + 1 if i < len(arrivals) - 1 else 3000):
            if not sched.has_unfinished_requests():
                break
            now += 1.0
            out = sched.schedule(now)
            sched.check_invariants()
            sched.update(out, model.step(out.scheduled), now)
            sched.check_invariants()
    assert not sched.has_unfinished_requests()
    for r in requests:
        assert r.finish_reason is FinishReason.LENGTH and r.num_tokens == r.max_num_tokens
        assert r.output_token_ids == model.greedy_continuation(r.prompt_token_ids, r.num_output_tokens)
    sched.block_manager.check_idle()
