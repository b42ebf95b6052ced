"""SamplingParams: how one request is decoded, validated before the request is queued.

Field names and defaults follow vLLM's `SamplingParams` so its users feel at home. Every invalid value raises
`ValueError` naming the field, the value and the valid range; nothing is checked later inside a jit trace.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

MAX_LOGPROBS = 20  # top-n alternatives returned per token; the sampler's static top-n is this wide
_INT64_MIN, _UINT64_MAX = -(2 ** 63), 2 ** 64 - 1


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass(slots=True)
class SamplingParams:
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
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first invalid field. Cheap; the scheduler calls it again at admission."""
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 (or None), got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check_float("temperature", self.temperature, lo=0.0)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        _check_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_float("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        if self.seed is not None and (not _is_int(self.seed) or not _INT64_MIN <= self.seed <= _UINT64_MAX):
            raise ValueError(f"seed must be None or a 64-bit integer, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must hold token ids >= 0, got {t!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _check_float(name: str, value, *, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False) -> None:
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo) or hi is not None and value > hi:
        left = "(" if lo_open else "["
        rng = f"{left}{lo}, {hi}]" if hi is not None else (f"> {lo}" if lo_open else f">= {lo}")
        raise ValueError(f"{name} must be in {rng}, got {value!r}" if hi is not None
                         else f"{name} must be {rng}, got {value!r}")


def stop_token_set(params: SamplingParams, eos_token_ids: Sequence[int]) -> frozenset[int]:
    """Token ids that finish a request: its stop_token_ids, plus the model's EOS ids unless ignore_eos."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(eos_token_ids)
    return frozenset(ids)
