"""SamplingParams: defaults, normalisation, and every invalid value rejected with its field named."""
import math

import pytest

from serving.core import MAX_LOGPROBS, SamplingParams
from serving.core.sampling_params import stop_token_set


def test_defaults_are_valid_and_vllm_like():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p) == (16, 1.0, -1, 1.0, 0.0)
    assert p.stop == () and p.stop_token_ids == () and p.logprobs is None and not p.ignore_eos
    assert not p.is_greedy and not p.has_penalties


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[2, 3], top_k=0, temperature=0)
    assert p.stop == ("###",) and p.stop_token_ids == (2, 3) and p.top_k == -1 and p.is_greedy
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(top_k=1).is_greedy
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(repetition_penalty=1.1).has_penalties


def test_valid_edges():
    SamplingParams(temperature=0.0, top_p=1.0, min_p=1.0, top_k=1, max_tokens=1, seed=0, logprobs=MAX_LOGPROBS,
                   presence_penalty=-2, frequency_penalty=2, repetition_penalty=1e-3, min_tokens=1)
    SamplingParams(seed=2 ** 64 - 1, logprobs=0, top_p=1e-9)


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
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_mutation_caught_by_validate():
    p = SamplingParams()
    p.temperature = -1.0
    with pytest.raises(ValueError, match="temperature"):
        p.validate()


def test_stop_token_set():
    assert stop_token_set(SamplingParams(stop_token_ids=[7]), [2]) == {2, 7}
    assert stop_token_set(SamplingParams(stop_token_ids=[7], ignore_eos=True), [2]) == {7}
