"""DeepSeek-V3 (multi-head latent attention, DeepSeek MoE) through the engine's scheduler features: HF's greedy tokens
with chunked prefill, staggered arrivals, a prefix-cache hit on latent pages, preemption, an n = 2 fork and n-gram
speculation; the latent cache is one pool of the page table's pages (no window pool, the plain block manager)."""
import pytest

from serving.core.block_manager import BlockManager
from serving.core.config import EngineConfig
from serving.core.engine import Engine
from serving.core.hybrid_block_manager import HybridBlockManager
from serving.core.sampling_params import SamplingParams
from tests.support import hf_models

PS = 4


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("deepseek_engine") / "deepseek_v3")
    return d, hf_models.save_hf_model("deepseek_v3", d)


def _engine(path, **options):
    options = {"page_size": PS, "num_pages": 40, "max_num_seqs": 8, "max_num_batched_tokens": 16,
               "max_prefill_chunk": 8, "compilation_cache_dir": "", **options}
    return Engine(EngineConfig(model=path, **options))


def _run(engine, requests, arrivals):
    """Runs (request id, prompt, SamplingParams) requests, request i added at step arrivals[i], checking the books
    every step; returns the tokens by request id ("<id>#<i>": sample i > 0) and the prompt tokens found cached."""
    outs, cached, step = {}, {}, 0
    while step <= max(arrivals) or engine.has_unfinished():
        for (rid, prompt, params), at in zip(requests, arrivals):
            if at == step:
                engine.add_request(engine.make_request(rid, prompt, params))
        for o in engine.step():
            key = o.request_id + (f"#{o.index}" if o.index else "")
            outs.setdefault(key, []).extend(o.new_token_ids)
            cached[key] = o.request.metrics.num_cached_prompt_tokens
        engine.scheduler.check_invariants()
        step += 1
    engine.scheduler.block_manager.check_idle()
    return outs, cached


def greedy(steps, **kw):
    return SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, **kw)


def test_hf_tokens_through_prefix_hits_preemption_and_forks(deepseek):
    path, hf = deepseek
    prompts = [hf_models.random_prompt(n, 160, seed=s) for n, s in ((40, 2), (33, 3), (27, 4))]
    requests = [(f"r{i}", p, greedy(20)) for i, p in enumerate(prompts)]
    requests.append(("again", prompts[2] + [7, 8, 9], greedy(12)))  # the last to finish: its pages freed last
    requests.append(("pair", prompts[1][:30], greedy(12, n=2)))
    expected = {rid: hf_models.hf_greedy(hf, p, params.max_tokens) for rid, p, params in requests}
    expected["pair#1"] = expected["pair"]
    engine = _engine(path, num_pages=24)  # 3 sequences of up to 15 pages each: preemption
    bm = engine.scheduler.block_manager
    assert isinstance(bm, BlockManager) and not isinstance(bm, HybridBlockManager) and not engine.runner.window_pages
    assert {kv.shape for kv in engine.runner.kv_caches} == {(24, PS, 1, 48)}  # one latent row of 32 + 16
    outs, cached = _run(engine, requests, arrivals=[0, 3, 6, 80, 81])
    assert outs == expected
    assert engine.scheduler.num_preemptions > 0, "the pages were to run short"
    assert cached["again"] == 24, cached  # prompt 2's 6 full latent pages, cached


def test_ngram_speculation(deepseek):
    path, hf = deepseek
    base = hf_models.random_prompt(10, 160, seed=9)  # a prompt that repeats itself: the n-grams propose
    prompts = [base * 4, hf_models.random_prompt(30, 160, seed=10)]
    spec = _engine(path, speculative_method="ngram", num_speculative_tokens=3)
    outs, _ = _run(spec, [(f"r{i}", p, greedy(20)) for i, p in enumerate(prompts)], arrivals=[0, 0])
    assert [outs["r0"], outs["r1"]] == [hf_models.hf_greedy(hf, p, 20) for p in prompts]
    assert spec.spec.num_draft_tokens > 0
