"""Instances and pools at run time: one gRPC channel per instance (every call carrying the instance key, when the
configuration names one), a WatchLoad stream keeping its latest load report, the gateway's own counters (in flight,
routed), and `InstancePools.apply` reconciling the set with a new configuration (instances removed from the file keep
their channel until their running requests finish)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.auth import KeyFile
from serving.gateway.config import GatewayConfig, InstanceConfig
from serving.gateway.kv_index import KVEventIndex, subscribe
from serving.gateway.routing import InstanceView
from serving.gateway.security import instance_channel_credentials
from serving.wire import meshserve_pb2 as pb
from serving.wire import meshserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                    ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]
LATENCY_EWMA_ALPHA = 0.2


class Instance:
    def __init__(self, config: InstanceConfig, credentials: grpc.ChannelCredentials | None,
                 key: Callable[[], str] = lambda: ""):
        self.config = config
        self._key = key
        self.name = config.name
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(config.target, options=_CHANNEL_OPTIONS)
        else:
            self.channel = grpc.aio.secure_channel(config.target, credentials, options=_CHANNEL_OPTIONS)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.report: pb.LoadReport | None = None
        self.report_time = 0.0  # monotonic, when received
        self.sent_since_report = 0
        self.inflight = 0
        self.long_inflight = 0
        self.routed_total = 0
        self.latency_ewma_s = 0.0
        self.step_time_s = 0.0  # last reported step-time p50 with steps behind it
        self.watch_task: asyncio.Task | None = None
        self.removed = False
        self.model_info: pb.ModelInfoResponse | None = None
        self.kv_index: KVEventIndex | None = None  # from its KV events (config.kv_events), once subscribed
        self.kv_task: asyncio.Task | None = None

    def kv_events_endpoint(self) -> str:
        """The KV-event stream to subscribe to ("" when off, or "auto" and its ModelInfo names none)."""
        endpoint = self.config.kv_events
        if endpoint == "auto":
            return self.model_info.kv_events_endpoint if self.model_info is not None else ""
        return endpoint

    def kv_events_replay_endpoint(self) -> str:
        """Its KV-event replay socket ("" when none is known)."""
        if self.config.kv_events_replay or self.config.kv_events != "auto" or self.model_info is None:
            return self.config.kv_events_replay
        return self.model_info.kv_events_replay_endpoint

    def metadata(self, extra=()) -> list[tuple[str, str]]:
        """Metadata for a call to this instance: `extra` and the instance key (which the file may have rotated)."""
        key = self._key()
        return [*extra, ("authorization", f"Bearer {key}")] if key else list(extra)

    def view(self, now: float, capacity: int) -> InstanceView:
        return InstanceView(self.name, inflight=self.inflight, sent_since_report=self.sent_since_report,
                            report=self.report,
                            report_age_s=now - self.report_time if self.report is not None else float("inf"),
                            latency_ewma_s=self.latency_ewma_s, step_time_s=self.step_time_s, capacity=capacity)

    def observe_latency(self, seconds: float) -> None:
        self.latency_ewma_s = seconds if self.latency_ewma_s == 0 else (
            (1 - LATENCY_EWMA_ALPHA) * self.latency_ewma_s + LATENCY_EWMA_ALPHA * seconds)

    def reporting_serving(self, now: float, stale_after_s: float) -> bool:
        """False only when a fresh report says it is not admitting (starting, draining)."""
        r = self.report
        return r is None or now - self.report_time > stale_after_s or (r.serving and not r.draining)

    async def health_check(self, timeout: float) -> bool:
        try:
            resp = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout,
                                                metadata=self.metadata())
            return resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False


class InstancePools:
    """The instances of every pool; `on_report` / `on_failure` are the gateway's hooks."""

    def __init__(self, on_report: Callable[[Instance], None], on_failure: Callable[[Instance, str], None]):
        self.instances: dict[str, Instance] = {}
        self.pools: tuple[str, ...] = ()
        self._on_report = on_report
        self._on_failure = on_failure
        self._interval_ms = 200
        self._credentials = None
        self._tls = ()
        self._key_file: KeyFile | None = None

    def apply(self, config: GatewayConfig) -> tuple[list[Instance], list[Instance]]:
        """Adds, replaces and removes instances to match `config`; returns (added, removed)."""
        if config.instance_tls != self._tls:
            self._tls = config.instance_tls
            self._credentials = instance_channel_credentials(dict(config.instance_tls))
            recreate = True
        else:
            recreate = False
        if config.instance_key_file != (self._key_file.path if self._key_file else ""):
            try:
                self._key_file = KeyFile(config.instance_key_file, "instance_key_file") \
                    if config.instance_key_file else None
            except ValueError as e:  # checked at load; gone since: the key in force stays
                log.error("%s; keeping the instance key in force", e)
        self._interval_ms = config.routing.load_interval_ms
        wanted = {i.name: i for i in config.instances}
        added, removed = [], []
        for name, inst in list(self.instances.items()):
            new = wanted.get(name)
            if new is None or new.target != inst.config.target or recreate:
                removed.append(self.instances.pop(name))
            elif new != inst.config:
                inst.config = new  # labels, pool or lane changed: same connection
        for name, cfg in wanted.items():
            if name not in self.instances:
                inst = Instance(cfg, self._credentials, self.instance_key)
                self.instances[name] = inst
                inst.watch_task = asyncio.ensure_future(self._watch(inst))
                added.append(inst)
        for inst in removed:
            inst.removed = True
            for task in (inst.watch_task, inst.kv_task):
                if task is not None:
                    task.cancel()
            asyncio.ensure_future(self._close_when_idle(inst))
        self.pools = config.pools
        return added, removed

    def instance_key(self) -> str:
        return self._key_file.first() if self._key_file is not None else ""

    async def _close_when_idle(self, inst: Instance) -> None:
        while inst.inflight > 0:
            await asyncio.sleep(0.2)
        await inst.channel.close()

    async def close(self) -> None:
        for inst in self.instances.values():
            for task in (inst.watch_task, inst.kv_task):
                if task is not None:
                    task.cancel()
        await asyncio.gather(*(i.channel.close() for i in self.instances.values()), return_exceptions=True)

    async def _watch(self, inst: Instance) -> None:
        """Keeps inst.report fresh from its WatchLoad stream; reconnects with backoff; a broken stream is a
        failure (the health tracker removes the instance and readmits it once it serves again)."""
        backoff = 0.2
        while not inst.removed:
            try:
                if inst.model_info is None:
                    inst.model_info = await inst.stub.ModelInfo(pb.ModelInfoRequest(), timeout=5.0,
                                                                metadata=inst.metadata())
                endpoint = inst.kv_events_endpoint()
                if endpoint and inst.kv_task is None:
                    inst.kv_index = KVEventIndex()
                    inst.kv_task = asyncio.ensure_future(subscribe(
                        endpoint, inst.kv_index, lambda: inst.removed, inst.kv_events_replay_endpoint()))
                call = inst.stub.WatchLoad(pb.WatchLoadRequest(interval_ms=self._interval_ms),
                                           metadata=inst.metadata())
                async for report in call:
                    inst.report = report
                    inst.report_time = time.monotonic()
                    inst.sent_since_report = 0
                    if report.step_time_p50_s > 0:
                        inst.step_time_s = report.step_time_p50_s
                    backoff = 0.2
                    self._on_report(inst)
            except asyncio.CancelledError:
                raise
            except grpc.RpcError as e:
                if not inst.removed:
                    self._on_failure(inst, f"load stream: {e.code().name}: {e.details()}")
            except Exception as e:  # noqa: BLE001 - keep watching
                log.exception("instance %s: load stream", inst.name)
                self._on_failure(inst, f"load stream: {e}")
            await asyncio.sleep(backoff)
            backoff = min(2.0, backoff * 2)
