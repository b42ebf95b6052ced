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
