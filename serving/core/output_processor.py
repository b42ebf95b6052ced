"""OutputProcessor: a step's token ids -> what the client gets. It detokenises each request incrementally, watches
for stop strings (holding back a tail that could still become one), cuts a speculative step's tokens at a stop
string, formats logprobs from the sampler's packed row, and ends requests a stop string finishes."""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from models.tokenizer import Tokenizer
from serving.core.request import FinishReason, Request
from serving.core.sampling import unpack_row
from serving.params import SamplingParams
from serving.core.scheduler import RequestOutput


@dataclasses.dataclass(slots=True)
class Logprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-n alternatives, best first


@dataclasses.dataclass(slots=True)
class StepOutput:
    """What one request (one sample of it, when n > 1) gained in one step, with its text. `request_id` is the
    request's id (for every sample); `index` which sample; `request` that sample's state; `finished` that it
    ended (the request ends when all its samples have)."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    logprobs: list[Logprob] | None
    request: Request
    index: int = 0


class RequestText:
    """Per-request text state: incremental detokenizer plus the stop-string search window."""
    __slots__ = ("detok", "text", "emitted", "stops", "max_stop", "include_stop")

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids, params: SamplingParams):
        self.detok = tokenizer.detokenizer(prompt_ids, params.skip_special_tokens) if tokenizer else None
        self.text = ""
        self.emitted = 0  # characters of self.text already delivered
        self.stops = params.stop
        self.max_stop = max((len(s) for s in params.stop), default=0)
        self.include_stop = params.include_stop_str_in_output

    def add(self, token_ids: list[int], final: bool) -> tuple[str, str | None]:
        """Returns (new text to deliver, the stop string hit or None)."""
        if self.detok is None:
            return "", None
        start = max(0, len(self.text) - self.max_stop + 1)
        self.text += self.detok.add(token_ids)
        if final:
            self.text += self.detok.flush()
        hit = None
        if self.stops:
            best = -1
            for s in self.stops:
                i = self.text.find(s, start)
                if i >= 0 and (best < 0 or i < best):
                    best, hit = i, s
            if hit is not None:
                self.text = self.text[:best + (len(hit) if self.include_stop else 0)]
        # Hold back a tail that could still become a stop string.
        hold = 0 if (final or hit is not None) else max(0, self.max_stop - 1)
        end = max(self.emitted, len(self.text) - hold)
        new = self.text[self.emitted:end]
        self.emitted = end
        return new, hit


class OutputProcessor:
    """Per-request text state from `add` until the request's final output. `finish(request_id, reason,
    stop_reason)` ends a request in the scheduler when a stop string is found before its tokens say so."""

    def __init__(self, tokenizer: Tokenizer | None, finish: Callable[[str, FinishReason, str], object]):
        self.tokenizer = tokenizer
        self._finish = finish
        self._detoks: dict[str, RequestText] = {}

    def add(self, request: Request) -> None:
        d = RequestText(self.tokenizer, request.prompt_token_ids, request.sampling_params)
        if request.output_token_ids:  # a continued request (a disaggregated decode): those tokens went out elsewhere
            d.add(request.output_token_ids, final=False)
            d.emitted = len(d.text)
        self._detoks[request.request_id] = d

    def process(self, out: RequestOutput, row: np.ndarray) -> StepOutput:
        r = out.request
        logprobs = None
        if r.sampling_params.logprobs is not None and out.new_token_ids:
            logprobs = [Logprob(*unpack_row(row, r.sampling_params.logprobs))]
        d = self._detoks.get(r.request_id)
        trimmed = False
        if d is not None and d.stops and len(out.new_token_ids) > 1:
            # speculative: several tokens, none past a stop string
            text, hit, trimmed = self._add_until_stop(d, out)
        else:
            text, hit = d.add(out.new_token_ids, out.finished) if d else ("", None)
        finished, reason, stop_reason = out.finished, out.finish_reason, out.stop_reason
        if trimmed and finished:  # it ended on a later token (EOS, length): the stop string came first
            reason, stop_reason = r.finish_reason, r.stop_reason = FinishReason.STOP, hit
        if hit is not None and not finished:
            # The step in flight may hold a token for it; update() drops tokens of finished requests.
            self._finish(r.request_id, FinishReason.STOP, hit)
            finished, reason, stop_reason = True, FinishReason.STOP, hit
        if finished:
            self._detoks.pop(r.request_id, None)
        return StepOutput(r.parent_id, out.new_token_ids, text, finished, reason, stop_reason, logprobs, r,
                          r.sample_index)

    @staticmethod
    def _add_until_stop(d: RequestText, out: RequestOutput) -> tuple[str, str | None, bool]:
        """Detokenizes a multi-token step one token at a time; at a stop string the tokens after it are dropped
        (from the output and the request) so a speculative step never emits past it."""
        tokens = out.new_token_ids
        pieces = []
        for i, t in enumerate(tokens):
            text, hit = d.add([t], out.finished and i == len(tokens) - 1)
            pieces.append(text)
            if hit is not None:
                extra = len(tokens) - i - 1
                if extra:
                    r = out.request
                    del r.token_ids[len(r.token_ids) - extra:]
                    del r.metrics.token_times[len(r.metrics.token_times) - extra:]
                    del tokens[i + 1:]
                return "".join(pieces), hit, extra > 0
        return "".join(pieces), None, False

    def final(self, out: RequestOutput) -> StepOutput:
        d = self._detoks.pop(out.request_id, None)
        text = d.add([], True)[0] if d else ""
        r = out.request
        return StepOutput(r.parent_id, [], text, True, out.finish_reason, out.stop_reason, None, r, r.sample_index)
