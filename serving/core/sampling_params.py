"""SamplingParams: how one request is decoded, validated before the request is queued.

Field names and defaults follow vLLM's `SamplingParams` so its users feel at home. Every invalid value raises
`ValueError` naming the field, the value and the valid range; nothing is checked later inside a jit trace.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Sequence

# The checks live in serving.validation so the gateway (which must not import serving.core) runs the same ones.
from serving.validation import (MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, _is_int,  # noqa: F401 - limits re-exported
                                check_sampling)


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
            raise ValueError(f"structured: set exactly one of {', '.join(STRUCTURED_KINDS)}"
                             + (f" (got {', '.join(kinds)})" if kinds else ""))
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured.choice: give one or more non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


@dataclasses.dataclass(slots=True)
class SamplingParams:
    """How one request is decoded.

    `n` > 1 returns n samples of one prompt (its prompt is computed once; each sample has its own seed stream,
    derived from `seed`). With greedy decoding (temperature 0) the n samples are identical, as OpenAI's API allows.
    `logit_bias` ({token id: bias in [-100, 100]}, at most 300 entries) is added to those tokens' logits before
    penalties, temperature and the top-k / top-p / min-p filters; greedy requests take the biased argmax.
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

    def __post_init__(self):
        # Normalise the forms users pass (a single string, lists) before checking.
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        elif self.stop is None:
            self.stop = ()
        else:
            self.stop = tuple(self.stop)
        self.stop_token_ids = () if self.stop_token_ids is None else tuple(self.stop_token_ids)
        if _is_int(self.top_k) and self.top_k == 0:
            self.top_k = -1
        if isinstance(self.logit_bias, Mapping):
            self.logit_bias = dict(self.logit_bias) or None
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first invalid field. Cheap; the scheduler calls it again at admission."""
        check_sampling(self)
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise ValueError(f"structured: expected a StructuredOutput, got {type(self.structured).__name__}")
            for name, bad in (("ignore_eos", self.ignore_eos), ("min_tokens", self.min_tokens > 0)):
                if bad:
                    raise ValueError(f"{name}: cannot be combined with structured outputs (the grammar decides "
                                     "where the output may end)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def stop_token_set(params: SamplingParams, eos_token_ids: Sequence[int]) -> frozenset[int]:
    """Token ids that finish a request: its stop_token_ids, plus the model's EOS ids unless ignore_eos."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(eos_token_ids)
    return frozenset(ids)
