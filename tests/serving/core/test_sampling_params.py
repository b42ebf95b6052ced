"""SamplingParams: defaults, normalisation, and every invalid value rejected with its field named."""
import dataclasses
import math

import pytest

from serving.core import MAX_LOGPROBS, Request, SamplingParams
from serving.core.request import sample_seed
from serving.core.sampling_params import MAX_LOGIT_BIAS, MAX_N, stop_token_set


def test_defaults_are_valid_and_vllm_like():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p) == (16, 1.0, -1, 1.0, 0.0)
    assert p.stop == () and p.stop_token_ids == () and p.logprobs is None and not p.ignore_eos
    assert not p.is_greedy and not p.has_penalties and p.n == 1 and p.logit_bias is None


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[2, 3], top_k=0, temperature=0)
    assert p.stop == ("###",) and p.stop_token_ids == (2, 3) and p.top_k == -1 and p.is_greedy
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(top_k=1).is_greedy
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(logit_bias={}).logit_bias is None
    bias = {3: 1.5}
    assert SamplingParams(logit_bias=bias).logit_bias == bias and SamplingParams(logit_bias=bias).logit_bias is not bias


def test_valid_edges():
    SamplingParams(temperature=0.0, top_p=1.0, min_p=1.0, top_k=1, max_tokens=1, seed=0, logprobs=MAX_LOGPROBS,
                   presence_penalty=-2, frequency_penalty=2, repetition_penalty=1e-3, min_tokens=1)
    SamplingParams(seed=2 ** 64 - 1, logprobs=0, top_p=1e-9)
    SamplingParams(n=MAX_N, temperature=0.0)  # allowed: greedy samples are then identical
    SamplingParams(logit_bias={i: (-100 if i % 2 else 100) for i in range(MAX_LOGIT_BIAS)})


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -1.0),
    ("top_k", -2), ("top_k", 1.5), ("top_k", True),
    ("min_p", -0.01), ("min_p", 1.5),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01),
    ("frequency_penalty", 3.0), ("frequency_penalty", math.nan),
    ("seed", 1.5), ("seed", 2 ** 64), ("seed", -(2 ** 63) - 1),
    ("stop", [""]), ("stop", [3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", 2.0),
    ("ignore_eos", 1), ("include_stop_str_in_output", "yes"),
    ("n", 0), ("n", MAX_N + 1), ("n", 2.0), ("n", None),
    ("logit_bias", {5: 100.5}), ("logit_bias", {5: -101}), ("logit_bias", {5: math.nan}), ("logit_bias", {5: "x"}),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0}), ("logit_bias", [(5, 1.0)]),
    ("logit_bias", {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_params_cannot_change_once_checked():
    """Checked once, when made: a value set later would skip the check, so none can be."""
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = -1.0
    assert p.temperature == 1.0


def test_samples_of_an_n_request_have_their_own_seeds():
    r = Request("q", [1, 2, 3], SamplingParams(n=4, seed=99, logit_bias={7: 2.0}), arrival_time=1.0, priority=1,
                deadline=9.0, eos_token_ids=(2,))
    seeds = [s.sampling_params.seed for s in r.samples]
    assert seeds[0] == 99 and len(set(seeds)) == 4 and all(0 <= x < 2 ** 64 for x in seeds)
    assert seeds == [sample_seed(99, i) for i in range(4)]  # the same every run
    for s in r.samples[1:]:
        assert s.sampling_params.n == 1 and s.sampling_params.logit_bias == {7: 2.0} and s.group is r.group
        assert (s.prompt_token_ids, s.priority, s.deadline, s.arrival_time) == ([1, 2, 3], 1, 9.0, 1.0)
    assert sample_seed(-5, 1) != sample_seed(-5, 2) and sample_seed(None, 3) is None
    assert Request("one", [1], SamplingParams(), arrival_time=0.0).samples[0].group is None


def test_stop_token_set():
    assert stop_token_set(SamplingParams(stop_token_ids=[7]), [2]) == {2, 7}
    assert stop_token_set(SamplingParams(stop_token_ids=[7], ignore_eos=True), [2]) == {7}
