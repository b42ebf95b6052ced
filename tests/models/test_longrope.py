"""Phi-3's longrope past its original context (16 positions, served to 64), against HF transformers (torch CPU,
float32): a sequence longer than the original context rotates by the long factors, a shorter one by the short ones,
in the same batch."""
import dataclasses

import numpy as np
import pytest

from models.config import ModelConfig
from models.weights import load_hf_model
from serving.core.batch import SeqChunk
from tests.support import hf_models
from tests.support.paged_runner import PagedRunner

FAMILY, ORIGINAL = "phi3_longrope", 16


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return hf_models.cached_dir(str(tmp_path_factory.mktemp("hf")), FAMILY)


@pytest.fixture(scope="module")
def hf(hf_dir):
    import transformers as tf
    return tf.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()


def test_config_serves_past_the_original_context(hf_dir):
    cfg = ModelConfig.from_pretrained(hf_dir)
    assert cfg.max_position_embeddings == 64 and cfg.rope.original_max_position_embeddings == ORIGINAL
    assert cfg.rope.long_factor[-1] == 12.0 and cfg.rope.short_factor[-1] == 2.5


def test_prefill_past_the_original_context_matches_hf(hf, hf_dir):
    """A 40-token prompt as one prefill: HF rotates all of it by the long factors; the short ones would not match."""
    prompt = hf_models.random_prompt(40, hf.config.vocab_size, seed=1)
    ref = hf_models.hf_logits(hf, prompt)
    runner = PagedRunner(load_hf_model(hf_dir), page_size=8)
    got = runner.token_logits([SeqChunk(prompt, 0, runner.alloc(40))])
    assert float(np.max(np.abs(got - ref))) < 1e-4
    cfg = ModelConfig.from_pretrained(hf_dir)
    short = dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, long_factor=cfg.rope.short_factor))
    runner = PagedRunner(load_hf_model(hf_dir, config=short), page_size=8)
    got = runner.token_logits([SeqChunk(prompt, 0, runner.alloc(40))])
    assert float(np.max(np.abs(got - ref))) > 1e-3  # the long factors are exercised


def test_greedy_past_the_original_context_matches_hf_generate(hf, hf_dir):
    """Two prompts longer than the original context (long factors) and one that stays within it for all 12 steps
    (short factors), staggered in one paged batch: the tokens HF `generate` gives."""
    prompts = [hf_models.random_prompt(n, hf.config.vocab_size, seed=s) for n, s in ((20, 2), (30, 3), (3, 4))]
    steps = 12  # the short prompt ends at 15 positions, within the 16 original ones
    expected = [hf_models.hf_greedy(hf, p, steps) for p in prompts]
    runner = PagedRunner(load_hf_model(hf_dir), page_size=8, num_pages=32)
    assert runner.generate(prompts, steps, num_tokens=32, num_seqs=4) == expected  # one shape: one compilation


def test_engine_matches_hf_for_chunked_long_prompts_crossings_and_cross_kind_prefixes(hf, hf_dir):
    """Through the engine, as HF `generate` computes longrope: a prompt past the original context prefilled in
    16-token chunks rotates all of it by the long factors; a sequence that grows past it while decoding is
    recomputed with them (a preemption, as HF drops its cache there); a prefix cached under one factor set never
    serves the other."""
    from serving.core.llm import LLM
    from serving.core.sampling_params import SamplingParams
    llm = LLM(hf_dir, warmup=False, page_size=8, num_pages=64, max_num_seqs=4, max_num_batched_tokens=16,
              min_token_bucket=16)
    sched = llm.engine.scheduler
    greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731
    vocab = hf.config.vocab_size
    short, long = hf_models.random_prompt(10, vocab, seed=5), hf_models.random_prompt(40, vocab, seed=6)
    shared = short[:8] + hf_models.random_prompt(22, vocab, seed=7)  # long (30), its first block short's
    assert [o.token_ids for o in llm.generate([long], greedy(6))] == [hf_models.hf_greedy(hf, long, 6)]
    assert [o.token_ids for o in llm.generate([short], greedy(3))] == [hf_models.hf_greedy(hf, short, 3)]
    hits = sched.prefix_cache_hits
    assert [o.token_ids for o in llm.generate([shared], greedy(4))] == [hf_models.hf_greedy(hf, shared, 4)]
    assert sched.prefix_cache_hits == hits  # short's first block was rotated by the short factors ...
    again = short[:8] + hf_models.random_prompt(2, vocab, seed=8)
    assert [o.token_ids for o in llm.generate([again], greedy(3))] == [hf_models.hf_greedy(hf, again, 3)]
    assert sched.prefix_cache_hits > hits  # ... and serves a short sequence
    assert sched.num_preemptions == 0
    grows = hf_models.random_prompt(10, vocab, seed=9)
    assert llm.generate([grows], greedy(12))[0].token_ids == hf_models.hf_greedy(hf, grows, 12)  # past 16 at its 7th
    assert sched.num_preemptions == 1  # the recompute at the crossing
    sched.block_manager.check_idle()
