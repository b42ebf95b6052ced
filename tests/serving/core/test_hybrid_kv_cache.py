"""Gemma 3 through the engine on the hybrid KV cache (its sliding-window layers keep only their window's pages): HF's
greedy tokens with prompts longer than the window, chunked prefill, staggered arrivals, prefix-cache hits, preemption,
n > 1 forks and n-gram speculation, the window pool's pages freed as it slides, and the same tokens with the hybrid
cache off."""
import pytest
import transformers as tf

from serving.core.config import EngineConfig
from serving.core.engine import Engine
from serving.core.hybrid_block_manager import HybridBlockManager
from serving.core.sampling_params import SamplingParams
from tests.support import hf_models

PS, WINDOW = 4, 12  # the test config's window (tests/support/hf_models.py "gemma3")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("hybrid") / "gemma3")
    hf_models.save_hf_model("gemma3", d)
    return d, tf.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval()


def _engine(path, **options):
    options = {"page_size": PS, "num_pages": 64, "max_num_seqs": 4, "max_num_batched_tokens": 16,
               "max_prefill_chunk": 8, "compilation_cache_dir": "", **options}
    return Engine(EngineConfig(model=path, **options))


def _run(engine, requests, arrivals=None, held=None, cached=None):
    """Runs (request id, prompt, SamplingParams) requests, request i added at step arrivals[i]; checks every book
    after each step and records the pages each pool holds (`held`) and the prompt tokens each request found in the
    prefix cache (`cached`). Returns the tokens by request id ("<id>#<i>": sample i > 0 of an n > 1 request)."""
    arrivals = arrivals or [0] * len(requests)
    outs, step = {}, 0
    cached = {} if cached is None else cached
    while step <= max(arrivals) or engine.has_unfinished():
        for (rid, prompt, params), at in zip(requests, arrivals):
            if at == step:
                engine.add_request(engine.make_request(rid, prompt, params))
        for o in engine.step():
            key = o.request_id + (f"#{o.index}" if o.index else "")
            outs.setdefault(key, []).extend(o.new_token_ids)
            cached[key] = o.request.metrics.num_cached_prompt_tokens
        engine.scheduler.check_invariants()
        if held is not None:
            held.append(engine.scheduler.block_manager.pages_held())
        step += 1
    engine.scheduler.block_manager.check_idle()
    return outs


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_long_prompt_holds_only_its_window_as_it_slides(gemma3):
    path, hf = gemma3
    prompt = hf_models.random_prompt(40, 160, seed=5)
    engine = _engine(path)
    bm = engine.scheduler.block_manager
    assert isinstance(bm, HybridBlockManager) and [p.window for p in bm.pools] == [WINDOW]
    # the window pool: 4 sequences x (3 + 2) pages + a 16-token step's 4 = 24 pages beside the 64 of the table
    assert engine.runner.window_pages == {WINDOW: 24}
    assert [kv.shape[0] for kv in engine.runner.kv_caches] == [24, 64, 24]  # local, global, local layers
    held = []
    out = _run(engine, [("r", prompt, greedy(32))], held=held)
    assert out["r"] == hf_models.hf_greedy(hf, prompt, 32)
    primary, window = zip(*held)
    # every step: the table's pages hold all of the sequence, the window pool at most its window's blocks
    # (ceil(11 / 4) + 1 = 4) plus those an 8-token chunk writes (2 more)
    assert max(primary) == 18 and max(window) <= 6
    assert window[-2] == 4  # decoding at position 70: blocks 14..17 (positions 56..71)
    assert len(held) > 36 and all(w <= 4 for w in window[6:-1])


def test_hf_tokens_through_prefix_hits_preemption_and_forks(gemma3):
    """Three staggered prompts longer than the window, then the first again (a prefix-cache hit that needs its
    window's pages) and an n = 2 request sharing its prompt's pages; 40 pages for sequences of up to 16 preempt.
    (A window pool as big as the table's, 8 sequences' windows, keeps the cached blocks' window pages: with 4
    sequences' (24 pages) the first prompt's were evicted by the time it came again, and so was the hit.)"""
    path, hf = gemma3
    prompts = [hf_models.random_prompt(n, 160, seed=s) for n, s in ((40, 2), (33, 3), (27, 4))]
    requests = [(f"r{i}", p, greedy(24)) for i, p in enumerate(prompts)]
    requests.append(("again", prompts[0] + [7, 8, 9], greedy(16)))
    requests.append(("pair", prompts[1][:30], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2)))
    expected = {rid: hf_models.hf_greedy(hf, p, params.max_tokens) for rid, p, params in requests}
    expected["pair#1"] = expected["pair"]
    engine = _engine(path, num_pages=40, max_num_seqs=8)
    assert engine.runner.window_pages == {WINDOW: 40}
    cached = {}
    outs = _run(engine, requests, arrivals=[0, 3, 6, 40, 41], cached=cached)
    assert outs == expected
    assert engine.scheduler.num_preemptions > 0, "the pages were to run short"
    # "again" took prompt 0's 10 cached blocks and the window pages of the last ones (its next query, at 40, reads
    # 29..40)
    assert cached["again"] == 40, cached


def test_ngram_speculation_and_the_hybrid_cache_off(gemma3):
    path, hf = gemma3
    # a prompt that repeats itself, so the n-grams propose (and some drafts are accepted)
    base = hf_models.random_prompt(10, 160, seed=9)
    prompts = [base * 4, hf_models.random_prompt(30, 160, seed=10)]
    expected = [hf_models.hf_greedy(hf, p, 24) for p in prompts]
    spec = _engine(path, speculative_method="ngram", num_speculative_tokens=3)
    out = _run(spec, [(f"r{i}", p, greedy(24)) for i, p in enumerate(prompts)])
    assert [out["r0"], out["r1"]] == expected
    assert spec.spec.num_draft_tokens > 0
    # off: every layer indexes the page table's pages (the path tests/models/test_model_parity.py checks)
    off = _engine(path, hybrid_kv_cache=False)
    assert not off.runner.window_pages and not isinstance(off.scheduler.block_manager, HybridBlockManager)
    assert {kv.shape[0] for kv in off.runner.kv_caches} == {64}
