"""Structured outputs end to end on the shipped tiny model (barely trained: it never writes valid JSON by itself):
every sampled output at temperature 1.0 parses and validates under five JSON schemas, a regex and a Lark grammar;
unconstrained neighbours in a greedy batch are untouched; n > 1, preemption, aborts, chunked prefill, the prefix
cache and speculative decoding compose; a bad grammar is refused before anything is queued. The mask itself
(`sampling.apply_token_bitmask`) against the host's unpacking."""
from __future__ import annotations

import gc
import json
import os
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from serving.core import sampling
from serving.core.llm import LLM
from serving.core.request import FinishReason
from serving.core.sampling_params import SamplingParams, StructuredOutput
from serving.bench.structured import LARK, REGEX, SCHEMAS
from serving.core.structured import unpack_bitmask

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "..", "models", "tiny", "target")
PROMPT = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n"
# Samples per grammar. The mask itself is checked bit by bit against the host (the last test); these catch the
# grammar state drifting from the tokens, which would spoil most samples, and walk each grammar's branches: one that a
# sample takes with probability 3% is walked with probability 95% (1 - 0.97 ** 100). Each sample costs ~37 tokens of
# decode (~60 ms of CPU on the 2-core Zen 1 box, steps of 64 sequences), so 200 cost twice the seconds for 1.5%.
SAMPLES = 100

LARK_LANGUAGE = re.compile(r"SELECT (\*|[a-z]{1,8}(, [a-z]{1,8}){0,2}) FROM [a-z]{1,8}"
                           r"( WHERE [a-z]{1,8} = [0-9]{1,4})?")


@pytest.fixture(scope="module")
def llm():
    """Token buckets 16..256 (the float32 default starts at 1: nine buckets, each compiled on first use)."""
    return LLM(TINY, warmup=False, max_num_seqs=64, max_num_batched_tokens=256, min_token_bucket=16)


def _texts(llm, spec: StructuredOutput, samples: int = SAMPLES, max_tokens: int = 256) -> list:
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, structured=spec)  # seeds drawn per request
    outs = [c for o in llm.generate([PROMPT] * samples, params) for c in o.outputs]
    assert len(outs) == samples
    return outs


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_sample_validates_against_its_json_schema(llm, name):
    schema = SCHEMAS[name]
    outs = _texts(llm, StructuredOutput(json_schema=json.dumps(schema)))
    bad = []
    for c in outs:
        try:
            jsonschema.validate(json.loads(c.text), schema)
            assert c.finish_reason is FinishReason.STOP
        except (ValueError, jsonschema.ValidationError, AssertionError) as e:
            bad.append((c.text, c.finish_reason, str(e)[:80]))
    assert not bad, (len(bad), bad[:3])
    assert len({c.text for c in outs}) >= 10  # sampled, not one forced string


def test_every_sample_matches_a_regex_and_a_lark_grammar(llm):
    for spec, language in ((StructuredOutput(regex=REGEX), re.compile(REGEX)),
                           (StructuredOutput(grammar=LARK), LARK_LANGUAGE)):
        outs = _texts(llm, spec)
        bad = [c.text for c in outs if not language.fullmatch(c.text) or c.finish_reason is not FinishReason.STOP]
        assert not bad, (spec.kind, len(bad), bad[:3])
    outs = _texts(llm, StructuredOutput(choice=("yes", "no", "not sure")), samples=40)
    assert {c.text for c in outs} <= {"yes", "no", "not sure"} and len({c.text for c in outs}) > 1
    # Any JSON object: unbounded strings may run to max_tokens (finish_reason length); every one that ended did so
    # on a whole object.
    ended = [c for c in _texts(llm, StructuredOutput(json_object=True), samples=20)
             if c.finish_reason is FinishReason.STOP]
    assert len(ended) >= 5 and all(isinstance(json.loads(c.text), dict) for c in ended)


def test_unconstrained_neighbours_in_a_greedy_batch_are_untouched(llm):
    prompts = [f"<|im_start|>user\nTell me about item {i}.<|im_end|>\n<|im_start|>assistant\n" for i in range(8)]
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free)]
    constrained = SamplingParams(temperature=0.0, max_tokens=64,
                                 structured=StructuredOutput(json_schema=json.dumps(SCHEMAS["enums"])))
    mixed = llm.generate([p for pair in zip(prompts, prompts) for p in pair],
                         [sp for _ in prompts for sp in (free, constrained)])
    assert [o.outputs[0].token_ids for o in mixed[0::2]] == alone
    for o in mixed[1::2]:  # greedy under the grammar: the masked argmax, never the free one
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS["enums"])


def test_n_samples_preemption_and_aborts_leave_no_pages_or_grammar_state():
    # Few pages: constrained samples are preempted and recomputed mid-grammar (the grammar follows the tokens);
    # a small prefill chunk and a shared prefix exercise chunked prefill and the prefix cache.
    llm = LLM(TINY, warmup=False, max_num_seqs=16, max_num_batched_tokens=64, min_token_bucket=16,
              max_prefill_chunk=32, page_size=8, num_pages=40, enable_prefix_caching=True)
    eng = llm.engine
    schema = SCHEMAS["arrays"]
    long_prompt = PROMPT + "Some context. " * 20
    params = SamplingParams(temperature=1.0, max_tokens=96, n=3,
                            structured=StructuredOutput(json_schema=json.dumps(schema)))
    requests = [eng.make_request(f"r{i}", long_prompt, params) for i in range(6)]
    for r in requests:
        eng.add_request(r)
    aborted = set()
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if steps == 12:  # abort two requests mid-grammar
            for rid in ("r1", "r4"):
                eng.abort(rid)
                aborted.add(rid)
    assert sum(s.metrics.num_preemptions for r in requests for s in r.samples) > 0
    for r in requests:
        for s in r.samples:
            if r.request_id in aborted:
                assert s.finish_reason is FinishReason.ABORT
                continue
            text = eng.tokenizer.decode(s.output_token_ids, skip_special_tokens=True)
            jsonschema.validate(json.loads(text), schema)
    bm = eng.scheduler.block_manager
    assert not eng.scheduler.requests
    del requests, r, s
    gc.collect()
    assert eng.structured.num_live == 0
    bm.reset_prefix_cache()
    assert bm.num_free_pages == bm.num_pages


def test_speculative_decoding_leaves_constrained_requests_to_the_plain_step():
    llm = LLM(TINY, warmup=False, max_num_seqs=8, max_num_batched_tokens=128, min_token_bucket=16,
              speculative_method="ngram", num_speculative_tokens=3)
    schema = SCHEMAS["bounds"]
    outs = llm.generate([PROMPT] * 6 + ["one two three one two three one two"] * 2,
                        [SamplingParams(temperature=1.0, max_tokens=96,
                                        structured=StructuredOutput(json_schema=json.dumps(schema)))] * 6
                        + [SamplingParams(temperature=0.0, max_tokens=16)] * 2)
    for o in outs[:6]:
        jsonschema.validate(json.loads(o.outputs[0].text), schema)


def test_a_bad_grammar_is_refused_before_anything_is_queued(llm):
    eng = llm.engine
    cases = [(StructuredOutput(json_schema='{"type": "objekt"}'), "structured.json_schema"),
             (StructuredOutput(json_schema="{not json"), "structured.json_schema: not valid JSON"),
             (StructuredOutput(regex="a(("), "structured.regex"),
             (StructuredOutput(grammar="start: undefined_rule"), "structured.grammar"),
             (StructuredOutput(json_object=True, after_reasoning=True), "structured.after_reasoning")]
    for spec, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            eng.make_request("bad", PROMPT, SamplingParams(structured=spec))
    assert not eng.scheduler.requests
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(regex="a", json_object=True)
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured=StructuredOutput(json_object=True))
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured=StructuredOutput(json_object=True))
    before = (eng.structured.compiles, eng.structured.cache_hits)
    for _ in range(3):
        eng.make_request("x", PROMPT, SamplingParams(structured=StructuredOutput(regex="[0-9]+")))
    assert eng.structured.compiles - before[0] <= 1 and eng.structured.cache_hits - before[1] >= 2


def test_constrained_steps_reuse_the_warmed_up_programs():
    # Token buckets 4..16 over two sequence buckets, 4 (with the screened greedy forward) and 16 (token buckets 8
    # and 16): 24 programs to warm up instead of the 40 of buckets 1..64.
    llm = LLM(TINY, max_num_seqs=16, max_num_batched_tokens=16, min_token_bucket=4)
    runner = llm.engine.runner
    programs = (runner._forward_fn._cache_size(), runner._sample_fn._cache_size())
    masked = [SamplingParams(temperature=0.0, max_tokens=5, structured=StructuredOutput(regex="[a-z ]+")),
              SamplingParams(temperature=0.9, max_tokens=5, structured=StructuredOutput(json_object=True)),
              SamplingParams(temperature=0.0, repetition_penalty=1.2, max_tokens=5,
                             structured=StructuredOutput(choice=("a b", "c")))]
    llm.generate([PROMPT] * 3, masked)  # the masked variant, then masked with penalties (the general one)
    llm.generate([PROMPT] * 2, [masked[0], SamplingParams(temperature=0.0, logit_bias={5: 2.0}, max_tokens=5)])
    llm.generate([PROMPT] * 20, masked[1])  # a larger sequence bucket (16 slots; the decodes above: 4)
    assert (runner._forward_fn._cache_size(), runner._sample_fn._cache_size()) == programs


@pytest.mark.parametrize("vocab,offset", [(64, 0), (70, 0), (40, 32), (24, 8)])
def test_apply_token_bitmask_matches_the_host_unpacking(vocab, offset):
    rng = np.random.default_rng(vocab + offset)
    full = offset + vocab + 40
    mask = rng.integers(-2 ** 31, 2 ** 31, size=(3, -(-full // 32)), dtype=np.int64).astype(np.int32)
    allowed = unpack_bitmask(mask, full)[:, offset:offset + vocab]
    logits = rng.standard_normal((3, vocab)).astype(np.float32)
    st = sampling.build_sampling_tensors([SamplingParams(temperature=0.0)] * 3, vocab_size=full,
                                         token_ids=[[1]] * 3, num_prompt_tokens=[1] * 3)
    st.token_bitmask = mask
    # A static offset takes the word-aligned path when it can; a traced one (a vocabulary shard) the gather.
    for off in (offset, jnp.int32(offset)):
        out = np.asarray(sampling.apply_token_bitmask(jnp.asarray(logits), st, off))
        np.testing.assert_array_equal(out, np.where(allowed, logits, -np.inf))
