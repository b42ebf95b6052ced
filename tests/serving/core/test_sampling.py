"""Sampler tests: greedy, the distributions of temperature / min-p / top-k / top-p (against a NumPy reference),
penalties (against transformers and the OpenAI formulas), the logit bias (against transformers' sequence bias),
per-request seeds, padding slots and logprobs."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from serving.core.sampling import (SamplingTensors, _filter_threshold, apply_logit_bias, apply_penalties,
                                   build_sampling_tensors, sample)
from serving.core.sampling_params import SamplingParams

sample_jit = jax.jit(sample, static_argnames=("max_logprobs",))
threshold_jit = jax.jit(lambda x, t: _filter_threshold(x, t))


def build(params, *, vocab, token_ids=None, num_prompt_tokens=None, **kwargs) -> SamplingTensors:
    token_ids = [[] for _ in params] if token_ids is None else token_ids
    num_prompt_tokens = [len(ids) for ids in token_ids] if num_prompt_tokens is None else num_prompt_tokens
    return build_sampling_tensors(params, vocab_size=vocab, token_ids=token_ids,
                                  num_prompt_tokens=num_prompt_tokens, **kwargs)


def run(logits, params, *, max_logprobs=0, **kwargs):
    logits = np.asarray(logits, np.float32)
    t = build(params, vocab=logits.shape[1], **kwargs)
    return jax.tree.map(np.asarray, sample_jit(jnp.asarray(logits), t, max_logprobs=max_logprobs))


def reference_keep(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """NumPy reference of the filters, in vLLM v1's order: min-p, top-k, top-p on the renormalised survivors.
    Top sets: a token tied with the last kept one is kept."""
    x = logits.astype(np.float64) / p.temperature
    keep = np.ones(x.shape, bool)
    if p.min_p > 0:
        probs = np.exp(x - x.max())
        keep &= probs >= p.min_p * probs.max()
    if p.top_k > 0:
        keep &= x >= np.sort(x[keep])[::-1][min(p.top_k, keep.sum()) - 1]
    if p.top_p < 1:
        probs = np.where(keep, np.exp(x - x.max()), 0)
        probs /= probs.sum()
        order = np.argsort(-x, kind="stable")
        cumulative = np.cumsum(probs[order])
        keep &= x >= x[order[np.searchsorted(cumulative, p.top_p - 1e-12)]]
    return keep


def reference_probs(logits, p):
    x = logits.astype(np.float64) / p.temperature
    probs = np.where(reference_keep(logits, p), np.exp(x - x.max()), 0)
    return probs / probs.sum()


def assert_distribution(tokens, expected, *, slack=6.0):
    """Chi-square statistic of the empirical counts within mean + slack standard deviations (fixed seeds, so
    deterministic; slack 6 keeps a correct sampler far from the bound)."""
    counts = np.bincount(tokens, minlength=expected.size)
    assert counts[expected == 0].sum() == 0, f"tokens outside the allowed set: {np.nonzero(counts * (expected == 0))}"
    support = expected > 0
    n = len(tokens)
    chi2 = np.sum((counts[support] - n * expected[support]) ** 2 / (n * expected[support]))
    dof = support.sum() - 1
    assert chi2 < dof + slack * np.sqrt(2 * max(dof, 1)), (chi2, dof, counts / n, expected)


NUM_DRAWS = 8192  # one batch of NUM_DRAWS slots, same logits, seeds 0..NUM_DRAWS-1
LOGITS_16 = np.log(np.array([20, 14, 11, 9, 8, 7, 6, 5, 4, 4, 3, 3, 2, 2, 1, 1], np.float64) / 100)[
    np.random.default_rng(0).permutation(16)].astype(np.float32)


def draw_many(logits, params: SamplingParams):
    params = [SamplingParams(**{**_fields(params), "seed": i}) for i in range(NUM_DRAWS)]
    return run(np.tile(logits, (NUM_DRAWS, 1)), params).token_ids


def _fields(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                                       "presence_penalty", "frequency_penalty", "seed")}


def test_greedy_is_argmax_of_logits_in_a_mixed_batch():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((6, 1000)).astype(np.float32)
    logits[2, [10, 20]] = 50.0  # a tie: the first index wins, as jnp.argmax / np.argmax
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=1),
              SamplingParams(temperature=0.0, top_p=0.5, top_k=3), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=0.7, top_p=0.8, seed=2), SamplingParams(temperature=0.0, min_p=0.3)]
    out = run(logits, params)
    for i in (0, 2, 3, 5):
        assert out.token_ids[i] == np.argmax(logits[i])
    all_greedy = run(logits, [SamplingParams(temperature=0.0)] * 6)
    np.testing.assert_array_equal(all_greedy.token_ids, np.argmax(logits, axis=1))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=2.0),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.32),  # keeps 20..7 (0.3 would sit on the 6 boundary)
    SamplingParams(temperature=0.8, top_k=8, top_p=0.7, min_p=0.1),
], ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-minp{p.min_p}")
def test_distribution_matches_renormalised_softmax(params):
    expected = reference_probs(LOGITS_16, params)
    assert_distribution(draw_many(LOGITS_16, params), expected)


def test_ties_at_the_top_k_and_top_p_boundary_are_all_kept():
    logits = np.array([3.0, 1.0, 3.0, 0.0, 3.0, 1.0, -2.0, 0.0], np.float32)
    expected = np.array([1, 0, 1, 0, 1, 0, 0, 0], np.float64) / 3  # top_k=2 keeps all three tied 3.0s
    assert_distribution(draw_many(logits, SamplingParams(temperature=1.0, top_k=2)), expected)
    assert_distribution(draw_many(logits, SamplingParams(temperature=1.0, top_p=0.5)), expected)


def test_filters_beyond_the_candidates_use_the_exact_fallback():
    rng = np.random.default_rng(2)
    vocab = 4096
    flat = (rng.standard_normal((4, vocab)) * 0.05).astype(np.float32)  # top-p mass spread over ~all tokens
    flat[0, :40] = 0.5  # ties at the top
    params = [SamplingParams(temperature=1.0, top_k=900, seed=1), SamplingParams(temperature=1.0, top_p=0.9, seed=2),
              SamplingParams(temperature=0.7, top_k=700, top_p=0.5, seed=3),
              SamplingParams(temperature=1.0, top_p=0.95, min_p=0.9, seed=4)]
    t = build(params, vocab=vocab, max_candidates=64)
    assert t.num_candidates == 256  # top-p's candidates: 256 < 900, 700 and the top-p mass, so every row bisects
    threshold = np.asarray(threshold_jit(jnp.asarray(flat / t.temperature[:, None]), t))
    for i, p in enumerate(params):
        kept = flat[i] / p.temperature >= threshold[i]
        np.testing.assert_array_equal(kept, reference_keep(flat[i], p), err_msg=f"row {i}")
        assert kept.sum() > 256
    tokens = run(flat, params, max_candidates=64).token_ids
    for i, p in enumerate(params):
        assert reference_keep(flat[i], p)[tokens[i]]


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_keep_set_matches_reference(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    logits = np.round(rng.standard_normal((8, 96)) * 2, 1).astype(np.float32)  # rounded: many ties
    params = [SamplingParams(
        temperature=data.draw(st.sampled_from([0.3, 1.0, 1.5])), top_k=data.draw(st.sampled_from([-1, 2, 5, 40, 200])),
        top_p=data.draw(st.sampled_from([1.0, 0.95, 0.5, 0.1])), min_p=data.draw(st.sampled_from([0.0, 0.05, 0.5])),
        seed=i) for i in range(8)]
    t = build(params, vocab=96)
    threshold = np.asarray(threshold_jit(jnp.asarray(logits / t.temperature[:, None]), t))
    tokens = run(logits, params).token_ids
    for i, p in enumerate(params):
        reference = reference_keep(logits[i], p)
        np.testing.assert_array_equal(logits[i] / np.float32(p.temperature) >= threshold[i], reference)
        assert reference[tokens[i]]


def penalised_reference(logits, token_ids, num_prompt, p: SamplingParams):
    """transformers' RepetitionPenaltyLogitsProcessor over prompt + output, then OpenAI's
    logit - frequency * count - presence * (count > 0) over output tokens."""
    scores = torch.tensor(logits[None])
    if token_ids:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([token_ids]), scores)
    out = scores[0].numpy().astype(np.float64)
    counts = np.bincount(np.asarray(token_ids[num_prompt:], np.int64), minlength=logits.size)
    return out - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def test_penalties_match_transformers_and_openai():
    rng = np.random.default_rng(3)
    vocab = 64
    logits = rng.standard_normal((5, vocab)).astype(np.float32) * 3
    token_ids = [list(rng.integers(0, vocab, n)) for n in (30, 12, 50, 7, 0)]
    num_prompt = [20, 12, 5, 0, 0]
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
              SamplingParams(temperature=0.0, repetition_penalty=0.7),
              SamplingParams(temperature=0.0, presence_penalty=-1.0, frequency_penalty=1.5),
              SamplingParams(temperature=0.0),  # no penalties in a batch that has them
              SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=2.0)]
    t = build(params, vocab=vocab, token_ids=token_ids, num_prompt_tokens=num_prompt)
    assert t.token_ids.shape == (5, 64)  # window bucketed to a power of two >= 50
    penalised = np.asarray(jax.jit(apply_penalties)(jnp.asarray(logits), t))
    for i, p in enumerate(params):
        expected = penalised_reference(logits[i], [int(x) for x in token_ids[i]], num_prompt[i], p)
        np.testing.assert_allclose(penalised[i], expected, rtol=1e-6, atol=1e-5, err_msg=f"row {i}")
    out = run(logits, params, token_ids=token_ids, num_prompt_tokens=num_prompt, max_logprobs=3)
    np.testing.assert_array_equal(out.token_ids, np.argmax(penalised, axis=1))
    # logprobs stay those of the raw model distribution
    raw = jax.nn.log_softmax(logits, axis=1)
    np.testing.assert_allclose(out.logprobs, np.take_along_axis(raw, out.token_ids[:, None], 1)[:, 0], atol=1e-5)


def test_logit_bias_sparse_rows_then_penalties_match_transformers():
    """The bias is a scatter-add of [S, K] ids and values, applied before the penalties as transformers' sequence
    bias is (then its repetition penalty); greedy slots take the biased argmax, padding slots stay untouched."""
    rng = np.random.default_rng(11)
    vocab = 300
    logits = rng.standard_normal((5, vocab)).astype(np.float32) * 3
    top = np.argmax(logits, axis=1)
    biases = [{7: 100.0}, {int(top[1]): -100.0, 9: 2.5}, None, {t: -0.75 for t in range(0, vocab, 2)},
              {int(top[4]): -100.0}]
    params = [SamplingParams(temperature=0.0, logit_bias=biases[0]),
              SamplingParams(temperature=0.0, logit_bias=biases[1], repetition_penalty=1.7),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logit_bias=biases[3]),
              SamplingParams(temperature=0.0, logit_bias=biases[4], repetition_penalty=1.3, presence_penalty=0.5)]
    token_ids = [[1, 2, 3], [9, 4, int(top[1])], [5], [6, 8], [10, 11, 12]]
    t = build(params, vocab=vocab, token_ids=token_ids, num_prompt_tokens=[2, 2, 1, 1, 3], num_slots=8)
    assert t.bias_ids.shape == t.bias_values.shape == (8, 256)  # the widest bias (150 entries), to a power of 2
    assert t.bias_ids[2].tolist() == [-1] * 256 and t.bias_values[5:].tolist() == [[0.0] * 256] * 3
    biased = np.asarray(jax.jit(apply_logit_bias)(jnp.asarray(np.pad(logits, ((0, 3), (0, 0)))), t))
    for i, bias in enumerate(biases):
        expected = logits[i].copy()
        for token, b in (bias or {}).items():
            expected[token] += b
        np.testing.assert_allclose(biased[i], expected, rtol=0, atol=1e-6, err_msg=f"row {i}")
    out = run(logits, params, token_ids=token_ids, num_prompt_tokens=[2, 2, 1, 1, 3], max_logprobs=2)
    for i, (p, bias) in enumerate(zip(params, biases)):
        ids, scores = torch.tensor([token_ids[i]]), torch.tensor(logits[i:i + 1])
        if bias:
            scores = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(ids, scores)
        if p.repetition_penalty != 1.0:
            scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
        expected = scores[0].numpy() - p.presence_penalty * np.isin(np.arange(vocab), token_ids[i][3:])
        assert out.token_ids[i] == int(np.argmax(expected)), f"row {i}"
    assert out.token_ids[0] == 7 and out.token_ids[1] != top[1] and out.token_ids[4] != top[4]
    # logprobs stay the raw model's
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=1))
    np.testing.assert_allclose(out.logprobs, raw[np.arange(5), out.token_ids], atol=1e-5)


def test_logit_bias_forces_and_bans_sampled_tokens():
    logits = np.tile(LOGITS_16, (NUM_DRAWS // 8, 1))
    n = len(logits)
    forced = run(logits, [SamplingParams(temperature=1.0, top_p=0.9, seed=i, logit_bias={3: 100.0})
                          for i in range(n)]).token_ids
    assert set(forced.tolist()) == {3}
    banned = np.argsort(-LOGITS_16)[:2].tolist()  # the two most likely: e^-100 leaves them no chance
    drawn = run(logits, [SamplingParams(temperature=1.0, seed=i, logit_bias={t: -100.0 for t in banned})
                         for i in range(n)]).token_ids
    expected = np.exp(LOGITS_16.astype(np.float64))
    expected[banned] = 0.0
    assert_distribution(drawn, expected / expected.sum())


def test_no_penalties_means_no_token_window():
    t = build([SamplingParams(temperature=0.5, seed=1)], vocab=10, token_ids=[[1, 2, 3]], num_prompt_tokens=[2])
    assert t.token_ids is None and t.num_prompt_tokens is None and not t.use_penalties
    assert t.step.tolist() == [1]


def _slot_of(request_logits, request_params, request_tokens, *, slot, num_slots, mates, vocab):
    """Place one request in `slot` of a batch of `num_slots` among `mates` (params, logits) and padding."""
    rng = np.random.default_rng(slot * 100 + num_slots)
    params, logits, token_ids = [], [], []
    for i in range(num_slots):
        if i == slot:
            params.append(request_params), logits.append(request_logits), token_ids.append(request_tokens)
        elif mates:
            params.append(mates.pop()), logits.append(rng.standard_normal(vocab) * 4)
            token_ids.append(list(rng.integers(0, vocab, 9)))
        else:
            params.append(None), logits.append(np.zeros(vocab)), token_ids.append([])
    num_prompt = [min(len(ids), 5) for ids in token_ids]
    return run(np.stack(logits), params, token_ids=token_ids, num_prompt_tokens=num_prompt).token_ids[slot]


@pytest.mark.parametrize("request_params", [
    SamplingParams(temperature=0.9, top_p=0.9, seed=1234),
    SamplingParams(temperature=1.2, top_k=20, min_p=0.01, repetition_penalty=1.1, seed=-7),
], ids=["top_p", "top_k_penalties"])
def test_same_seed_same_tokens_whatever_the_slot_mates_and_bucket(request_params):
    vocab = 2000
    rng = np.random.default_rng(4)
    steps = []
    for step in range(4):
        logits = rng.standard_normal(vocab).astype(np.float32) * 2
        tokens = list(rng.integers(0, vocab, 5 + step))  # 5 prompt tokens, `step` outputs
        results = {
            _slot_of(logits, request_params, tokens, slot=0, num_slots=1, mates=[], vocab=vocab),
            _slot_of(logits, request_params, tokens, slot=3, num_slots=4, vocab=vocab,
                     mates=[SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=600, seed=9),
                            SamplingParams(temperature=1.0, frequency_penalty=1.0, seed=3)]),
            _slot_of(logits, request_params, tokens, slot=5, num_slots=16, vocab=vocab,
                     mates=[SamplingParams(temperature=1.0, seed=5),
                            SamplingParams(temperature=1.0, min_p=0.2, seed=6)]),
        }
        assert len(results) == 1, (step, results)
        steps.append(results.pop())
    assert len(set(steps)) > 1  # the step is folded into the key


def test_different_seeds_give_different_tokens():
    logits = np.zeros((64, 1000), np.float32)
    tokens = run(logits, [SamplingParams(temperature=1.0, seed=s) for s in range(64)]).token_ids
    assert len(set(tokens.tolist())) > 55
    again = run(logits, [SamplingParams(temperature=1.0, seed=s) for s in range(64)]).token_ids
    np.testing.assert_array_equal(tokens, again)


def test_padding_slots_give_zeros_and_no_nan():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((8, 300)).astype(np.float32)
    logits[3] = np.nan  # padding slots may hold anything
    logits[4] = -np.inf
    logits[5:] = 0.0
    params = [SamplingParams(temperature=1.0, top_p=0.5, seed=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, top_k=5, min_p=0.1, repetition_penalty=1.5, seed=2)]
    token_ids = [[1, 2], [3], [4, 5, 6]]
    out = run(logits, params, num_slots=8, token_ids=token_ids, num_prompt_tokens=[1, 1, 1], max_logprobs=4)
    for field in (out.token_ids, out.logprobs, out.top_logprob_ids, out.top_logprobs):
        assert np.all(np.isfinite(field))
        assert np.all(field[3:] == 0)
    assert 0 <= out.token_ids[:3].min() and out.token_ids[:3].max() < 300
    alone = run(logits[:3], params, token_ids=token_ids, num_prompt_tokens=[1, 1, 1])
    np.testing.assert_array_equal(out.token_ids[:3], alone.token_ids)


def test_logprobs_are_raw_log_softmax_and_top_n_sorted():
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((4, 500)).astype(np.float32) * 3
    params = [SamplingParams(temperature=0.3, top_k=3, seed=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.5, top_p=0.2, seed=2), SamplingParams(temperature=1.0, seed=3)]
    out = run(logits, params, max_logprobs=20)
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=1))
    np.testing.assert_allclose(out.logprobs, raw[np.arange(4), out.token_ids], atol=1e-5)
    assert out.top_logprobs.shape == (4, 20) and out.top_logprob_ids.dtype == np.int32
    assert np.all(np.diff(out.top_logprobs, axis=1) <= 0)
    np.testing.assert_array_equal(out.top_logprob_ids, np.argsort(-logits, axis=1, kind="stable")[:, :20])
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(raw, out.top_logprob_ids, 1), atol=1e-5)
    assert run(logits, params).top_logprobs.shape == (4, 0)


def test_builder_flags_seeds_and_errors():
    vocab = 1000
    p = functools.partial(SamplingParams, temperature=1.0)
    t = build([p(seed=2 ** 40 + 5), p(seed=-1, top_k=5000), p(temperature=0.0), None, p(seed=3, top_k=1)],
              vocab=vocab, num_slots=8, token_ids=[[1] * 7, [], [], [], [2]], num_prompt_tokens=[3, 0, 0, 0, 0])
    assert t.seed[0].tolist() == [2 ** 8, 5] and t.seed[1].tolist() == [2 ** 32 - 1, 2 ** 32 - 1]
    small = build([p(seed=123)], vocab=vocab)
    np.testing.assert_array_equal(small.seed[0], jax.random.key_data(jax.random.key(123)))
    assert t.step.tolist() == [4, 0, 0, 0, 1, 0, 0, 0]
    assert t.valid.tolist() == [True, True, True, False, True, False, False, False]
    assert t.top_k.tolist() == [0] * 8  # top_k >= vocab is off; top_k == 1 is greedy
    assert t.temperature.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert (t.num_candidates, t.all_greedy, t.use_min_p) == (0, False, False)
    assert build([p(seed=1, top_k=70), p(seed=1, min_p=0.1)], vocab=vocab).num_candidates == 128
    assert build([p(seed=1, top_p=0.9)], vocab=vocab).num_candidates == 256
    assert build([p(seed=1, top_p=0.9)], vocab=100).num_candidates == 100
    assert build([p(seed=1, min_p=0.1)], vocab=vocab).use_min_p
    assert build([SamplingParams(temperature=0.0, top_p=0.5), None], vocab=vocab, num_slots=4).all_greedy
    with pytest.raises(ValueError, match="slot 0 samples .* no seed"):
        build([p()], vocab=vocab)
    assert build([p()], vocab=vocab, seeds=[7]).seed[0].tolist() == [0, 7]
    with pytest.raises(ValueError, match="num_slots"):
        build([p(seed=1)] * 3, vocab=vocab, num_slots=2)
