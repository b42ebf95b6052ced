"""DataParallelEngine: `dp` independent replicas of the model inside one instance, each on its own group of
devices (the mesh's 'data' axis), each with its own scheduler, KV pages and sequences.

A request goes to the replica with the least queued work and stays there; a step steps every busy replica
(each launches its device work asynchronously, so replicas run side by side). The interface is Engine's.
"""
from __future__ import annotations

import dataclasses

import jax

from serving.core.engine import Engine, EngineConfig, StepOutput, make_serving_mesh
from serving.core.request import FinishReason, Request


class DataParallelEngine:
    def __init__(self, config: EngineConfig):
        dp, per = config.dp, config.tp * config.ep
        devices = jax.devices()
        if dp * per > len(devices):
            raise ValueError(f"dp={dp} x tp={config.tp} x ep={config.ep} needs {dp * per} devices; "
                             f"{len(devices)} available")
        replica_config = dataclasses.replace(config, dp=1, num_pages=config.num_pages // dp if config.num_pages
                                             else 0, kv_cache_memory_gb=config.kv_cache_memory_gb / dp)
        self.config = config
        self.replicas = [Engine(replica_config, mesh=make_serving_mesh(tp=config.tp, ep=config.ep,
                                                                       devices=devices[r * per:(r + 1) * per]))
                         for r in range(dp)]
        self._owner: dict[str, Engine] = {}

    @property
    def tokenizer(self):
        return self.replicas[0].tokenizer

    @property
    def model_config(self):
        return self.replicas[0].model_config

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    @property
    def compile_count(self) -> int:
        return sum(r.compile_count for r in self.replicas)

    def warmup(self) -> None:
        for r in self.replicas:
            r.warmup()

    def make_request(self, *args, **kwargs) -> Request:
        return self.replicas[0].make_request(*args, **kwargs)

    @staticmethod
    def _queued_tokens(engine: Engine) -> int:
        s = engine.scheduler
        return sum(r.num_tokens - r.num_computed_tokens for r in s.running) + s.num_waiting_tokens + \
            len(s.running) + len(s.waiting)

    def add_request(self, request: Request) -> None:
        target = min(self.replicas, key=self._queued_tokens)
        target.add_request(request)
        self._owner[request.request_id] = target

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> StepOutput | None:
        owner = self._owner.pop(request_id, None)
        return owner.abort(request_id, reason) if owner else None

    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.replicas)

    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        for r in self.replicas:
            if r.has_unfinished():
                outputs += r.step()
        for o in outputs:
            if o.finished:
                self._owner.pop(o.request_id, None)
        return outputs

    def fail_inflight(self, error: BaseException) -> list[StepOutput]:
        outputs = [o for r in self.replicas for o in r.fail_inflight(error)]
        for o in outputs:
            self._owner.pop(o.request_id, None)
        return outputs

    def replica_of(self, request_id: str) -> int | None:
        owner = self._owner.get(request_id)
        return None if owner is None else self.replicas.index(owner)
