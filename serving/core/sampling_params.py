"""SamplingParams: how one request is decoded, validated before the request is queued.

Field names and defaults follow vLLM's `SamplingParams` so its users feel at home. Every invalid value raises
`ValueError` naming the field, the value and the valid range; nothing is checked later inside a jit trace.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

# The checks live in serving.validation so the gateway (which must not import serving.core) runs the same ones.
from serving.validation import MAX_LOGPROBS, _is_int, check_sampling  # noqa: F401 - MAX_LOGPROBS re-exported


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
        check_sampling(self)

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
