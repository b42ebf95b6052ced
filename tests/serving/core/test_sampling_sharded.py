"""Sampling on vocabulary-sharded logits (tensor parallelism shards the LM head over 'tensor'): per-shard top-K
candidates, logsumexps and block masses are merged instead of gathering [S, V]. Same tokens for the same seeds
and the same logprobs (float tolerance) as the unsharded sampler, and no collective of the compiled program
carries the vocabulary dimension."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from serving.core import sampling
from sharding.mesh import serving_mesh
from serving.core.sampling_params import SamplingParams

NUM_CANDIDATES = 256  # the engine's _num_candidates
PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=20),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=1.3, min_p=0.05),
    SamplingParams(temperature=0.0),  # greedy in a sampling batch
    SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
    SamplingParams(temperature=0.9, top_k=300, top_p=0.95),  # top_k beyond the candidates: exact bisection
    SamplingParams(temperature=5.0, top_p=0.999),  # flat: top-p mass not reached in the candidates
    SamplingParams(temperature=0.0, repetition_penalty=1.5),  # greedy with a penalty
    SamplingParams(temperature=0.8, top_k=5, min_p=0.1, frequency_penalty=0.7),
    SamplingParams(temperature=0.0, logit_bias={3: 9.0, 7: -100.0, 600: 2.0, 997: -100.0}),  # ids on every shard
    SamplingParams(temperature=1.0, top_p=0.9, logit_bias={5: 4.0, 510: 4.0, 990: 6.0}, repetition_penalty=1.2),
    None,  # padding slots
    None,
]
sample_jit = jax.jit(sampling.sample, static_argnames=("max_logprobs",))


def _tensors(vocab, seed, *, greedy=False):
    rng = np.random.default_rng(seed)
    params = [None if p is None else dataclasses.replace(
        p, seed=int(rng.integers(1 << 31)), temperature=0.0 if greedy else p.temperature) for p in PARAMS]
    token_ids = [list(rng.integers(0, vocab, 24)) if p is not None else [] for p in params]
    t = sampling.build_sampling_tensors(params, vocab_size=vocab, token_ids=token_ids,
                                        num_prompt_tokens=[12 if p is not None else 0 for p in params])
    if not t.all_greedy:  # as the engine canonicalises it
        t = dataclasses.replace(t, num_candidates=min(NUM_CANDIDATES, vocab), use_min_p=True)
    return t


def _logits(vocab, seed):
    rng = np.random.default_rng(1000 + seed)
    logits = rng.standard_normal((len(PARAMS), vocab)).astype(np.float32) * 3
    logits[:, 7] = logits[:, vocab - 3] = logits.max(axis=1) + 1  # a tie at the top across shards: lower id wins
    return logits


def _run(logits, t, tp, max_logprobs=5):
    if tp == 1:
        return jax.tree.map(np.asarray, sample_jit(jnp.asarray(logits), t, max_logprobs=max_logprobs))
    mesh = serving_mesh(tp=tp)
    with jax.set_mesh(mesh):
        sharded = jax.device_put(logits, NamedSharding(mesh, P(None, "tensor") if logits.shape[1] % tp == 0 else P()))
        return jax.tree.map(np.asarray, sample_jit(sharded, t, max_logprobs=max_logprobs))


# 1024: shards of 512 and 256 tokens (whole blocks of the inverse CDF: bit-identical draws); 1000: 500 and 250.
@pytest.mark.parametrize("vocab", [1024, 1000])
@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_sampling_matches_unsharded(vocab, tp):
    for seed in range(4):
        logits = _logits(vocab, seed)
        for greedy in (False, True):
            t = _tensors(vocab, seed, greedy=greedy)
            ref, out = _run(logits, t, 1), _run(logits, t, tp)
            np.testing.assert_array_equal(out.token_ids, ref.token_ids)
            np.testing.assert_array_equal(out.top_logprob_ids, ref.top_logprob_ids)
            np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
            np.testing.assert_allclose(out.top_logprobs, ref.top_logprobs, atol=1e-5)
    assert ref.top_logprob_ids[4, 0] == 7  # the tie went to the lower id


def _collectives(hlo: str) -> list[str]:
    return [line.strip() for line in hlo.splitlines()
            if re.search(r"= \S+ (all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)(-start)?\(",
                         line)]


def _vocab_sized(lines: list[str], vocab: int) -> list[str]:
    """Collectives whose result shape has the vocabulary as a dimension."""
    return [line for line in lines if re.search(rf"\[[\d,]*\b{vocab}\b[\d,]*\]", line.split("=", 1)[1].split("(")[0])]


@pytest.mark.parametrize("tp", [2, 4])
def test_compiled_sampler_exchanges_no_vocab_sized_arrays(tp):
    vocab = 4096  # > tp * NUM_CANDIDATES: the candidates exchanged are fewer than the vocabulary
    t = _tensors(vocab, 0)
    mesh = serving_mesh(tp=tp)
    with jax.set_mesh(mesh):
        logits = jax.device_put(_logits(vocab, 0), NamedSharding(mesh, P(None, "tensor")))
        hlo = sample_jit.lower(logits, t, max_logprobs=5).compile().as_text()
        collectives = _collectives(hlo)
        assert any("all-gather" in line for line in collectives)  # the candidates and partials are exchanged
        assert not _vocab_sized(collectives, vocab), _vocab_sized(collectives, vocab)
        # The check can fail: the same sampler without the per-shard merge gathers the logits.
        unsharded = jax.jit(lambda x, t: sampling._sample(x, t, 5, sampling._LOCAL_ROWS))
        assert _vocab_sized(_collectives(unsharded.lower(logits, t).compile().as_text()), vocab)


def test_uneven_vocabulary_keeps_the_unsharded_path():
    vocab = 1026  # not divisible by 4
    t = _tensors(vocab, 1)
    mesh = serving_mesh(tp=4)
    with jax.set_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(lambda x: sampling.sample(x, t, max_logprobs=2))(jnp.zeros((len(PARAMS), vocab))))
    assert "shard_map" not in jaxpr
    logits = _logits(vocab, 1)
    np.testing.assert_array_equal(_run(logits, t, 4, 2).token_ids, _run(logits, t, 1, 2).token_ids)
