"""The gateway's gRPC servicers: meshserve.v1.Inference (the same API as an instance), meshserve.gateway.v1.Jobs
and GatewayAdmin. Every failure is a gRPC status with an actionable message."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from serving.gateway.app import Gateway, GatewayError
from serving.gateway.health import HEALTHY
from serving.gateway.jobs import JobError
from serving.gateway.lora import AdapterError
from serving.gateway.proto import gateway_pb2 as gpb
from serving.gateway.proto import gateway_pb2_grpc as gpb_grpc
from serving.gateway.security import ADMIN, AuthError
from serving.wire import meshserve_pb2 as pb
from serving.wire import meshserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


async def _abort(context, code: grpc.StatusCode, details: str, trailing=()) -> None:
    await context.abort(code, details, trailing_metadata=trailing)


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, gateway: Gateway):
        self.gw = gateway

    @property
    def draining(self) -> bool:
        return self.gw.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.gw.draining = value

    def _tenant(self, context):
        return self.gw.auth.tenant(context.invocation_metadata())

    async def Generate(self, request: pb.GenerateRequest, context):
        gw = self.gw
        t0 = time.monotonic()
        metadata = context.invocation_metadata()
        code = grpc.StatusCode.OK
        try:
            if self.draining:
                raise GatewayError(grpc.StatusCode.UNAVAILABLE, "the gateway is draining; send it elsewhere")
            try:
                tenant = gw.auth.tenant(metadata)
            except AuthError as e:
                raise GatewayError(e.code, e.details) from None
            p = gw.prepare(request, tenant)
            gw.check_rate(tenant, [p])
            remaining = context.time_remaining()
            deadline = t0 + (remaining if remaining is not None else gw.config.admission.request_timeout_s)
            gen = gw.stream(p, deadline, gw.parent_context(metadata))
            first = True
            try:
                async for r in gen:
                    if first:
                        gw.metrics.ttft.observe(time.monotonic() - t0)
                        first = False
                    yield r
            finally:
                await gen.aclose()
            gw.metrics.e2e.observe(time.monotonic() - t0)
        except GatewayError as e:
            code = e.code
            await _abort(context, e.code, e.details, e.trailing)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            gw.metrics.requests.labels(code.name).inc()

    async def _forward(self, context, method: str, request):
        try:
            self._tenant(context)
        except AuthError as e:
            await _abort(context, e.code, e.details)
        gw = self.gw
        candidates = sorted((i for i in gw.pools.instances.values() if gw.health.routable(i.name)),
                            key=lambda i: i.inflight)
        last = None
        for inst in candidates[:2]:
            try:
                return await getattr(inst.stub, method)(request, timeout=context.time_remaining() or 30.0,
                                                        metadata=inst.metadata())
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN):
                    await _abort(context, e.code(), e.details() or "")
                last = e
        await _abort(context, grpc.StatusCode.UNAVAILABLE, "no healthy instance" + (
            f" ({last.details()})" if last is not None else ""))

    async def Tokenize(self, request, context):
        return await self._forward(context, "Tokenize", request)

    async def ModelInfo(self, request, context):
        return await self._forward(context, "ModelInfo", request)

    def _fleet_report(self) -> pb.LoadReport:
        gw = self.gw
        out = pb.LoadReport(instance_id="gateway", timestamp=time.time(), serving=not self.draining,
                            draining=self.draining)
        now = time.monotonic()
        for inst in gw.pools.instances.values():
            r = inst.report
            stale = r is None or now - inst.report_time > gw.config.routing.stale_after_s
            if stale or not gw.health.routable(inst.name):
                continue
            out.num_waiting += r.num_waiting
            out.num_running += r.num_running
            out.num_waiting_tokens += r.num_waiting_tokens
            out.kv_pages_total += r.kv_pages_total
            out.kv_pages_free += r.kv_pages_free
            out.tokens_per_s += r.tokens_per_s
            out.generation_tokens_per_s += r.generation_tokens_per_s
            out.max_num_seqs += r.max_num_seqs
            out.max_waiting_requests += r.max_waiting_requests
            out.steps += r.steps
            out.num_preemptions += r.num_preemptions
        out.kv_cache_usage = 1 - out.kv_pages_free / out.kv_pages_total if out.kv_pages_total else 0.0
        return out

    async def GetLoad(self, request, context):
        try:
            self._tenant(context)
        except AuthError as e:
            await _abort(context, e.code, e.details)
        return self._fleet_report()

    async def WatchLoad(self, request, context):
        try:
            self._tenant(context)
        except AuthError as e:
            await _abort(context, e.code, e.details)
        interval = max(10, request.interval_ms or 1000) / 1000.0
        while True:
            yield self._fleet_report()
            await asyncio.sleep(interval)

    async def LoadLoRAAdapter(self, request: pb.LoadLoRAAdapterRequest, context):
        """Admin: loads the adapter on every instance with LoRA on (serving.gateway.lora, docs/lora.md)."""
        try:
            self.gw.auth.check_admin(context.invocation_metadata())
            return await self.gw.lora.load(request.lora_name, request.lora_path)
        except (AuthError, AdapterError) as e:
            await _abort(context, e.code, e.details)

    async def UnloadLoRAAdapter(self, request: pb.UnloadLoRAAdapterRequest, context):
        """Admin: unloads the adapter everywhere; requests in flight on it finish on it."""
        try:
            self.gw.auth.check_admin(context.invocation_metadata())
            n = await self.gw.lora.unload(request.lora_name)
        except (AuthError, AdapterError) as e:
            await _abort(context, e.code, e.details)
        return pb.LoRAAdapterResponse(adapter=pb.LoRAAdapter(name=request.lora_name), requests_in_flight=n)

    async def Drain(self, request, context):
        try:
            self.gw.auth.check_admin(context.invocation_metadata())
        except AuthError as e:
            await _abort(context, e.code, e.details)
        self.draining = not request.resume
        log.info("gateway %s", "draining" if self.draining else "admitting again")
        r = self._fleet_report()
        return pb.DrainResponse(draining=self.draining, num_waiting=r.num_waiting, num_running=r.num_running)


class JobsServicer(gpb_grpc.JobsServicer):
    """Who may call: with authentication on, a tenant key (its own jobs: another tenant's job is NOT_FOUND, as if it
    did not exist) or an admin key (every job); with it off, anyone."""

    def __init__(self, gateway: Gateway):
        self.gw = gateway

    async def _tenant_name(self, context) -> str | None:
        """The caller's tenant; None: may see every job (an admin key, or authentication off)."""
        try:
            t = self.gw.auth.tenant(context.invocation_metadata())
        except AuthError as e:
            await _abort(context, e.code, e.details)
        return None if t is None or t is ADMIN else t.name

    async def SubmitJob(self, request: gpb.SubmitJobRequest, context):
        gw = self.gw
        try:
            tenant = gw.auth.tenant(context.invocation_metadata())
            p = gw.prepare(request.request, tenant)  # every field checked now, not when the job runs
            gw.check_rate(tenant, [p], starts=False)
            name = tenant.name if tenant is not None else request.request.tenant
            return await gw.jobs.submit(request.request, request.callback_url, name, request.idempotency_key)
        except (AuthError, GatewayError, JobError) as e:
            await _abort(context, e.code, e.details, getattr(e, "trailing", ()))

    async def _get(self, request, context) -> gpb.Job:
        tenant = await self._tenant_name(context)
        try:
            job = self.gw.jobs.get(request.job_id)
        except JobError as e:
            await _abort(context, e.code, e.details)
        if tenant is not None and job.tenant != tenant:
            await _abort(context, grpc.StatusCode.NOT_FOUND, f"job_id: no job {request.job_id!r}")
        return job

    async def CancelJob(self, request, context):
        tenant = await self._tenant_name(context)
        await self._get(request, context)  # the owner or an admin; anyone else: NOT_FOUND
        try:
            by = tenant or ("an admin" if self.gw.config.auth_enabled else "a caller (authentication is off)")
            return self.gw.jobs.cancel(request.job_id, by)
        except JobError as e:
            await _abort(context, e.code, e.details)

    async def GetJob(self, request, context):
        return await self._get(request, context)

    async def WatchJob(self, request, context):
        await self._get(request, context)
        async for job in self.gw.jobs.watch(request.job_id):
            yield job


class AdminServicer(gpb_grpc.GatewayAdminServicer):
    def __init__(self, gateway: Gateway):
        self.gw = gateway

    async def _check(self, context) -> None:
        try:
            self.gw.auth.check_admin(context.invocation_metadata())
        except AuthError as e:
            await _abort(context, e.code, e.details)

    def status(self, inst) -> gpb.InstanceStatus:
        gw = self.gw
        node = gw.health.nodes.get(inst.name)
        state = node.state if node else "unknown"
        if state == HEALTHY and inst.report is None:
            state = "unknown"
        out = gpb.InstanceStatus(
            name=inst.name, target=inst.config.target, pool=inst.config.pool, long_lane=inst.config.long_lane,
            state=state, state_reason=node.reason if node else "", inflight=inst.inflight,
            routed_total=inst.routed_total, score=gw.router.last_scores.get(inst.name, 0.0),
            report_age_s=time.monotonic() - inst.report_time if inst.report is not None else -1.0,
            window_latency_s=node.window_latency_s if node else 0.0)
        if inst.report is not None:
            out.last_report.CopyFrom(inst.report)
        return out

    async def ListInstances(self, request, context):
        await self._check(context)
        gw = self.gw
        return gpb.ListInstancesResponse(
            instances=[self.status(i) for _, i in sorted(gw.pools.instances.items())],
            routing_policy=gw.config.routing.policy, config_version=gw.watcher.version)

    async def DrainInstance(self, request, context):
        await self._check(context)
        try:
            inst = self.gw.drain(request.name, request.resume)
        except GatewayError as e:
            await _abort(context, e.code, e.details)
        return self.status(inst)

    async def ReloadConfig(self, request, context):
        await self._check(context)
        applied, error = self.gw.reload_config(force=True)
        return gpb.ReloadConfigResponse(applied=not error, error=error, config_version=self.gw.watcher.version)
