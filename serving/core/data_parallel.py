"""`DataParallelEngine`: `dp` independent replicas of the model inside one instance, each on its own group of devices
(the mesh's 'data' axis) with its own scheduler, KV pages and sequences, behind Engine's interface; a request stays on
the replica with the least queued work. Details: docs/engine.md."""
from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from serving.core.config import EngineConfig
from serving.core.engine import Engine, StepRecord
from serving.core.output_processor import StepOutput
from sharding.mesh import serving_mesh
from serving.core.request import FinishReason, Request
from serving.core.scheduler import QueueFullError

_COUNTERS = ("num_waiting", "num_running", "num_waiting_tokens", "prefix_cache_queries", "prefix_cache_hits",
             "num_preemptions")


class _PooledBlockManagers:
    """The replicas' KV page pools seen as one (read-only numbers and checks): pages summed."""

    def __init__(self, replicas: list[Engine]):
        self._replicas = replicas

    @property
    def _managers(self):
        return [r.scheduler.block_manager for r in self._replicas]

    @property
    def num_pages(self) -> int:
        return sum(m.num_pages for m in self._managers)

    @property
    def num_free_pages(self) -> int:
        return sum(m.num_free_pages for m in self._managers)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_pages / self.num_pages

    def check_idle(self) -> None:
        for m in self._managers:
            m.check_idle()

    def reset_prefix_cache(self) -> int:
        return sum(m.reset_prefix_cache() for m in self._managers)


class _PooledSchedulers:
    """The replicas' schedulers seen as one, for stats, load reports and invariant checks. Admission and
    aborts go through DataParallelEngine, which knows each request's replica."""

    def __init__(self, replicas: list[Engine]):
        self._replicas = replicas
        self.block_manager = _PooledBlockManagers(replicas)

    def stats(self) -> dict[str, float]:
        per_replica = [r.scheduler.stats() for r in self._replicas]
        out = {k: sum(s[k] for s in per_replica) for k in _COUNTERS}
        out["kv_cache_usage"] = self.block_manager.usage  # used pages over all pages, not a mean of ratios
        return out

    @property
    def num_waiting(self) -> int:
        return sum(r.scheduler.num_waiting for r in self._replicas)

    @property
    def num_running(self) -> int:
        return sum(r.scheduler.num_running for r in self._replicas)

    @property
    def num_waiting_tokens(self) -> int:
        return sum(r.scheduler.num_waiting_tokens for r in self._replicas)

    @property
    def requests(self) -> dict[str, Request]:
        return {rid: req for r in self._replicas for rid, req in r.scheduler.requests.items()}

    def has_unfinished_requests(self) -> bool:
        return any(r.scheduler.has_unfinished_requests() for r in self._replicas)

    def check_invariants(self) -> None:
        for r in self._replicas:
            r.scheduler.check_invariants()


class DataParallelEngine:
    def __init__(self, config: EngineConfig, *, tokenizer=None):
        if config.pp > 1:
            raise ValueError(f"data parallelism (dp={config.dp}) with pipeline parallelism (pp={config.pp}) is not "
                             "supported: use dp x tp, or pp x tp without dp")
        if config.speculative_method:
            raise ValueError(f"data parallelism (dp={config.dp}) with speculative decoding "
                             f"({config.speculative_method!r}) is not supported")
        if jax.process_count() > 1:
            raise ValueError(f"data parallelism (dp={config.dp}) is single-host only; multi-host instances take "
                             "--tp/--ep/--pp")
        dp, per = config.dp, config.tp * config.ep
        devices = jax.devices()
        if dp * per > len(devices):
            raise ValueError(f"dp={dp} x tp={config.tp} x ep={config.ep} needs {dp * per} devices; "
                             f"{len(devices)} available")
        replica_config = dataclasses.replace(config, dp=1, num_pages=config.num_pages // dp if config.num_pages
                                             else 0, kv_cache_memory_gb=config.kv_cache_memory_gb / dp)
        self.config = config
        self.replicas: list[Engine] = []
        for r in range(dp):
            mesh = serving_mesh(tp=config.tp, ep=config.ep, devices=devices[r * per:(r + 1) * per])
            adapters = self.replicas[0].adapters if self.replicas else None  # LoRA: one registry, the first's
            self.replicas.append(Engine(replica_config, tokenizer=tokenizer, mesh=mesh, adapters=adapters))
            tokenizer = self.replicas[0].tokenizer  # loaded once
        self.scheduler = _PooledSchedulers(self.replicas)
        self._owner: dict[str, Engine] = {}
        self._next = 0  # round-robin tie-break between equally loaded replicas
        self.spec = None  # speculative decoding is refused above
        self.bubble_fraction = 0.0
        self.compile_time_s = 0.0
        self.last_step: StepRecord | None = None  # the replicas' steps collected by the latest step(), merged
        self.step_count = 0
        self.last_step_time_s = 0.0

    # ------------------------------------------------------------------ Engine's read-only surface
    @property
    def tokenizer(self):
        return self.replicas[0].tokenizer

    @property
    def model_config(self):
        return self.replicas[0].model_config

    @property
    def eos_token_ids(self):
        return self.replicas[0].eos_token_ids

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    @property
    def buckets(self) -> list[int]:
        return self.replicas[0].buckets

    @property
    def num_pages(self) -> int:
        return sum(r.num_pages for r in self.replicas)

    @property
    def devices(self) -> list:
        return [d for r in self.replicas for d in r.devices]

    @property
    def compile_count(self) -> int:
        return sum(r.compile_count for r in self.replicas)

    def warmup(self) -> None:
        t0 = time.perf_counter()
        for r in self.replicas:
            r.warmup()
        self.compile_time_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ requests
    def make_request(self, *args, **kwargs) -> Request:
        return self.replicas[0].make_request(*args, **kwargs)

    @property
    def structured(self):
        """The grammars (compiled by the first replica; each request carries its own state to any replica)."""
        return self.replicas[0].structured

    @staticmethod
    def _queued_tokens(engine: Engine) -> int:
        s = engine.scheduler
        return sum(r.num_tokens - r.num_computed_tokens for r in s.running) + s.num_waiting_tokens + \
            len(s.running) + len(s.waiting)

    def add_request(self, request: Request) -> None:
        """Queues the request on the least loaded replica (one whose queue is full passes it on)."""
        dp = len(self.replicas)
        order = sorted(range(dp), key=lambda i: (self._queued_tokens(self.replicas[i]), (i - self._next) % dp))
        for n, i in enumerate(order):
            try:
                self.replicas[i].add_request(request)
            except QueueFullError:
                if n == dp - 1:
                    raise
                continue
            self._owner[request.request_id] = self.replicas[i]
            self._next = (i + 1) % dp
            return

    # ------------------------------------------------------------------ LoRA adapters: one registry, slots per replica
    def load_adapter(self, name: str, path: str) -> dict:
        info = self.replicas[0].load_adapter(name, path)
        adapter = self.replicas[0].adapters.get(name)
        for r in self.replicas[1:]:
            r.lora.prefetch(adapter)
        return info

    def unload_adapter(self, name: str) -> dict:
        adapter = self.replicas[0]._adapter(name)
        info = self.replicas[0].unload_adapter(name)
        for r in self.replicas[1:]:
            r.lora.forget(adapter)
            info["requests_in_flight"] += r.adapter_requests(adapter)
        return info

    def list_adapters(self) -> list[dict]:
        """The loaded adapters' info, each with its slot on every replica (None: not on that replica's device)."""
        out = []
        for info in self.replicas[0].list_adapters():
            slots = [r.lora.resident().get(info["name"]) for r in self.replicas]
            out.append({k: v for k, v in info.items() if k != "slot"} | {"slots": slots})
        return out

    def lora_requests_info(self) -> dict:
        infos = [r.lora_requests_info() for r in self.replicas]
        return {"running": sorted({n for i in infos for n in i["running"]}),
                "waiting": sorted({n for i in infos for n in i["waiting"]}), "max_lora": infos[0]["max_lora"]}

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> list[StepOutput]:
        owner = self._owner.pop(request_id, None)
        return owner.abort(request_id, reason) if owner else []

    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.replicas)

    def replica_of(self, request_id: str) -> int | None:
        owner = self._owner.get(request_id)
        return None if owner is None else self.replicas.index(owner)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        records: list[StepRecord] = []
        for r in self.replicas:
            if r.has_unfinished():
                before = r.last_step
                outputs += r.step()
                if r.last_step is not before:
                    records.append(r.last_step)
        for o in outputs:
            if o.finished and all(r.is_finished for r in o.request.samples):
                self._owner.pop(o.request_id, None)
        if records:
            self.last_step = StepRecord(
                scheduled=[s for rec in records for s in rec.scheduled],
                num_scheduled_tokens=sum(rec.num_scheduled_tokens for rec in records),
                start_time=min(rec.start_time for rec in records), end_time=max(rec.end_time for rec in records),
                device_step_times_s={d: t for rec in records for d, t in rec.device_step_times_s.items()})
            self.step_count += 1
            self.last_step_time_s = max(r.last_step_time_s for r in self.replicas)
        return outputs

    def fail_inflight(self, error: BaseException) -> list[StepOutput]:
        outputs = [o for r in self.replicas for o in r.fail_inflight(error)]
        for o in outputs:
            self._owner.pop(o.request_id, None)
        return outputs

    run_until_idle = Engine.run_until_idle  # only needs has_unfinished() and step()

    # ------------------------------------------------------------------ expert load (MoE), over all replicas
    def moe_layer_indices(self) -> list[int]:
        return self.replicas[0].moe_layer_indices()

    def expert_load(self) -> np.ndarray | None:
        """Tokens routed to each physical expert slot, summed over replicas, [moe_layers, slots]."""
        loads = [r.expert_load() for r in self.replicas]
        return None if loads[0] is None else np.sum(loads, axis=0)

    def expert_device_load(self) -> np.ndarray | None:
        """Tokens per expert-parallel device of every replica, [moe_layers, dp * ep]."""
        loads = [r.expert_device_load() for r in self.replicas]
        return None if loads[0] is None else np.concatenate(loads, axis=1)

    def reset_expert_load(self) -> None:
        for r in self.replicas:
            r.reset_expert_load()

    def rebalance_experts(self) -> dict[str, float]:
        """Rebalances each replica from its own load; the predicted variances are averaged over replicas."""
        results = [r.rebalance_experts() for r in self.replicas]
        return {k: float(np.mean([res[k] for res in results])) for k in results[0]}
