"""LLM: the offline API. `LLM(model_dir).generate(prompts, sampling_params)` runs every prompt to completion
with continuous batching and returns the completions in prompt order."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from serving.core.config import EngineConfig
from serving.core.interface import build_engine
from serving.core.output_processor import Logprob, StepOutput
from serving.core.request import FinishReason, Priority, RequestMetrics
from serving.core.sampling_params import SamplingParams
from serving.core.scheduler import QueueFullError


@dataclasses.dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    logprobs: list[Logprob] | None
    metrics: RequestMetrics


class LLM:
    def __init__(self, model: str, *, warmup: bool = True, **engine_options):
        self.engine = build_engine(EngineConfig(model=model, **engine_options))
        if warmup:
            self.engine.warmup()
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 priority: int = Priority.INTERACTIVE) -> list[Completion]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        requests = [self.engine.make_request(f"offline-{next(self._ids)}", p, sp, priority=priority)
                    for p, sp in zip(prompts, params)]
        pieces: dict[str, list[str]] = {r.request_id: [] for r in requests}
        logprobs: dict[str, list[Logprob]] = {r.request_id: [] for r in requests}
        finals: dict[str, StepOutput] = {}

        def collect(o: StepOutput):
            pieces[o.request_id].append(o.new_text)
            if o.logprobs:
                logprobs[o.request_id].extend(o.logprobs)
            if o.finished:
                finals[o.request_id] = o

        pending = list(requests)
        while pending or self.engine.has_unfinished():
            while pending:  # admit as many as the queue takes; the rest wait for room
                try:
                    self.engine.add_request(pending[0])
                except QueueFullError:
                    break
                pending.pop(0)
            for o in self.engine.step():
                collect(o)
        out = []
        for r in requests:
            f = finals[r.request_id]
            out.append(Completion(r.request_id, r.prompt_token_ids, r.output_token_ids, "".join(pieces[r.request_id]),
                                  f.finish_reason, f.stop_reason,
                                  logprobs[r.request_id] if r.sampling_params.logprobs is not None else None,
                                  r.metrics))
        return out
