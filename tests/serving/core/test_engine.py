"""Engine end to end on a real (small) model: continuous batching, chunked prefill, prefix cache and
preemption all give HF's greedy tokens; warm-up compiles everything; sampling is reproducible per seed; n > 1
samples share one prefill; a logit bias gives HF's sequence-bias tokens."""
import asyncio
import dataclasses
import time

import numpy as np
import pytest

from pallas_kernels import native
import transformers as tf

from serving.core.async_engine import AsyncEngine, EngineDeadError
from serving.core.config import EngineConfig
from serving.core.engine import Engine
from serving.core.llm import LLM
from serving.core.request import FinishReason
from serving.core.sampling_params import SamplingParams
from tests.support import hf_models

N_REQUESTS = 32


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("engine") / "llama")
    hf_models.save_hf_model("llama", d)
    hf = tf.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
    return d, hf


@pytest.fixture(scope="module")
def workload(llama):
    """32 requests, mixed prompt and output lengths, half sharing a 24-token system prompt, and HF's greedy
    continuation of each, computed one request at a time."""
    _, hf = llama
    rng = np.random.default_rng(0)
    system = hf_models.random_prompt(24, 160, seed=99)
    prompts, lengths = [], []
    for i in range(N_REQUESTS):
        p = hf_models.random_prompt(int(rng.integers(2, 50)), 160, seed=100 + i)
        prompts.append(system + p if i % 2 else p)
        lengths.append(int(rng.integers(1, 24)))
    expected = [hf_models.hf_greedy(hf, p, n) for p, n in zip(prompts, lengths)]
    return prompts, lengths, expected


def _run(llm: LLM, workload):
    prompts, lengths, expected = workload
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate(prompts, params)
    for o, n in zip(outs, lengths):
        assert o.finish_reason is FinishReason.LENGTH and len(o.token_ids) == n
    llm.engine.scheduler.block_manager.check_idle()
    return outs


@pytest.mark.parametrize("name, options", [
    ("chunked_prefill", dict(max_num_batched_tokens=64, max_prefill_chunk=16, enable_prefix_caching=False)),
    ("prefix_cache", dict(max_num_batched_tokens=128, enable_prefix_caching=True)),
    ("preemption", dict(max_num_batched_tokens=64, num_pages=24, enable_prefix_caching=True)),
    ("synchronous", dict(max_num_batched_tokens=64, num_pages=24, async_scheduling=False)),
])
def test_concurrent_greedy_matches_hf(llama, workload, name, options):
    options = {"page_size": 8, "num_pages": 256, "max_num_seqs": 16, **options}
    llm = LLM(llama[0], warmup=False, **options)
    outs = _run(llm, workload)
    got = [o.token_ids for o in outs]
    assert got == workload[2]
    # greedy steps look one step ahead (decodes fed from the previous step's tokens on the device) unless off
    assert (llm.engine.look_ahead_steps > 0) == options.get("async_scheduling", True)
    if name == "prefix_cache":
        assert sum(o.metrics.num_cached_prompt_tokens for o in outs) >= 16 * 24 // 2
    if name in ("preemption", "synchronous"):
        assert sum(o.metrics.num_preemptions for o in outs) > 0
    if name == "chunked_prefill":
        assert llm.engine.scheduler.config.prefill_chunk == 16


def test_warmup_compiles_every_program(llama, workload):
    # Buckets from 1: every kind of program (all three sequence buckets, the screened forward); the programs of
    # buckets from 16 are a subset of these, so that configuration's plan is only counted (same warm-up loop).
    from16 = LLM(llama[0], warmup=False, page_size=8, num_pages=256, max_num_seqs=16, max_num_batched_tokens=64,
                 min_token_bucket=16).engine
    assert from16.buckets == [16, 32, 64]
    assert not any(from16.runner.screens(from16.runner.seq_bucket(t)) for t in from16.buckets)
    assert len(from16.warmup_plan()) == len(from16.buckets) + 10 and from16.compile_count == 0
    plan16 = {(p.kind, p.seqs, repr(p.params), p.max_logprobs) + ((p.tokens,) if p.kind == "forward" else ())
              for p in from16.warmup_plan()}
    del from16
    llm = LLM(llama[0], page_size=8, num_pages=256, max_num_seqs=16, max_num_batched_tokens=64, min_token_bucket=1)
    eng = llm.engine
    # Per token bucket the forward, per sequence bucket 8 sampling variants, the logit-bias (general) one and the
    # masked one (structured outputs); buckets of up to
    # SCREEN_MAX_ROWS sequences also the greedy-only forward with the screened LM head (when the native kernels run).
    screened = [t for t in eng.buckets if eng.runner.screens(eng.runner.seq_bucket(t))]
    assert eng.buckets == [1, 2, 4, 8, 16, 32, 64]
    assert screened == ([1, 2, 4] if native.enabled() else [])
    seq_buckets = {eng.runner.seq_bucket(t) for t in eng.buckets}
    assert eng.compile_count == len(eng.buckets) + 10 * len(seq_buckets) + len(screened)
    assert eng.compile_count == len(eng.warmup_plan())
    assert plan16 <= {(p.kind, p.seqs, repr(p.params), p.max_logprobs) + ((p.tokens,) if p.kind == "forward" else ())
                      for p in eng.warmup_plan() if not p.greedy_only}
    forward_programs = eng.runner._forward_fn._cache_size()
    sample_programs = eng.runner._sample_fn._cache_size()
    _run(llm, workload)
    for p in workload[0][:3]:  # lone greedy requests: steps of one sequence
        llm.generate([p], SamplingParams(temperature=0.0, max_tokens=3))
    mixed = [SamplingParams(temperature=0.7, seed=3, top_p=0.9, max_tokens=5),
             SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=2, max_tokens=5),
             SamplingParams(temperature=1.0, seed=4, top_k=5, min_p=0.1, frequency_penalty=0.5, max_tokens=5)]
    llm.generate(workload[0][:3], mixed)
    biased = [SamplingParams(temperature=0.0, logit_bias={5: 3.0}, max_tokens=5),
              SamplingParams(temperature=0.8, seed=5, top_k=7, logit_bias={6: -50.0}, logprobs=1, max_tokens=5, n=2),
              SamplingParams(temperature=0.0, presence_penalty=1.0, logit_bias={7: 1.0}, max_tokens=5)]
    llm.generate(workload[0][:3], biased)
    llm.generate(workload[0][:1], biased[:1])
    # (Steps with a grammar reuse the warmed-up programs too: tests/serving/core/test_structured.py.)
    assert eng.runner._forward_fn._cache_size() == forward_programs
    assert eng.runner._sample_fn._cache_size() == sample_programs


def test_default_token_buckets_follow_the_platform_and_dtype(monkeypatch):
    from serving.core.platform import platform_choices
    smallest = lambda dtype, platform="cpu": platform_choices(platform, dtype=dtype).min_token_bucket  # noqa: E731
    assert smallest("float32") == 1  # a lone decode is not padded on CPU
    # XLA:CPU's fast bf16 matmuls start at ~8 rows; the native kernels take the smaller steps
    assert smallest("bfloat16") == (1 if native.enabled() else 8)
    monkeypatch.setenv("MESHSERVE_CPU_KERNELS", "xla")
    assert smallest("bfloat16") == 8
    assert smallest("bfloat16", "tpu") == 16 and smallest("float32", "tpu") == 8 and smallest("bfloat16", "gpu") == 8
    assert EngineConfig(model="/m", max_num_batched_tokens=48).token_buckets() == [1, 2, 4, 8, 16, 32, 48]
    assert EngineConfig(model="/m", dtype="bfloat16", max_num_batched_tokens=64).token_buckets() == [8, 16, 32, 64]
    assert EngineConfig(model="/m", platform="tpu", dtype="bfloat16", max_num_batched_tokens=40).token_buckets() \
        == [16, 32, 48]  # whole (16-row) tiles on TPU
    assert EngineConfig(model="/m", min_token_bucket=16, max_num_batched_tokens=64).token_buckets() == [16, 32, 64]
    with pytest.raises(ValueError, match="min_token_bucket"):
        EngineConfig(model="/m", min_token_bucket=-1)


def test_seeded_sampling_is_reproducible_and_batch_independent(llama, workload):
    llm = LLM(llama[0], warmup=False, page_size=8, num_pages=256, max_num_seqs=16, max_num_batched_tokens=64)
    prompts = workload[0]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([prompts[0]], params)[0].token_ids
    crowd = llm.generate(prompts[:8], [params] + [dataclasses.replace(params, seed=i) for i in range(7)])
    assert crowd[0].token_ids == alone
    assert len({tuple(o.token_ids) for o in crowd}) > 4


def test_logprobs_and_stop_tokens(llama, workload):
    llm = LLM(llama[0], warmup=False, page_size=8, num_pages=256, max_num_seqs=16, max_num_batched_tokens=64)
    prompt, _, expected = workload[0][0], None, workload[2][0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 6
    for lp, tok in zip(out.logprobs, out.token_ids):
        assert lp.token_id == tok and lp.top[0][0] == tok  # greedy: the sampled token is the most likely
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1] and abs(lp.logprob - lp.top[0][1]) < 1e-5
    stop_at = expected[2]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_at]))[0]
    first = expected.index(stop_at)
    assert out.token_ids == expected[:first + 1] and out.finish_reason is FinishReason.STOP
    assert out.stop_reason == stop_at


def test_look_ahead_with_stops_aborts_and_mixed_sampling(llama, workload):
    """Greedy steps run one step ahead: a stop token ends a request (the decode already launched on that token
    is dropped), a request with logprobs (the sampling program) mixes in, an abort lands with a step in flight,
    and every output still matches HF's with all pages back."""
    prompts, lengths, expected = workload
    eng = LLM(llama[0], warmup=False, page_size=8, num_pages=256, max_num_seqs=16,
              max_num_batched_tokens=64).engine
    picks = [i for i in range(len(prompts)) if lengths[i] >= 4][:6]
    requests = {}
    for i in picks:
        stop = expected[i][2]
        requests[i] = eng.make_request(f"s{i}", prompts[i], SamplingParams(
            temperature=0.0, max_tokens=lengths[i], stop_token_ids=[stop], ignore_eos=True))
    mixed = eng.make_request("lp", prompts[picks[0]], SamplingParams(
        temperature=0.0, max_tokens=lengths[picks[0]], logprobs=2, ignore_eos=True))
    doomed = eng.make_request("doomed", prompts[1], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    for r in [*requests.values(), doomed]:
        eng.add_request(r)
    outputs: dict[str, list] = {}
    steps = 0
    while eng.has_unfinished():
        for o in eng.step():
            outputs.setdefault(o.request_id, []).append(o)
        steps += 1
        if steps == 3:
            eng.add_request(mixed)  # joins greedy work in flight
        if steps == 6:
            assert eng._pending is not None  # a step is on the device
            final, = eng.abort("doomed")
            assert final.finished and final.finish_reason is FinishReason.ABORT
    for i, r in requests.items():
        want = expected[i][:expected[i].index(expected[i][2]) + 1]
        assert r.output_token_ids == want and r.finish_reason is FinishReason.STOP
        assert [t for o in outputs[r.request_id] for t in o.new_token_ids] == want
    assert mixed.output_token_ids == expected[picks[0]]
    assert all(lp.token_id == t for o in outputs["lp"] for lp, t in zip(o.logprobs or [], o.new_token_ids))
    assert 0 < doomed.num_output_tokens < 200
    assert eng.look_ahead_steps > 0
    eng.scheduler.check_invariants()
    eng.scheduler.block_manager.check_idle()


def test_step_records_do_not_overlap_under_look_ahead(llama, workload):
    """A look-ahead step is launched while the one before it runs; its reported device time starts when that one's
    results arrived, so consecutive steps' [start, end] never overlap and their times never sum past the wall."""
    eng = LLM(llama[0], warmup=False, page_size=8, num_pages=256, max_num_seqs=16, max_num_batched_tokens=64).engine
    for i, p in enumerate(workload[0][:4]):
        eng.add_request(eng.make_request(f"t{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)))
    records, t0 = [], time.monotonic()
    while eng.has_unfinished():
        eng.step()
        if eng.last_step is not None and (not records or eng.last_step is not records[-1]):
            records.append(eng.last_step)
    wall = time.monotonic() - t0
    assert eng.look_ahead_steps > 0 and len(records) > 10
    for before, after in zip(records, records[1:]):
        assert after.start_time >= before.end_time - 1e-3
    assert sum(r.end_time - r.start_time for r in records) <= wall + 1e-3  # (records mix two clocks: us apart)
    # every step after the first was launched before the previous one's tokens arrived: the device never
    # waited on the host; synchronously it waits every step (collect, schedule, build, dispatch)
    assert eng.host_gap_s == 0.0 and eng.host_gap_steps == len(records) - 1
    eng.look_ahead = False
    eng.add_request(eng.make_request("sync", workload[0][0], SamplingParams(temperature=0.0, max_tokens=8)))
    eng.run_until_idle()
    assert eng.host_gap_s > 0.0 and eng.host_gap_steps > len(records)


def test_async_engine_survives_a_caller_cancelling_its_call(llama):
    """A call whose future is cancelled before the engine thread runs it (its RPC ended) still runs, and the
    engine keeps serving; setting the cancelled future's result used to kill the engine thread."""
    import threading
    engine = Engine(EngineConfig(model=llama[0], page_size=8, num_pages=64, max_num_seqs=4,
                                 max_num_batched_tokens=32))
    aeng = AsyncEngine(engine)
    try:
        release, ran = threading.Event(), []
        blocker = aeng.call(lambda e: release.wait(10))
        late = aeng.call(lambda e: ran.append(True) or "late")
        assert late.cancel()
        release.set()
        assert blocker.result(10) is True
        assert aeng.call(lambda e: e.has_unfinished()).result(10) is False
        assert ran == [True] and late.cancelled() and aeng.is_alive
    finally:
        aeng.shutdown()


def test_multihost_step_failure_from_a_lost_peer_is_unavailable(llama, monkeypatch):
    """A multi-host leader's step that fails because a follower died: when the collective's own error says the
    peer is gone, every stream ends with EngineDeadError (UNAVAILABLE) at once, without waiting for the step
    channel's watchdog; any other failure is not taken for a lost peer (the step's requests fail, INTERNAL)."""
    import time

    from serving.core import async_engine
    monkeypatch.setattr(async_engine, "PEER_LOSS_GRACE_S", 0.2)
    engine = Engine(EngineConfig(model=llama[0], page_size=8, num_pages=64, max_num_seqs=4,
                                 max_num_batched_tokens=32))
    engine.runner.channel = object()  # a multi-host leader (no watchdog reports here)
    gloo = "UNKNOWN: Gloo all-reduce failed: [pair.cc:538] Read error [127.0.0.1]:38303: Connection reset by peer"

    def failing_step():
        raise RuntimeError(gloo)
    monkeypatch.setattr(engine, "step", failing_step)
    aeng = AsyncEngine(engine)

    async def run():
        async for _ in aeng.generate("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4)):
            pass

    try:
        assert aeng._peer_lost(engine, RuntimeError("INTERNAL: an unrelated numerical failure")) is False
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="a multi-host peer is gone"):
            asyncio.run(run())
        assert time.monotonic() - t0 < 5 and not aeng.is_alive
    finally:
        aeng.shutdown()


def test_async_engine_abort_deadline_and_streaming(llama, workload):
    engine = Engine(EngineConfig(model=llama[0], page_size=8, num_pages=128, max_num_seqs=8,
                                 max_num_batched_tokens=32))
    aeng = AsyncEngine(engine)
    prompts, _, expected = workload

    async def stream(i, n):
        toks = []
        async for out in aeng.generate(f"r{i}", prompts[i], SamplingParams(temperature=0, max_tokens=n,
                                                                             ignore_eos=True)):
            toks += out.new_token_ids
            last = out
        return toks, last

    async def cancelled(i):
        gen = aeng.generate(f"c{i}", prompts[i], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        async for out in gen:
            if out.new_token_ids:
                break
        await gen.aclose()  # the client went away: the request is aborted, pages freed

    async def timed_out():
        outs = []
        async for out in aeng.generate("late", prompts[1], SamplingParams(temperature=0, max_tokens=10_000,
                                                                          ignore_eos=True),
                                       deadline=time.monotonic() + 0.3):
            outs.append(out)
        return outs[-1]

    async def main():
        return await asyncio.gather(*[stream(i, 8) for i in range(6)], *[cancelled(i) for i in range(3)],
                                    timed_out())

    try:
        results = asyncio.run(main())
        for i in range(6):
            toks, last = results[i]
            assert toks == hf_models.hf_greedy(llama[1], prompts[i], 8) and last.finished
        assert results[-1].finish_reason is FinishReason.TIMEOUT
        idle = aeng.call(lambda e: (e.has_unfinished(), e.scheduler.block_manager.check_idle())).result(10)
        assert idle[0] is False
    finally:
        aeng.shutdown()


# ---- n > 1 ---------------------------------------------------------------------------------------------------
def _drive(eng, requests):
    """Runs `requests` to the end; returns (tokens per (request id, sample index), prompt tokens computed, the most
    KV pages in use at once)."""
    for r in requests:
        eng.add_request(r)
    bm, tokens, prefill, peak, last = eng.scheduler.block_manager, {}, 0, 0, None
    while eng.has_unfinished():
        for o in eng.step():
            tokens.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
        peak = max(peak, bm.num_pages - bm.num_free_pages)
        if eng.last_step is not None and eng.last_step is not last:
            last = eng.last_step
            prefill += sum(max(0, min(s.start + len(s.token_ids), s.request.num_prompt_tokens) - s.start)
                           for s in last.scheduled)
    eng.scheduler.check_invariants()
    bm.check_idle()
    return tokens, prefill, peak


def test_n_samples_share_one_prefill_and_are_reproducible(llama, workload):
    llm = LLM(llama[0], warmup=False, page_size=8, num_pages=256, max_num_seqs=16, max_num_batched_tokens=64)
    eng = llm.engine
    prompt = workload[0][1]  # the shared system prompt and more: its full pages are shared, not its last one
    params = SamplingParams(n=3, temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    first, prefill, peak = _drive(eng, [eng.make_request("a", prompt, params)])
    assert sorted(first) == [("a", 0), ("a", 1), ("a", 2)] and all(len(t) == 12 for t in first.values())
    assert len({tuple(t) for t in first.values()}) == 3  # three different samples
    full, pages = (len(prompt) - 1) // 8, -(-(len(prompt) + 12) // 8)
    assert prefill == len(prompt) + 2 * (len(prompt) - 8 * full)  # the prompt computed once
    assert peak <= pages + 2 * (pages - full) < 3 * pages
    again, _, _ = _drive(eng, [eng.make_request("b", prompt, params)])
    assert [again[("b", i)] for i in range(3)] == [first[("a", i)] for i in range(3)]  # the whole set, run to run
    alone, _, _ = _drive(eng, [eng.make_request("c", prompt, dataclasses.replace(params, n=1))])
    assert alone[("c", 0)] == first[("a", 0)]  # sample 0 keeps the request's seed
    # Greedy samples are identical (HF's greedy); the offline API returns them all, sample 0's as before.
    c = llm.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert [o.index for o in c.outputs] == [0, 1, 2] and c.token_ids == c.outputs[0].token_ids
    assert c.metrics is c.outputs[0].metrics and c.finish_reason is FinishReason.LENGTH
    assert [o.token_ids for o in c.outputs] == [hf_models.hf_greedy(llama[1], prompt, 8)] * 3
    # (sample 0 from the prefix cache, which the runs above filled; the others from sample 0's pages)
    assert [o.metrics.num_cached_prompt_tokens for o in c.outputs] == [8 * full] * 3


def test_n_samples_abort_and_preemption(llama, workload):
    prompts = workload[0]
    eng = LLM(llama[0], warmup=False, page_size=8, num_pages=256, max_num_seqs=16, max_num_batched_tokens=64).engine
    eng.add_request(eng.make_request("doomed", prompts[3], SamplingParams(n=3, temperature=0.9, seed=5,
                                                                          max_tokens=200, ignore_eos=True)))
    for _ in range(4):
        eng.step()
    finals = eng.abort("doomed")
    assert sorted(o.index for o in finals) == [0, 1, 2]
    assert all(o.request_id == "doomed" and o.finish_reason is FinishReason.ABORT for o in finals)
    eng.run_until_idle()
    eng.scheduler.block_manager.check_idle()
    # Few pages: samples are preempted and recomputed; greedy samples still give HF's tokens, sampled ones finish.
    tight = LLM(llama[0], warmup=False, page_size=8, num_pages=24, max_num_seqs=16, max_num_batched_tokens=64).engine
    picks = [1, 3, 5, 7]
    requests = [tight.make_request(f"g{i}", prompts[i], SamplingParams(n=3, temperature=0.0, max_tokens=20,
                                                                       ignore_eos=True)) for i in picks]
    requests += [tight.make_request("s", prompts[0], SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=20,
                                                                    ignore_eos=True))]
    tokens, _, _ = _drive(tight, requests)
    assert sum(s.metrics.num_preemptions for r in requests for s in r.samples) > 0
    for i in picks:
        want = hf_models.hf_greedy(llama[1], prompts[i], 20)
        assert [tokens[(f"g{i}", k)] for k in range(3)] == [want] * 3
    assert all(len(tokens[("s", k)]) == 20 for k in range(3))


# ---- logit_bias ----------------------------------------------------------------------------------------------
def _hf_biased_greedy(model, prompt, steps, bias):
    import torch
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             pad_token_id=0, eos_token_id=None,
                             sequence_bias=[[[t], float(b)] for t, b in bias.items()])
    return out[0, len(prompt):].tolist()


def test_logit_bias_matches_hf_and_leaves_unbiased_neighbours_alone(llama, workload):
    prompts, hf = workload[0], llama[1]
    expected = {i: hf_models.hf_greedy(hf, prompts[i], 6) for i in (0, 2, 6)}
    llm = LLM(llama[0], warmup=False, page_size=8, num_pages=256, max_num_seqs=16, max_num_batched_tokens=64)
    ban = {expected[0][0]: -100.0, expected[0][1]: -100.0}  # the unbiased greedy tokens
    nudge = {t: 3.0 for t in range(40, 60)}
    params = [SamplingParams(temperature=0.0, max_tokens=6, logit_bias=ban),
              SamplingParams(temperature=0.0, max_tokens=6),
              SamplingParams(temperature=0.0, max_tokens=6, logit_bias={77: 100.0}),
              SamplingParams(temperature=0.0, max_tokens=6),
              SamplingParams(temperature=1.0, seed=3, top_p=0.9, max_tokens=6, logit_bias={77: 100.0}),
              SamplingParams(temperature=0.0, max_tokens=6, logit_bias=nudge)]
    picks = [0, 2, 4, 6, 8, 10]
    outs = llm.generate([prompts[i] for i in picks], params)
    assert outs[0].token_ids == _hf_biased_greedy(hf, prompts[0], 6, ban) and outs[0].token_ids[0] != expected[0][0]
    assert outs[2].token_ids == [77] * 6 and outs[4].token_ids == [77] * 6  # forced, greedy and sampled
    assert outs[5].token_ids == _hf_biased_greedy(hf, prompts[10], 6, nudge)
    # the unbiased greedy requests of the same steps keep their own (fast path) tokens
    assert outs[1].token_ids == expected[2][:6] and outs[3].token_ids == expected[6][:6]
    llm.engine.scheduler.block_manager.check_idle()
    with pytest.raises(ValueError, match=r"logit_bias: token id 999 is outside the vocabulary \[0, 160\)"):
        llm.engine.make_request("bad", prompts[0], SamplingParams(logit_bias={999: 1.0}))
    with pytest.raises(ValueError, match=r"logit_bias\[3\] must be in"):
        SamplingParams(logit_bias={3: 250.0})


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_cache_through_prefix_cache_chunks_and_preemption(llama, workload, kv_cache_dtype):
    """A quantized KV cache: chunked prefill, prefix-cache hits and preemption give the tokens of a plain run of the
    same quantized engine (a row's quantisation does not depend on how its pages were written or shared), most of
    them HF's; no page leaks (`_run`)."""
    # Steps of under 8 tokens padded to 8: fewer programs (small buckets: test_concurrent_greedy_matches_hf).
    base = {"page_size": 8, "max_num_seqs": 16, "kv_cache_dtype": kv_cache_dtype, "min_token_bucket": 8}
    plain = [o.token_ids for o in _run(LLM(llama[0], warmup=False, **base, num_pages=256, max_num_batched_tokens=128,
                                           enable_prefix_caching=False), workload)]
    for options in (dict(max_num_batched_tokens=64, max_prefill_chunk=16, num_pages=256, enable_prefix_caching=False),
                    dict(max_num_batched_tokens=128, num_pages=256, enable_prefix_caching=True),
                    dict(max_num_batched_tokens=64, num_pages=24, enable_prefix_caching=True)):
        llm = LLM(llama[0], warmup=False, **base, **options)
        assert llm.engine.runner.kv_caches[0].kv_cache_dtype == kv_cache_dtype
        outs = _run(llm, workload)
        assert [o.token_ids for o in outs] == plain, options
        if options["num_pages"] == 24:
            assert sum(o.metrics.num_preemptions for o in outs) > 0
        elif options["enable_prefix_caching"]:
            assert sum(o.metrics.num_cached_prompt_tokens for o in outs) >= 16 * 24 // 2
    same = sum(p == e for p, e in zip(plain, workload[2]))
    print(f"KV {kv_cache_dtype}: {same} of {len(plain)} greedy continuations equal to HF's float ones")
    assert same >= len(plain) * (3 if kv_cache_dtype == "int8" else 2) // 4  # e4m3 keeps 3 mantissa bits
