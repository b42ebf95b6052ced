"""The newer families through every scheduler feature at once, as the hybrid KV tests do for Gemma 3: DeepSeek-V3
(the latent cache), GPT-OSS (sinks, sliding layers on the hybrid cache, biased experts) and Phi-3 with longrope
(prompts on both sides of its original context) give HF's greedy tokens with staggered arrivals, 8-token prefill
chunks beside decodes, a prefix-cache hit, an n = 2 request, n-gram speculation and a page pool small enough to
preempt; every book checked after each step, nothing held once idle."""
import pytest
import transformers as tf

from serving.core.config import EngineConfig
from serving.core.engine import Engine
from serving.core.sampling_params import SamplingParams
from tests.serving.core.test_hybrid_kv_cache import _run, greedy
from tests.support import hf_models


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "phi3_longrope"])
def test_hf_tokens_through_chunks_prefix_hits_forks_speculation_and_preemption(family, tmp_path):
    path = str(tmp_path / family)
    hf_models.save_hf_model(family, path)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    base = hf_models.random_prompt(9, 160, seed=9)  # repeats itself: the n-grams propose
    prompts = [base * 3, hf_models.random_prompt(21, 160, seed=2), hf_models.random_prompt(12, 160, seed=3)]
    requests = [(f"r{i}", p, greedy(24)) for i, p in enumerate(prompts)]
    requests.append(("again", prompts[1] + [7, 8], greedy(12)))  # the prefix cache: r1's blocks
    requests.append(("pair", prompts[2][:10], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2)))
    expected = {rid: hf_models.hf_greedy(hf, p, params.max_tokens) for rid, p, params in requests}
    expected["pair#1"] = expected["pair"]
    engine = Engine(EngineConfig(model=path, page_size=4, num_pages=18, max_num_seqs=4, max_num_batched_tokens=16,
                                 max_prefill_chunk=8, speculative_method="ngram", num_speculative_tokens=3,
                                 compilation_cache_dir=""))
    cached = {}
    assert _run(engine, requests, arrivals=[0, 2, 4, 30, 31], cached=cached) == expected
    assert engine.scheduler.num_preemptions > 0, "the pages were to run short"
    assert engine.spec.num_draft_tokens > 0
    assert cached["again"] >= 20, cached  # r1's full blocks
