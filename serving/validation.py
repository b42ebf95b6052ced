"""Request checks shared by the instance server and the gateway (which must not import serving.core), pure Python with
no gRPC or NumPy: sampling parameters (`check_sampling`, `check_vocabulary`; `sampling_fields` reads them from the
proto) and a GenerateRequest's size, id, priority and context (`check_request_header`, `check_context`). Errors are
ValueErrors naming the field, the value and the valid range."""
from __future__ import annotations

import math
from collections.abc import Mapping

MAX_LOGPROBS = 20  # top-n alternatives returned per token; the sampler's static top-n is this wide
MAX_N = 16  # samples per request (SamplingParams.n)
MAX_LOGIT_BIAS = 300  # logit_bias entries per request (OpenAI's limit)
LOGIT_BIAS_LIMIT = 100.0  # |bias| at most this (OpenAI's range [-100, 100])
_INT64_MIN, _UINT64_MAX = -(2 ** 63), 2 ** 64 - 1
BOOL_FIELDS = ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_sampling(p) -> None:
    """Raises ValueError naming the first invalid field of `p` (any object with SamplingParams' attributes,
    after its normalisation: stop and stop_token_ids are tuples, top_k 0 is -1)."""
    if p.max_tokens is not None and (not _is_int(p.max_tokens) or p.max_tokens < 1):
        raise ValueError(f"max_tokens must be an integer >= 1 (or None), got {p.max_tokens!r}")
    if not _is_int(p.min_tokens) or p.min_tokens < 0:
        raise ValueError(f"min_tokens must be an integer >= 0, got {p.min_tokens!r}")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise ValueError(f"min_tokens must be <= max_tokens ({p.max_tokens}), got {p.min_tokens}")
    check_float("temperature", p.temperature, lo=0.0)
    if not _is_int(p.top_k) or p.top_k < -1:
        raise ValueError(f"top_k must be -1 (off) or an integer >= 1, got {p.top_k!r}")
    check_float("top_p", p.top_p, lo=0.0, hi=1.0, lo_open=True)
    check_float("min_p", p.min_p, lo=0.0, hi=1.0)
    check_float("repetition_penalty", p.repetition_penalty, lo=0.0, lo_open=True)
    check_float("presence_penalty", p.presence_penalty, lo=-2.0, hi=2.0)
    check_float("frequency_penalty", p.frequency_penalty, lo=-2.0, hi=2.0)
    if p.seed is not None and (not _is_int(p.seed) or not _INT64_MIN <= p.seed <= _UINT64_MAX):
        raise ValueError(f"seed must be None or a 64-bit integer, got {p.seed!r}")
    for s in p.stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must hold non-empty strings, got {s!r}")
    for t in p.stop_token_ids:
        if not _is_int(t) or t < 0:
            raise ValueError(f"stop_token_ids must hold token ids >= 0, got {t!r}")
    if p.logprobs is not None and (not _is_int(p.logprobs) or not 0 <= p.logprobs <= MAX_LOGPROBS):
        raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {p.logprobs!r}")
    if not _is_int(p.n) or not 1 <= p.n <= MAX_N:
        raise ValueError(f"n must be an integer in [1, {MAX_N}], got {p.n!r}")
    if p.logit_bias is not None:
        check_logit_bias(p.logit_bias)
    for name in BOOL_FIELDS:
        if not isinstance(getattr(p, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(p, name)!r}")


def check_logit_bias(bias) -> None:
    """A {token id: bias} mapping: at most MAX_LOGIT_BIAS entries, ids >= 0, biases in [-100, 100]."""
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(bias)} entries, more than {MAX_LOGIT_BIAS}")
    for t, b in bias.items():
        if not _is_int(t) or t < 0:
            raise ValueError(f"logit_bias: token ids must be integers >= 0, got {t!r}")
        check_float(f"logit_bias[{t}]", b, lo=-LOGIT_BIAS_LIMIT, hi=LOGIT_BIAS_LIMIT)


def check_vocabulary(p, vocab_size: int) -> None:
    """The token ids of valid sampling parameters `p` (stop_token_ids, logit_bias) against a vocabulary of
    `vocab_size` tokens; raises ValueError naming the field and the id."""
    for name, ids in (("stop_token_ids", p.stop_token_ids), ("logit_bias", p.logit_bias or ())):
        for t in ids:
            if not 0 <= t < vocab_size:
                raise ValueError(f"{name}: token id {t} is outside the vocabulary [0, {vocab_size})")


def check_float(name: str, value, *, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False) -> None:
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo) or hi is not None and value > hi:
        left = "(" if lo_open else "["
        rng = f"{left}{lo}, {hi}]" if hi is not None else (f"> {lo}" if lo_open else f">= {lo}")
        raise ValueError(f"{name} must be in {rng}, got {value!r}" if hi is not None
                         else f"{name} must be {rng}, got {value!r}")


# ---------------------------------------------------------------------------- GenerateRequest checks
# meshserve.v1 SamplingParameters fields whose unset value means "the default" (proto3 `optional`).
OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "repetition_penalty", "seed", "logprobs", "n",
                            "skip_special_tokens", "spaces_between_special_tokens")


def sampling_fields(sp) -> dict:
    """A meshserve.v1 SamplingParameters (duck-typed) as SamplingParams keywords; unset optional fields are left
    out, so they take SamplingParams' defaults."""
    kw = dict(min_tokens=sp.min_tokens, top_k=sp.top_k, min_p=sp.min_p, presence_penalty=sp.presence_penalty,
              frequency_penalty=sp.frequency_penalty, stop=tuple(sp.stop), stop_token_ids=tuple(sp.stop_token_ids),
              include_stop_str_in_output=sp.include_stop_str_in_output, ignore_eos=sp.ignore_eos,
              logit_bias=dict(sp.logit_bias) or None)
    for name in OPTIONAL_SAMPLING_FIELDS:
        if sp.HasField(name):
            kw[name] = getattr(sp, name)
    return kw


# The instance server (serving.server.servicer) and the gateway (serving.gateway.validation) run these with the
# same messages; `req` is a meshserve.v1 GenerateRequest, read by duck typing (no protobuf import here).
MAX_REQUEST_ID_CHARS = 256


class InvalidArgument(ValueError):
    """A bad field; the message starts with the field's name."""


def check_request_header(req, max_request_bytes: int, priorities) -> str | None:
    """The request's size, request_id and priority (a value in `priorities`), in that order; raises
    InvalidArgument. Returns which prompt field is set (`req.WhichOneof("prompt")`)."""
    which = req.WhichOneof("prompt")
    size = req.ByteSize()
    if size > max_request_bytes:
        field = {"text": "text", "token_ids": "token_ids", "chat": "chat.messages"}.get(which, "request")
        raise InvalidArgument(f"{field}: the request is {size} bytes, over the server's limit of "
                              f"{max_request_bytes} bytes (--max_request_bytes)")
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(f"request_id: {len(req.request_id)} characters, more than {MAX_REQUEST_ID_CHARS}")
    if req.priority not in priorities:
        raise InvalidArgument(f"priority: unknown value {req.priority}; use PRIORITY_INTERACTIVE or "
                              "PRIORITY_BATCH")
    return which


def check_context(field: str, num_prompt_tokens: int, max_tokens: int | None, limit: int) -> None:
    """The prompt (named `field` in the message) and max_tokens against the model's context of `limit` tokens;
    raises InvalidArgument."""
    if num_prompt_tokens >= limit:
        raise InvalidArgument(f"{field}: the prompt has {num_prompt_tokens} tokens but the model's context is "
                              f"{limit} tokens; at most {limit - 1} prompt tokens leave room to generate")
    if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
        raise InvalidArgument(f"sampling.max_tokens: the prompt ({num_prompt_tokens} tokens) + max_tokens "
                              f"({max_tokens}) = {num_prompt_tokens + max_tokens} exceeds the model's "
                              f"context of {limit} tokens; use max_tokens <= {limit - num_prompt_tokens}")
