"""The request contract, the bottom floor of `serving` (pure Python: no gRPC, HTTP, NumPy or engine): how a request
is decoded (`SamplingParams`, `StructuredOutput`, the reasoning formats), which fields the frontends map by name, and
every check a request meets, written once: value ranges, token ids against the vocabulary, the prompt against the
context, chat rendering. Errors are `InvalidArgument`s (ValueErrors) whose message starts with the field's name."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Sequence

import jinja2

MAX_LOGPROBS = 20  # top-n alternatives returned per token; the sampler's static top-n is this wide
MAX_N = 16  # samples per request (SamplingParams.n)
MAX_LOGIT_BIAS = 300  # logit_bias entries per request (OpenAI's limit)
LOGIT_BIAS_LIMIT = 100.0  # |bias| at most this (OpenAI's range [-100, 100])
MAX_REQUEST_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 256  # vLLM's cache_salt (a prefix-cache salt within a tenant)
# Stop strings are matched against the text's tail on every step: bounded in number and length (OpenAI allows 4).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_ADAPTER_NAME_CHARS = 256  # a LoRA adapter's name (SamplingParams.adapter)
PRIORITIES = (0, 1)  # interactive, batch (serving.core.request.Priority; meshserve.v1 Priority)
KNOWN_ROLES = ("system", "user", "assistant", "tool", "developer")
_INT64_MIN, _UINT64_MAX = -(2 ** 63), 2 ** 64 - 1
BOOL_FIELDS = ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens")

# How reasoning models mark their reasoning, by `--reasoning_parser` name: (start marker, end marker, whether the output
# starts inside the reasoning, the chat template having opened it in the prompt). One table for the engine's grammars
# (serving.core.structured: a grammar may apply after the reasoning) and the API's parsers (serving.api.reasoning).
REASONING_FORMATS: dict[str, tuple[str, str, bool]] = {
    "deepseek_r1": ("<think>", "</think>", True),  # the template opens <think> in the prompt
    "qwen3": ("<think>", "</think>", False),  # the model may open a <think>...</think> block first
}
# Reasoning by message channel rather than markers (GPT-OSS's harmony format, serving.api.reasoning): the API splits
# it; no grammar can start after it (its content opens after a multi-token header), so constrained decoding is refused.
CHANNEL_REASONING = ("harmony",)


# ---------------------------------------------------------------------------- errors
class InvalidArgument(ValueError):
    """A bad field; the message starts with the field's name (gRPC INVALID_ARGUMENT, HTTP 400)."""


class InvalidSampling(InvalidArgument):
    """A bad sampling parameter, named as SamplingParams names it (meshserve.v1 puts `sampling.` before it)."""


class ContextLengthError(InvalidArgument):
    """The prompt (and max_tokens) do not fit the model's context (OpenAI's code context_length_exceeded)."""


# ---------------------------------------------------------------------------- sampling parameters
@dataclasses.dataclass(frozen=True, slots=True)
class StructuredOutput:
    """Constrained decoding: the output follows exactly one of a JSON schema (`json_schema`, JSON text), any JSON
    object, a regular expression, a Lark grammar (llguidance's dialect) or a choice among strings. The engine masks
    every token the grammar does not allow and allows EOS only where the grammar may end (serving/core/structured.py).
    `after_reasoning`: with the server's reasoning parser, the model's reasoning is free and the grammar applies to
    what follows it."""
    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None
    after_reasoning: bool = False

    def __post_init__(self):
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise InvalidSampling(f"structured: set exactly one of {', '.join(STRUCTURED_KINDS)}"
                                  + (f" (got {', '.join(kinds)})" if kinds else ""))
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidSampling("structured.choice: give one or more non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request is decoded; checked once, when it is made, and immutable after (every invalid value raises
    InvalidSampling naming the field, the value and the valid range). Names and defaults follow vLLM's.

    `n` > 1 returns n samples of one prompt (its prompt is computed once; each sample has its own seed stream,
    derived from `seed`). With greedy decoding (temperature 0) the n samples are identical, as OpenAI's API allows.
    `logit_bias` ({token id: bias in [-100, 100]}, at most 300 entries) is added to those tokens' logits before
    penalties, temperature and the top-k / top-p / min-p filters; greedy requests take the biased argmax.

    A new field reaches the engine from both frontends by name: add it here, to meshserve.proto's SamplingParameters
    and to the OpenAI schema (serving.api.protocol); tests/serving/test_params.py checks the three agree.
    """
    max_tokens: int | None = 16  # None: until the model's context is full
    min_tokens: int = 0  # stop tokens and EOS do not end the request before this many tokens
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 (or 0) = off
    top_p: float = 1.0  # in (0, 1]; 1 = off
    min_p: float = 0.0  # in [0, 1]; 0 = off
    repetition_penalty: float = 1.0  # > 0; 1 = off
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    seed: int | None = None  # per-request PRNG seed; None = drawn by the engine
    stop: tuple[str, ...] = ()  # stop strings; matched on text by the detokenizer, not included in the output
    stop_token_ids: tuple[int, ...] = ()  # always stop (after min_tokens), even with ignore_eos
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n: sampled token's logprob plus the top-n alternatives
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1  # samples returned for the prompt, in [1, MAX_N]
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit; None (or {}) = none
    structured: StructuredOutput | None = None  # constrained decoding; None = free
    adapter: str | None = None  # the LoRA adapter to decode with, by name (docs/lora.md); None or "" = the base model

    def __post_init__(self):
        # Normalise the forms users pass (a single string, lists) before checking.
        stop = self.stop
        stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", () if self.stop_token_ids is None else tuple(self.stop_token_ids))
        if _is_int(self.top_k) and self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        if self.adapter == "":
            object.__setattr__(self, "adapter", None)
        if isinstance(self.logit_bias, Mapping):
            object.__setattr__(self, "logit_bias", dict(self.logit_bias) or None)
        _check_sampling(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


# Fields a frontend maps by hand, and why; every other SamplingParams field passes through by its own name: the OpenAI
# request's parameter (serving.api.protocol) and meshserve.v1 SamplingParameters' field (serving.wire.requests).
OPENAI_BY_HAND = {
    "max_tokens": "chat's max_completion_tokens overrides it; /v1/completions defaults it to 16",
    "logprobs": "chat asks with logprobs (a bool) and top_logprobs; /v1/completions with logprobs (an int)",
    "structured": "response_format, structured_outputs or a forced tool_choice",
    "adapter": "the request's `model` names it (a LoRA adapter's name, as vLLM)",
}
PROTO_BY_HAND = {"structured": "its own message, StructuredOutput, with a oneof of the kinds"}
# Fields meshserve.v1 carries as 32-bit integers: the OpenAI API refuses larger values with a 400 naming them, since the
# gateway sends the request on as a GenerateRequest (on the instance too: both APIs take the same values).
INT32_FIELDS = ("max_tokens", "min_tokens", "top_k", "n", "logprobs")


def field_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(SamplingParams))


def openai_fields() -> tuple[str, ...]:
    """The fields the OpenAI requests pass through by name."""
    return tuple(name for name in field_names() if name not in OPENAI_BY_HAND)


def stop_token_set(params: SamplingParams, eos_token_ids: Sequence[int]) -> frozenset[int]:
    """Token ids that finish a request: its stop_token_ids, plus the model's EOS ids unless ignore_eos."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(eos_token_ids)
    return frozenset(ids)


# ---------------------------------------------------------------------------- value checks
def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_sampling(p: SamplingParams) -> None:
    """Raises InvalidSampling naming the first invalid field of `p` (after its normalisation)."""
    if p.max_tokens is not None and (not _is_int(p.max_tokens) or p.max_tokens < 1):
        raise InvalidSampling(f"max_tokens must be an integer >= 1 (or None), got {p.max_tokens!r}")
    if not _is_int(p.min_tokens) or p.min_tokens < 0:
        raise InvalidSampling(f"min_tokens must be an integer >= 0, got {p.min_tokens!r}")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise InvalidSampling(f"min_tokens must be <= max_tokens ({p.max_tokens}), got {p.min_tokens}")
    check_float("temperature", p.temperature, lo=0.0)
    if not _is_int(p.top_k) or p.top_k < -1:
        raise InvalidSampling(f"top_k must be -1 (off) or an integer >= 1, got {p.top_k!r}")
    check_float("top_p", p.top_p, lo=0.0, hi=1.0, lo_open=True)
    check_float("min_p", p.min_p, lo=0.0, hi=1.0)
    check_float("repetition_penalty", p.repetition_penalty, lo=0.0, lo_open=True)
    check_float("presence_penalty", p.presence_penalty, lo=-2.0, hi=2.0)
    check_float("frequency_penalty", p.frequency_penalty, lo=-2.0, hi=2.0)
    if p.seed is not None and (not _is_int(p.seed) or not _INT64_MIN <= p.seed <= _UINT64_MAX):
        raise InvalidSampling(f"seed must be None or a 64-bit integer, got {p.seed!r}")
    if len(p.stop) > MAX_STOP_STRINGS:
        raise InvalidSampling(f"stop holds {len(p.stop)} strings, more than {MAX_STOP_STRINGS}")
    for s in p.stop:
        if not isinstance(s, str) or not s:
            raise InvalidSampling(f"stop must hold non-empty strings, got {s!r}")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidSampling(f"stop strings must be at most {MAX_STOP_CHARS} characters, got one of {len(s)}")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidSampling(f"stop_token_ids holds {len(p.stop_token_ids)} ids, more than {MAX_STOP_TOKEN_IDS}")
    for t in p.stop_token_ids:
        if not _is_int(t) or t < 0:
            raise InvalidSampling(f"stop_token_ids must hold token ids >= 0, got {t!r}")
    if p.logprobs is not None and (not _is_int(p.logprobs) or not 0 <= p.logprobs <= MAX_LOGPROBS):
        raise InvalidSampling(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {p.logprobs!r}")
    if not _is_int(p.n) or not 1 <= p.n <= MAX_N:
        raise InvalidSampling(f"n must be an integer in [1, {MAX_N}], got {p.n!r}")
    if p.logit_bias is not None:
        check_logit_bias(p.logit_bias)
    if p.adapter is not None and (not isinstance(p.adapter, str) or len(p.adapter) > MAX_ADAPTER_NAME_CHARS):
        raise InvalidSampling(f"adapter must be an adapter's name of at most {MAX_ADAPTER_NAME_CHARS} characters, "
                              f"got {p.adapter!r:.80}")
    for name in BOOL_FIELDS:
        if not isinstance(getattr(p, name), bool):
            raise InvalidSampling(f"{name} must be a bool, got {getattr(p, name)!r}")
    if p.structured is not None:
        if not isinstance(p.structured, StructuredOutput):
            raise InvalidSampling(f"structured: expected a StructuredOutput, got {type(p.structured).__name__}")
        for name, bad in (("ignore_eos", p.ignore_eos), ("min_tokens", p.min_tokens > 0)):
            if bad:
                raise InvalidSampling(f"{name}: cannot be combined with structured outputs (the grammar decides "
                                      "where the output may end)")


def check_logit_bias(bias) -> None:
    """A {token id: bias} mapping: at most MAX_LOGIT_BIAS entries, ids >= 0, biases in [-100, 100]."""
    if not isinstance(bias, Mapping):
        raise InvalidSampling(f"logit_bias must be a mapping of token id to bias, got {type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidSampling(f"logit_bias has {len(bias)} entries, more than {MAX_LOGIT_BIAS}")
    for t, b in bias.items():
        if not _is_int(t) or t < 0:
            raise InvalidSampling(f"logit_bias: token ids must be integers >= 0, got {t!r}")
        check_float(f"logit_bias[{t}]", b, lo=-LOGIT_BIAS_LIMIT, hi=LOGIT_BIAS_LIMIT)


def check_float(name: str, value, *, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False) -> None:
    if not _is_number(value) or not math.isfinite(value):
        raise InvalidSampling(f"{name} must be a finite number, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo) or hi is not None and value > hi:
        left = "(" if lo_open else "["
        rng = f"{left}{lo}, {hi}]" if hi is not None else (f"> {lo}" if lo_open else f">= {lo}")
        raise InvalidSampling(f"{name} must be in {rng}, got {value!r}" if hi is not None
                              else f"{name} must be {rng}, got {value!r}")


# ---------------------------------------------------------------------------- the prompt against the model
@dataclasses.dataclass(slots=True)
class ModelLimits:
    """What a frontend knows of its model: the vocabulary and context (0: not known yet, the check is left to the
    instance) and the largest request it takes."""
    vocab_size: int = 0
    max_model_len: int = 0
    max_request_bytes: int = 1 << 20


def check_token_ids(field: str, ids, vocab_size: int) -> None:
    """Every id of `ids` (the field `field`) in [0, vocab_size); raises InvalidArgument naming the first other."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise InvalidArgument(f"{field}: token id {t} at position {i} is outside the vocabulary [0, {vocab_size})")


def check_vocabulary(p: SamplingParams, vocab_size: int) -> None:
    """The token ids of sampling parameters (stop_token_ids, logit_bias) against a vocabulary of `vocab_size`."""
    for name, ids in (("stop_token_ids", p.stop_token_ids), ("logit_bias", p.logit_bias or ())):
        for t in ids:
            if not 0 <= t < vocab_size:
                raise InvalidSampling(f"{name}: token id {t} is outside the vocabulary [0, {vocab_size})")


def check_prompt_length(field: str, num_prompt_tokens: int, limit: int) -> None:
    """The prompt (named `field` in the message) leaves room to generate in a context of `limit` tokens."""
    if num_prompt_tokens >= limit:
        raise ContextLengthError(f"{field}: the prompt has {num_prompt_tokens} tokens but the model's context is "
                                 f"{limit} tokens; at most {limit - 1} prompt tokens leave room to generate")


def check_max_tokens(num_prompt_tokens: int, max_tokens: int | None, limit: int) -> None:
    """The APIs' rule (the engine caps instead, finishing with `length`): prompt + max_tokens fit the context."""
    if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
        raise ContextLengthError(f"sampling.max_tokens: the prompt ({num_prompt_tokens} tokens) + max_tokens "
                                 f"({max_tokens}) = {num_prompt_tokens + max_tokens} exceeds the model's "
                                 f"context of {limit} tokens; use max_tokens <= {limit - num_prompt_tokens}")


def check_prompt(field: str, prompt_ids: Sequence[int] | None, params: SamplingParams, limits: ModelLimits) -> None:
    """A request against its model, once where it enters a process (the engine's make_request; the gateway before it
    routes): a prompt with tokens, the sampling parameters' token ids and the prompt's in the vocabulary, the prompt
    shorter than the context. `prompt_ids` None: not tokenized here (only the parameters are checked); a limit of 0:
    not known here. Raises InvalidArgument naming `field` (the prompt as the request names it), InvalidSampling or
    ContextLengthError."""
    if prompt_ids is not None and not prompt_ids:
        raise InvalidArgument(f"{field}: the prompt has no tokens")
    if limits.vocab_size:
        check_vocabulary(params, limits.vocab_size)
        if prompt_ids is not None:
            check_token_ids(field, prompt_ids, limits.vocab_size)
    if prompt_ids is not None and limits.max_model_len:
        check_prompt_length(field, len(prompt_ids), limits.max_model_len)


def encode_chat(tokenizer, messages: list[dict], *, field: str, add_generation_prompt: bool = True,
                **template_kwargs) -> list[int]:
    """The conversation rendered with the model's chat template and tokenized; raises InvalidArgument naming
    `field` (`chat.messages` for meshserve.v1, `messages` for OpenAI) or the message whose role is bad."""
    if not messages:
        raise InvalidArgument(f"{field}: the conversation is empty")
    if tokenizer is None:
        raise InvalidArgument(f"{field}: this model has no tokenizer; send token ids")
    check_roles(field, messages)
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
    except (jinja2.TemplateError, ValueError, TypeError) as e:
        bad = next((i for i, m in enumerate(messages) if m["role"] not in KNOWN_ROLES), None)
        where = f"{field}[{bad}].role" if bad is not None else field
        raise InvalidArgument(f"{where}: the model's chat template rejected the conversation: {e}") from e


def check_roles(field: str, messages) -> None:
    """Every message of a conversation has a role; raises InvalidArgument naming the first that has none."""
    for i, m in enumerate(messages):
        if not (m.get("role") if isinstance(m, Mapping) else m.role):
            raise InvalidArgument(f"{field}[{i}].role: empty; use one of {', '.join(KNOWN_ROLES)}")
