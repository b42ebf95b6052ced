"""LLM: the offline API. `LLM(model_dir).generate(prompts, sampling_params)` runs every prompt to completion
with continuous batching and returns the completions in prompt order (each with its n samples: `Completion.outputs`)."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from serving.core.config import EngineConfig
from serving.core.factory import build_engine
from serving.core.output_processor import Logprob, StepOutput
from serving.core.request import FinishReason, Priority, RequestMetrics
from serving.params import SamplingParams
from serving.core.scheduler import QueueFullError


@dataclasses.dataclass
class CompletionOutput:
    """One sample of a completion."""
    index: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    logprobs: list[Logprob] | None
    metrics: RequestMetrics


def _sample_0(name: str) -> property:
    return property(lambda self: getattr(self.outputs[0], name), doc=f"sample 0's {name}")


@dataclasses.dataclass
class Completion:
    """One prompt's completion: every sample in `outputs` (SamplingParams.n of them, sample 0 first); token_ids, text,
    finish_reason, stop_reason, logprobs and metrics are sample 0's."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    token_ids = _sample_0("token_ids")
    text = _sample_0("text")
    finish_reason = _sample_0("finish_reason")
    stop_reason = _sample_0("stop_reason")
    logprobs = _sample_0("logprobs")
    metrics = _sample_0("metrics")


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
        samples = [s for r in requests for s in r.samples]
        pieces: dict[str, list[str]] = {s.request_id: [] for s in samples}
        logprobs: dict[str, list[Logprob]] = {s.request_id: [] for s in samples}
        finals: dict[str, StepOutput] = {}

        def collect(o: StepOutput):
            rid = o.request.request_id  # the sample's own id
            pieces[rid].append(o.new_text)
            if o.logprobs:
                logprobs[rid].extend(o.logprobs)
            if o.finished:
                finals[rid] = o

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
            outputs = []
            for s in r.samples:
                f = finals[s.request_id]
                outputs.append(CompletionOutput(
                    s.sample_index, s.output_token_ids, "".join(pieces[s.request_id]), f.finish_reason, f.stop_reason,
                    logprobs[s.request_id] if s.sampling_params.logprobs is not None else None, s.metrics))
            out.append(Completion(r.request_id, r.prompt_token_ids, outputs))
        return out
