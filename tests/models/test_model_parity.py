"""Parity with HF transformers (torch CPU, float32) for every supported family: prompt logits and greedy
decoding through the paged KV cache; the rope scalings (yarn past the original context, longrope with a partial
rotary dimension) on the same footing."""
import dataclasses

import numpy as np
import pytest

from serving.core.batch import SeqChunk
from models.weights import load_hf_model
from tests.support import hf_models
from tests.support.paged_runner import PagedRunner

PROMPT_LEN, DECODE_STEPS = 40, 32
# Beyond FAMILIES: Phi-4-mini's longrope and partial rotary dimension; YaRN on Qwen3 and Qwen2 (prompt logits only).
ROPE_SCALED = ("phi4_mini", "qwen3_yarn", "qwen2_yarn")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf"))
    return {f: hf_models.cached_dir(root, f) for f in hf_models.FAMILIES + ROPE_SCALED}


@pytest.mark.parametrize("family", hf_models.FAMILIES + ROPE_SCALED)
def test_prompt_logits_match_hf(family, hf_dirs):
    import transformers as tf
    hf = tf.AutoModelForCausalLM.from_pretrained(hf_dirs[family], attn_implementation="eager").eval()
    prompt = hf_models.random_prompt(PROMPT_LEN, hf.config.vocab_size, seed=1)
    ref = hf_models.hf_logits(hf, prompt)
    runner = PagedRunner(load_hf_model(hf_dirs[family]), page_size=8)
    # The whole prompt as one prefill, and in 5-token chunks through the paged cache beside another sequence's.
    err, err_chunked = runner.prefill_errors(prompt, ref)
    print(f"PARITY {family}: max |logit diff| full prefill {err:.2e}, chunked {err_chunked:.2e}")
    assert err < 1e-4 and err_chunked < 1e-4


@pytest.mark.parametrize("family", hf_models.FAMILIES + ("phi4_mini",))
def test_greedy_decode_matches_hf_generate(family, hf_dirs):
    import transformers as tf
    hf = tf.AutoModelForCausalLM.from_pretrained(hf_dirs[family], attn_implementation="eager").eval()
    prompts = [hf_models.random_prompt(PROMPT_LEN, hf.config.vocab_size, seed=s) for s in (2, 3)]
    prompts.append(hf_models.random_prompt(7, hf.config.vocab_size, seed=4))
    expected = [hf_models.hf_greedy(hf, p, DECODE_STEPS) for p in prompts]
    runner = PagedRunner(load_hf_model(hf_dirs[family]), page_size=8, num_pages=64)
    # Staggered starts and 16-token prefill chunks: steps mix prefill chunks with decode tokens. Every step padded
    # to one shape (at most 16 + 16 + 7 tokens of 3 sequences): one compile per family instead of one per bucket.
    got = runner.generate(prompts, DECODE_STEPS, chunk=16, num_tokens=40, num_seqs=4)
    assert got == expected


def test_mistral_sliding_window_is_exercised(hf_dirs):
    """The parity above covers the window only if it changes the result: without it, logits differ."""
    import dataclasses

    import transformers as tf

    from models.config import ModelConfig
    hf = tf.AutoModelForCausalLM.from_pretrained(hf_dirs["mistral"], attn_implementation="eager").eval()
    prompt = hf_models.random_prompt(PROMPT_LEN, hf.config.vocab_size, seed=1)
    ref = hf_models.hf_logits(hf, prompt)
    cfg = ModelConfig.from_pretrained(hf_dirs["mistral"])
    assert cfg.sliding_windows == (24, 24)
    no_window = dataclasses.replace(cfg, sliding_windows=(None, None))
    runner = PagedRunner(load_hf_model(hf_dirs["mistral"], config=no_window), page_size=8)
    got = runner.token_logits([SeqChunk(prompt, 0, runner.alloc(PROMPT_LEN))])
    assert np.max(np.abs(got[:24] - ref[:24])) < 1e-4  # inside the window nothing changes
    assert np.max(np.abs(got[30:] - ref[30:])) > 1e-3


@pytest.mark.parametrize("family, change", [
    ("qwen3_yarn", dict(rope_type="default")), ("qwen3_yarn", dict(attention_factor=1.0)),
    ("phi4_mini", dict(short_factor=(1.0,) * 6)),
    ("phi4_mini", dict(partial_rotary_factor=1.0, short_factor=(1.0,) * 8, long_factor=(1.0,) * 8))])
def test_rope_scaling_is_exercised(family, change, hf_dirs):
    """The parity above covers each part of the scaling only if it changes the result: plain RoPE, yarn without its
    attention factor, longrope without its short factors or rotating the whole head all differ from HF (yarn's
    prompt goes 24 positions past its 16 original ones)."""
    import transformers as tf

    from models.config import ModelConfig
    hf = tf.AutoModelForCausalLM.from_pretrained(hf_dirs[family], attn_implementation="eager").eval()
    prompt = hf_models.random_prompt(PROMPT_LEN, hf.config.vocab_size, seed=1)
    cfg = ModelConfig.from_pretrained(hf_dirs[family])
    assert family != "qwen3_yarn" or cfg.rope.original_max_position_embeddings == 16
    changed = dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, **change))
    runner = PagedRunner(load_hf_model(hf_dirs[family], config=changed), page_size=8)
    got = runner.token_logits([SeqChunk(prompt, 0, runner.alloc(PROMPT_LEN))])
    assert np.max(np.abs(got - hf_models.hf_logits(hf, prompt))) > 1e-3
