"""Gateway: the configuration, instance pools, router, health tracker, admission and jobs, and the request path
they share: authenticate, validate, rate-limit, choose a lane and a class, wait for a slot (bounded queue), route,
stream from the instance, and retry once elsewhere if it fails before the first token."""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import math
import os
import time
import uuid
from typing import AsyncIterator, Sequence

import grpc
from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.trace import SpanKind, Status, StatusCode

from serving.gateway.admission import CLASSES, Admission, QueueFull, RateLimiter
from serving.gateway.config import ConfigWatcher, GatewayConfig, TenantConfig
from serving.gateway.health import FAILED, HEALTHY, QUARANTINED, HealthTracker, Transition
from serving.gateway.jobs import JobError, JobManager, JobStore
from serving.gateway.kv_index import first_block_extra_keys
from serving.gateway.lora import GatewayAdapters
from serving.gateway.metrics import GatewayMetrics
from serving.gateway.pools import Instance, InstancePools
from serving.gateway.routing import Router, adapter_candidates, prompt_blocks
from serving.gateway.security import Authenticator
from serving.gateway.validation import check_generate, estimate_prompt_tokens
from serving.params import MAX_REQUEST_ID_CHARS, InvalidArgument, ModelLimits
from serving.telemetry.tracing import make_tracer_provider
from serving.wire import meshserve_pb2 as pb
from serving.wire.client import RETRY_PUSHBACK_KEY
from serving.wire.requests import prefix_cache_salt

log = logging.getLogger(__name__)

RETRIABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNKNOWN,
             grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED)
MAX_ATTEMPTS = 2  # the first try and one retry on another instance
PROBE_PROMPT = (3, 4, 5, 6, 7, 8, 9, 10)
CONFIG_POLL_S = 1.0
TOKEN_BURST_S = 10.0  # a token rate limit's default bucket: this many seconds of its rate


class GatewayError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple = ()):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.trailing = trailing


@dataclasses.dataclass(slots=True)
class Prepared:
    request: pb.GenerateRequest  # as forwarded: max_tokens capped, tenant, priority and the instance's request_id set
    tenant: str
    cls: str  # interactive | long | batch (admission queue)
    long: bool
    pools: tuple[str, ...]
    blocks: list
    client_request_id: str = ""  # the id the client sent (or the gateway made): what its responses carry
    tokens: int = 0  # prompt + max_tokens x n: what it counts against the tenant's token rate limit
    adapter: str = ""  # the LoRA adapter it names ("": the base model): routed to an instance holding it
    prompt_ids: list[int] | None = None  # its token ids when the gateway knows them (KV-event affinity)


def instance_request_id(tenant: str, client_id: str) -> str:
    """The request_id an instance sees: `<tenant>/<client's id>/<random>`, so ids that two tenants (or one tenant's
    concurrent retries) reuse never collide on an instance (tenant names have no `/`); past the length limit the
    client's id is hashed."""
    suffix = uuid.uuid4().hex[:16]
    rid = f"{tenant}/{client_id}/{suffix}"
    if len(rid) > MAX_REQUEST_ID_CHARS:
        digest = hashlib.sha256(f"{tenant}/{client_id}".encode()).hexdigest()[:48]
        rid = f"{tenant[:64]}/#{digest}/{suffix}"
    return rid


@dataclasses.dataclass(slots=True)
class Slot:
    instance: Instance
    long: bool
    pool: str


class Gateway:
    def __init__(self, config_path: str, jobs_db: str, *, span_exporter=None, otlp_endpoint: str = "",
                 otlp_ca_file: str = "", service_name: str = "meshserve-gateway"):
        self.watcher = ConfigWatcher(config_path)
        cfg = self.watcher.config
        self.metrics = GatewayMetrics()
        self.router = Router(cfg.routing)
        self.health = HealthTracker(cfg.isolation)
        self.admission = Admission(on_change=self._queue_gauges)
        self.rate_limiter = RateLimiter()
        self.tenant_inflight: dict[str, int] = {}  # tenant -> its requests in the gateway (queued or streaming)
        self.auth = Authenticator(cfg)
        self.pools = InstancePools(self._on_report, self._on_failure)
        self.lora = GatewayAdapters(lambda: [i for i in self.pools.instances.values() if self.health.routable(i.name)],
                                    lambda: self.config.instance_admin_key_file)
        self.limits = ModelLimits()
        self.model_name = ""  # the instances' served model name (the HTTP API's `model`)
        self.draining = False  # both APIs refuse new requests
        self.tokenizer = None
        self._tokenizer_dir = None
        self.long_inflight = 0
        self.provider = make_tracer_provider(service_name, otlp_endpoint=otlp_endpoint, otlp_ca_file=otlp_ca_file,
                                             exporter=span_exporter)
        self.tracer = self.provider.get_tracer("meshserve.gateway") if self.provider else None
        self.jobs = JobManager(JobStore(jobs_db), self._job_stream, lambda: self.config,
                               on_state=lambda s: self.metrics.jobs.labels(s).inc())
        self._tasks: list[asyncio.Task] = []
        self._probing: set[str] = set()
        self._last_steps: dict[str, int] = {}

    @property
    def config(self) -> GatewayConfig:
        return self.watcher.config

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        self._apply(self.config)
        self._tasks = [asyncio.ensure_future(self._window_loop()), asyncio.ensure_future(self._config_loop())]
        n = self.jobs.start()
        log.info("gateway started: %d pools, %d instances, policy %s, %d unfinished jobs resumed",
                 len(self.config.pools), len(self.config.instances), self.config.routing.policy, n)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.jobs.stop()
        await self.lora.close()
        self.jobs.store.close()
        await self.pools.close()
        if self.provider is not None:
            self.provider.shutdown()

    def _apply(self, cfg: GatewayConfig) -> None:
        added, removed = self.pools.apply(cfg)
        for inst in added:
            self.health.add(inst.name)
            self.metrics.set_state(inst.name, HEALTHY)
        for inst in removed:
            if inst.name not in self.pools.instances:
                self.health.remove(inst.name)
                self.router.prefix_index.forget(inst.name)
                self.metrics.forget(inst.name)
        self.router.reconfigure(cfg.routing)
        self.health.config = cfg.isolation
        self.auth.reconfigure(cfg)
        if cfg.tokenizer and cfg.tokenizer != self._tokenizer_dir:
            self._load_tokenizer(cfg.tokenizer, "configured")
        self.admission.notify()

    def _load_tokenizer(self, path: str, why: str) -> None:
        """The tokenizer the gateway measures prompts with and its HTTP API renders chats with."""
        self._tokenizer_dir = path
        self.tokenizer = None
        try:
            from models.tokenizer import Tokenizer
            self.tokenizer = Tokenizer.from_pretrained(path)
            log.info("tokenizer: %s (%s)", path, why)
        except Exception as e:  # noqa: BLE001 - lengths fall back to estimates, chats are rendered by instances
            log.error("tokenizer %s: cannot load (%s); estimating prompt lengths, instances render chats", path, e)

    def reload_config(self, force: bool = False) -> tuple[bool, str]:
        applied = self.watcher.poll(force=force)
        if applied:
            self._apply(self.config)
            self.metrics.config_reloads.labels("applied").inc()
        elif self.watcher.last_error:
            self.metrics.config_reloads.labels("rejected").inc()
        return applied, self.watcher.last_error

    async def _config_loop(self) -> None:
        last_error = ""
        while True:
            await asyncio.sleep(CONFIG_POLL_S)
            try:
                applied = self.watcher.poll()
                if applied:
                    self._apply(self.config)
                    self.metrics.config_reloads.labels("applied").inc()
                elif self.watcher.last_error and self.watcher.last_error != last_error:
                    self.metrics.config_reloads.labels("rejected").inc()
                last_error = self.watcher.last_error
            except Exception:  # noqa: BLE001 - keep the loop alive
                log.exception("configuration reload failed")

    # ------------------------------------------------------------------ instance events
    def _on_report(self, inst: Instance) -> None:
        r = inst.report
        if not r.serving and self.health.state(inst.name) == HEALTHY:
            # Starting, draining or its engine died: out until it serves again for M windows.
            self._record(self.health.mark_failed(inst.name, "its load report says not serving" + (
                " (draining)" if r.draining else "")))
        if not self.limits.vocab_size and inst.model_info is not None:
            mi = inst.model_info
            self.limits = ModelLimits(vocab_size=mi.vocab_size, max_model_len=mi.max_model_len,
                                      max_request_bytes=mi.max_request_bytes or self.limits.max_request_bytes)
            self.model_name = mi.served_model_name or os.path.basename(os.path.normpath(mi.model)) or "model"
            if not self._tokenizer_dir and mi.has_tokenizer and os.path.exists(mi.model):
                # No tokenizer configured: the instances' own, where this host can read their model directory.
                self._load_tokenizer(mi.model, f"the model directory instance {inst.name} reports")
        self.lora.on_report(inst)  # one that lacks an adapter loaded through the gateway gets it
        self.admission.notify()

    def _on_failure(self, inst: Instance, reason: str) -> None:
        self._record(self.health.mark_failed(inst.name, reason))

    def _record(self, t: Transition | None) -> None:
        if t is None:
            return
        level = logging.INFO if t.new == HEALTHY else logging.WARNING
        log.log(level, "instance %s: %s -> %s (%s)", t.name, t.old, t.new, t.reason)
        self.metrics.transitions.labels(t.name, t.old, t.new).inc()
        self.metrics.set_state(t.name, t.new)
        if t.new == HEALTHY:
            self.admission.notify()

    def drain(self, name: str, resume: bool) -> Instance:
        inst = self.pools.instances.get(name)
        if inst is None:
            raise GatewayError(grpc.StatusCode.NOT_FOUND, f"name: no instance {name!r}; instances: "
                               f"{', '.join(sorted(self.pools.instances))}")
        self._record(self.health.drain(name, resume))
        return inst

    async def _window_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.isolation.window_s)
            try:
                self._end_window()
            except Exception:  # noqa: BLE001 - keep isolating
                log.exception("health window failed")

    def _end_window(self) -> None:
        now = time.monotonic()
        stale = self.config.routing.stale_after_s
        fallback = {}
        for name, inst in self.pools.instances.items():
            r = inst.report
            if r is not None and now - inst.report_time <= stale:
                if r.steps > self._last_steps.get(name, r.steps) and r.num_running > 0:
                    fallback[name] = r.step_time_p50_s
                self._last_steps[name] = r.steps
        for t in self.health.end_window(fallback):
            self._record(t)
        silent = self.config.isolation.silent_after_s
        for name, inst in self.pools.instances.items():
            # A hung instance (stopped, swapping, a wedged event loop) keeps its connections open and answers
            # nothing: its load stream going quiet is the sign. Failed, it is probed and readmitted as any other.
            if silent and inst.report is not None and now - inst.report_time > silent \
                    and self.health.state(name) == HEALTHY:
                self._record(self.health.mark_failed(name, f"no load report for {now - inst.report_time:.1f}s "
                                                           "(hung or unreachable)"))
        for name, inst in self.pools.instances.items():
            state = self.health.state(name)
            if state in (QUARANTINED, FAILED) and name not in self._probing:
                self._probing.add(name)
                asyncio.ensure_future(self._probe(inst, state))
        cap = self.config.admission.max_inflight_per_instance
        for pool in self.config.pools:
            members = [i for i in self.pools.instances.values() if i.config.pool == pool]
            self.metrics.pool_inflight.labels(pool).set(sum(i.inflight for i in members))
            self.metrics.pool_capacity.labels(pool).set(cap * sum(1 for i in members if self.health.routable(i.name)))
        self.admission.notify()

    async def _probe(self, inst: Instance, state: str) -> None:
        """Quarantined: a short generation, its inter-token gaps measured. Failed: a health check and a load
        report."""
        iso = self.config.isolation
        try:
            ok = await inst.health_check(iso.health_check_timeout_s)
            if state == FAILED:
                age = time.monotonic() - inst.report_time
                fresh = inst.report is not None and age <= self.config.routing.stale_after_s and inst.report.serving
                self.health.probe_result(inst.name, ok and fresh)
                return
            gaps, last = [], None
            if ok:
                req = pb.GenerateRequest(request_id=f"gw-probe-{uuid.uuid4().hex[:12]}", tenant="gateway-probe")
                req.token_ids.ids.extend(PROBE_PROMPT)
                req.sampling.max_tokens = iso.probe_max_tokens
                req.sampling.temperature = 0.0
                req.sampling.ignore_eos = True
                try:
                    async for _ in inst.stub.Generate(req, timeout=max(2.0, 4 * iso.window_s),
                                                      metadata=inst.metadata()):
                        now = time.monotonic()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
                except grpc.RpcError:
                    ok = False
            self.health.probe_result(inst.name, ok and bool(gaps), gaps)
        finally:
            self._probing.discard(inst.name)

    # ------------------------------------------------------------------ request path
    def prepare(self, request: pb.GenerateRequest, tenant: TenantConfig | None) -> Prepared:
        """Validates every field (the server's codes and messages), caps max_tokens, scopes the request_id to the
        tenant, counts its tokens, picks lane and class."""
        cfg = self.config
        req = pb.GenerateRequest()
        req.CopyFrom(request)
        adm = cfg.admission
        asked = req.sampling.max_tokens if req.sampling.HasField("max_tokens") else adm.default_max_tokens
        if adm.max_tokens_cap and asked > adm.max_tokens_cap:
            req.sampling.max_tokens = adm.max_tokens_cap  # ends with finish reason length
        elif not req.sampling.HasField("max_tokens"):
            req.sampling.max_tokens = adm.default_max_tokens
        if req.kv_export or req.HasField("kv_source"):  # instance to instance: a client never sets them
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "kv_export / kv_source: set by the gateway for "
                               "disaggregated requests, never by a client; leave them unset")
        try:
            sampling, ids = check_generate(req, self.limits)
        except InvalidArgument as e:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        adapter = req.sampling.adapter
        if adapter:
            self._check_adapter(adapter, tenant)
        if tenant is not None:
            req.tenant = tenant.name
            if tenant.priority == "batch":
                req.priority = pb.PRIORITY_BATCH
        client_id = req.request_id or "gw-" + uuid.uuid4().hex
        req.request_id = instance_request_id(req.tenant, client_id)
        lane = cfg.long_lane
        prompt_tokens = len(ids) if ids is not None else estimate_prompt_tokens(req, self.tokenizer)
        long = bool(lane.threshold_tokens) and prompt_tokens + (sampling.max_tokens or 0) > lane.threshold_tokens
        cls = "long" if long else ("batch" if req.priority == pb.PRIORITY_BATCH else "interactive")
        blocks = prompt_blocks(req, cfg.routing.prefix_block_chars) if cfg.routing.policy == "load_aware" else []
        tokens = prompt_tokens + (sampling.max_tokens or 0) * sampling.n
        return Prepared(req, req.tenant, cls, long, tenant.pools if tenant is not None else (), blocks, client_id,
                        tokens, adapter, list(ids) if ids is not None else None)

    def _held(self, p: Prepared, instances) -> dict[str, float] | None:
        """Per instance whose KV events the gateway follows (load-aware routing, a token prompt): the fraction of
        the prompt's leading blocks it holds in any KV tier under the request's LoRA adapter and cache salt."""
        if p.prompt_ids is None or self.config.routing.policy != "load_aware":
            return None
        held, keys = {}, {}
        extra = first_block_extra_keys(p.adapter, prefix_cache_salt(p.request))
        for inst in instances:
            index = inst.kv_index
            if index is not None and index.block_size:
                if index.block_size not in keys:
                    keys[index.block_size] = index.prompt_keys(p.prompt_ids, extra)
                held[inst.name] = index.match(keys[index.block_size])
        return held

    def adapters(self) -> list[str]:
        """The LoRA adapters some instance serves (by their load reports), sorted."""
        return sorted({a for i in self.pools.instances.values() if i.report is not None
                       for a in i.report.lora_adapters})

    def _check_adapter(self, adapter: str, tenant: TenantConfig | None) -> None:
        """PERMISSION_DENIED when the tenant may not name `adapter`; NOT_FOUND when no instance serves it."""
        if tenant is not None and tenant.adapters is not None and adapter not in tenant.adapters:
            allowed = ", ".join(tenant.adapters) or "none: the base model only"
            raise GatewayError(grpc.StatusCode.PERMISSION_DENIED, f"sampling.adapter: tenant {tenant.name!r} may not "
                               f"use LoRA adapter {adapter!r} (its adapters: {allowed})")
        served = self.adapters()
        if adapter not in served:
            raise GatewayError(grpc.StatusCode.NOT_FOUND, f"sampling.adapter: LoRA adapter {adapter!r} is not served "
                               f"by any instance (served: {', '.join(served) or 'none'})")

    def check_rate(self, tenant: TenantConfig | None, prepared: Sequence[Prepared] = (), *,
                   starts: bool = True) -> None:
        """The tenant's rate limits, one request and the tokens of its `prepared` prompts (prompt + max_tokens x n
        each), and when it `starts` now (not a job), its in-flight cap. Raises GatewayError (RESOURCE_EXHAUSTED; a
        retry hint when waiting helps), charging nothing then."""
        if tenant is None:
            return
        name, rl = tenant.name, tenant.rate_limit
        inflight = self.tenant_inflight.get(name, 0)
        if starts and tenant.max_inflight and inflight + max(1, len(prepared)) > tenant.max_inflight:
            self.metrics.rate_limited.labels(name).inc()
            ms = self.config.admission.retry_pushback_ms
            raise GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"tenant {name!r} has {inflight} requests in "
                               f"flight, its limit is {tenant.max_inflight} (max_inflight); retry when one has "
                               "finished", ((RETRY_PUSHBACK_KEY, str(ms)),))
        tokens = sum(p.tokens for p in prepared)
        token_burst = rl.token_burst or max(1.0, rl.tokens_per_s * TOKEN_BURST_S)
        now = time.monotonic()
        wait_requests = self.rate_limiter.wait(("requests", name), rl.requests_per_s, rl.burst, 1, now)
        wait_tokens = self.rate_limiter.wait(("tokens", name), rl.tokens_per_s, token_burst, tokens, now)
        if wait_requests == 0 and wait_tokens == 0:
            self.rate_limiter.take(("requests", name), rl.requests_per_s, rl.burst, 1, now)
            self.rate_limiter.take(("tokens", name), rl.tokens_per_s, token_burst, tokens, now)
            return
        self.metrics.rate_limited.labels(name).inc()
        if wait_tokens == math.inf:
            raise GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"this request counts {tokens} tokens (prompt + "
                               f"max_tokens x n, over its prompts), more than tenant {name!r} may use at once "
                               f"({token_burst:g}, rate_limit.token_burst); lower max_tokens or n, or send fewer "
                               "prompts")
        wait = max(wait_requests, wait_tokens)
        limit = (f"{rl.requests_per_s:g} requests/s" if wait_requests >= wait_tokens else
                 f"{rl.tokens_per_s:g} tokens/s (this request counts {tokens}: prompt + max_tokens x n)")
        raise GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"tenant {name!r} is over its rate limit of {limit}; "
                           f"retry in {wait:.2f}s", ((RETRY_PUSHBACK_KEY, str(max(1, int(wait * 1000)))),))

    def _lane_members(self, p: Prepared, pool: str, now: float) -> list[Instance]:
        stale = self.config.routing.stale_after_s
        members = [i for i in self.pools.instances.values() if i.config.pool == pool and
                   self.health.routable(i.name) and i.reporting_serving(now, stale)]
        if p.long:
            return [i for i in members if i.config.long_lane]
        return [i for i in members if not i.config.long_lane] or members

    def _try_route(self, p: Prepared, exclude: set[str]) -> Slot | None:
        cfg = self.config
        if p.long and self.long_inflight >= cfg.long_lane.max_concurrent:
            return None
        now = time.monotonic()
        cap = cfg.admission.max_inflight_per_instance
        for index, pool in enumerate(p.pools or cfg.pools):
            free = [i for i in self._lane_members(p, pool, now) if i.inflight < cap and i.name not in exclude]
            if not free:
                continue  # full (or empty): spill over to the next pool
            by_name = {i.name: i for i in free}
            views = [i.view(now, cap) for i in free]
            if p.adapter:  # affinity: an instance with the adapter in a slot, else with a free slot
                views = adapter_candidates(views, p.adapter)
                if not views:
                    continue
            chosen = self.router.choose(views, p.blocks, self._held(p, free))
            inst = by_name[chosen.name]
            self.router.record(p.blocks, inst.name)
            inst.inflight += 1
            inst.sent_since_report += 1
            inst.routed_total += 1
            if p.long:
                inst.long_inflight += 1
                self.long_inflight += 1
                self.metrics.long_inflight.set(self.long_inflight)
            self.metrics.routed.labels(inst.name, pool).inc()
            self.metrics.inflight.labels(inst.name).set(inst.inflight)
            if index > 0:
                self.metrics.spillovers.labels(pool).inc()
            return Slot(inst, p.long, pool)
        return None

    def _release(self, slot: Slot) -> None:
        inst = slot.instance
        inst.inflight -= 1
        if slot.long:
            inst.long_inflight -= 1
            self.long_inflight -= 1
            self.metrics.long_inflight.set(self.long_inflight)
        self.metrics.inflight.labels(inst.name).set(inst.inflight)
        self.admission.notify()

    def _has_candidates(self, p: Prepared, exclude: set[str]) -> bool:
        now = time.monotonic()
        return any(i.name not in exclude for pool in (p.pools or self.config.pools)
                   for i in self._lane_members(p, pool, now))

    async def _acquire(self, p: Prepared, exclude: set[str], deadline: float) -> Slot:
        cfg = self.config
        now = time.monotonic()
        if not self._has_candidates(p, exclude):
            lane = "long-lane " if p.long else ""
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"no healthy {lane}instance"
                               + (" left to retry on" if exclude else "") + "; retry later")
        bound = cfg.long_lane.max_queue if p.cls == "long" else cfg.admission.queue_bound(p.cls)
        try:
            slot = await self.admission.acquire(p.cls, bound, lambda: self._try_route(p, exclude),
                                                max(0.0, deadline - now), self._release)
        except QueueFull as e:
            ms = cfg.admission.retry_pushback_ms
            raise GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e}; retry in {ms / 1000:g}s",
                               ((RETRY_PUSHBACK_KEY, str(ms)),)) from None
        except asyncio.TimeoutError:
            raise GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed while the request waited "
                               "in the gateway's queue for a free instance") from None
        return slot

    def _queue_gauges(self, admission: Admission) -> None:
        for c in CLASSES:
            self.metrics.queue_depth.labels(c).set(admission.depth(c))

    async def stream(self, p: Prepared, deadline: float, parent=None, *, count: bool = True
                     ) -> AsyncIterator[pb.GenerateResponse]:
        """Routes and streams; retries once on another instance if the first fails before its first token; responses
        carry the client's request_id. `count`: in the tenant's requests in flight (jobs are not). Raises
        GatewayError."""
        span = None
        if self.tracer is not None:
            span = self.tracer.start_span("gateway.generate", context=parent, kind=SpanKind.SERVER, attributes={
                "meshserve.request_id": p.client_request_id, "meshserve.instance_request_id": p.request.request_id,
                "meshserve.tenant": p.tenant, "meshserve.class": p.cls})
        error = None
        if count:
            self.tenant_inflight[p.tenant] = self.tenant_inflight.get(p.tenant, 0) + 1
        try:
            if (self.config.disaggregation.enabled and p.request.sampling.n <= 1
                    and not p.request.sampling.HasField("structured")):
                gen = self._disaggregated(p, deadline, span)
            else:
                gen = self._attempts(p, p.request, deadline, span)
            try:
                async for r, _ in gen:
                    yield r
            finally:
                await gen.aclose()
        except GatewayError as e:
            error = e
            raise
        finally:
            if count:
                left = self.tenant_inflight.get(p.tenant, 1) - 1
                if left > 0:
                    self.tenant_inflight[p.tenant] = left
                else:
                    self.tenant_inflight.pop(p.tenant, None)
            if span is not None:
                if error is not None:
                    span.set_status(Status(StatusCode.ERROR, error.details))
                span.end()

    async def _attempts(self, p: Prepared, request: pb.GenerateRequest, deadline: float, span, stage: str = "both"
                        ) -> AsyncIterator[tuple[pb.GenerateResponse, Instance]]:
        """Routes `request` (p's, or a disaggregated stage of it) among p's pools and streams (response, instance);
        retries once on another instance if the first fails before its first response. Raises GatewayError."""
        exclude: set[str] = set()
        for attempt in range(1, MAX_ATTEMPTS + 1):
            slot = await self._acquire(p, exclude, deadline)
            inst = slot.instance
            metadata = []
            if span is not None:
                span.add_event("routed", {"meshserve.instance": inst.name, "meshserve.attempt": attempt,
                                           "meshserve.stage": stage})
                carrier: dict[str, str] = {}
                inject(carrier, context=trace.set_span_in_context(span))
                metadata = list(carrier.items())
            started, last, call = False, None, None
            try:
                call = inst.stub.Generate(request, timeout=max(0.001, deadline - time.monotonic()),
                                          metadata=inst.metadata(metadata))
                async for r in call:
                    r.request_id = p.client_request_id
                    now = time.monotonic()
                    if last is not None:
                        gap = now - last
                        self.health.observe_latency(inst.name, gap)
                        inst.observe_latency(gap)
                    last = now
                    # a streaming handoff (a prefill's first response, no tokens) is not the answer's start: a
                    # failure after it is still retried
                    started = started or not (r.HasField("kv_transfer") and r.kv_transfer.streaming)
                    yield r, inst
                return
            except grpc.RpcError as e:
                code, details = e.code(), e.details() or ""
                if code == grpc.StatusCode.UNAVAILABLE:
                    self._record(self.health.mark_failed(inst.name, f"Generate: UNAVAILABLE: {details}"))
                if started:
                    if code in RETRIABLE or code == grpc.StatusCode.CANCELLED:
                        raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"instance {inst.name} failed after the "
                                           f"response had started ({code.name}: {details}); not retried, since "
                                           "part of the answer was already sent") from None
                    raise GatewayError(code, details) from None
                if (code in RETRIABLE and attempt < MAX_ATTEMPTS and time.monotonic() < deadline
                        and self._has_candidates(p, exclude | {inst.name})):
                    log.warning("request %s: %s failed before its first token (%s: %s); retrying elsewhere",
                                p.request.request_id, inst.name, code.name, details)
                    self.metrics.retries.labels(code.name).inc()
                    exclude.add(inst.name)
                    continue
                trailing = tuple((k, v) for k, v in (e.trailing_metadata() or ()) if k == RETRY_PUSHBACK_KEY)
                if stage == "prefill" and code in RETRIABLE:  # (a dead instance's "Socket closed" names nothing)
                    details = (f"the prefill stage failed on prefill instance {inst.name} ({inst.config.target}) "
                               f"before its first token ({code.name}: {details}); retry the request")
                raise GatewayError(code, details, trailing) from None
            finally:
                if call is not None:
                    call.cancel()
                self._release(slot)

    async def _disaggregated(self, p: Prepared, deadline: float, span
                             ) -> AsyncIterator[tuple[pb.GenerateResponse, Instance]]:
        """Prefill on a prefill-pool instance (kv_export: the first token, pages held there), then decode on a
        decode-pool instance that pulls those pages (kv_source); the client sees one stream. A prompt of several
        prefill chunks is handed off at once (a streaming transfer): the decode stage starts then and pulls the
        chunks' pages as they end; its responses follow the prefill's. Usage is the client's request's: the first
        token counts as output, not as the decode instance's prompt."""
        pd = self.config.disaggregation
        req = pb.GenerateRequest()
        req.CopyFrom(p.request)
        if not req.sampling.HasField("seed"):  # both stages draw from the same seed (by output index)
            req.sampling.seed = int.from_bytes(os.urandom(4), "little") >> 1
        base = pb.GenerateRequest()
        base.CopyFrom(req)
        req.kv_export = True
        handoff, source, last_token = None, None, None
        early: tuple[str, asyncio.Task, asyncio.Queue] | None = None  # (transfer id, decode stage, its responses)
        t0 = time.monotonic()
        try:
            async for r, inst in self._attempts(dataclasses.replace(p, pools=pd.prefill_pools), req, deadline, span,
                                                "prefill"):
                if r.HasField("kv_transfer") and r.kv_transfer.streaming:
                    if early is not None:  # a retried prefill: its new transfer replaces the failed one's
                        await self._cancel(early[1])
                    dreq = self._decode_request(base, inst, r.kv_transfer, None)
                    queue: asyncio.Queue = asyncio.Queue()
                    # (a failed early stage leaves the transfer to its prefill, which is still running: released
                    # below once the prefill handed off)
                    early = (r.kv_transfer.transfer_id, asyncio.ensure_future(self._pump(self._decode_stage(
                        p, dreq, deadline, span, inst, r.kv_transfer.transfer_id, release=False), queue)), queue)
                    continue
                if r.token_ids:
                    last_token = r.token_ids[-1]
                if r.HasField("kv_transfer"):
                    handoff, source = r.kv_transfer, inst
                    r.ClearField("kv_transfer")
                    r.ClearField("timing")
                    r.usage.completion_tokens = r.usage.cached_prompt_tokens = 0
                elif r.finish_reason:
                    self.metrics.disaggregated.labels("prefill_only").inc()
                yield r, inst
            if handoff is None:  # the first token ended it (EOS, a stop, max_tokens 1)
                return
            self.metrics.prefill_seconds.observe(time.monotonic() - t0)
            if early is not None and early[0] == handoff.transfer_id:
                queue = early[2]
                while (item := await queue.get()) is not None:
                    if isinstance(item, BaseException):
                        await self._release_transfer(source, handoff.transfer_id)
                        raise item
                    yield item
                return
            dreq = self._decode_request(base, source, handoff, last_token)
            stage = self._decode_stage(p, dreq, deadline, span, source, handoff.transfer_id)
            try:
                async for item in stage:
                    yield item
            finally:
                await stage.aclose()
        finally:
            if early is not None:
                await self._cancel(early[1])

    @staticmethod
    def _decode_request(base: pb.GenerateRequest, source: Instance, handoff: pb.KVTransfer,
                        first_token: int | None) -> pb.GenerateRequest:
        """The decode stage's request: the client's, continued from `handoff` on `source` (first_token None: a
        streaming transfer, whose first token comes with its pages)."""
        dreq = pb.GenerateRequest()
        dreq.CopyFrom(base)
        dreq.kv_source.CopyFrom(pb.KVSource(address=source.config.target, transfer_id=handoff.transfer_id,
                                            prompt_token_ids=handoff.prompt_token_ids))
        if first_token is None:
            dreq.kv_source.streamed = True
        else:
            dreq.kv_source.first_token_id = first_token
        return dreq

    @staticmethod
    async def _pump(stage: AsyncIterator, queue: asyncio.Queue) -> None:
        """Runs a decode stage started on a streaming handoff into `queue` (its items, then None or its error)."""
        try:
            async for item in stage:
                queue.put_nowait(item)
            queue.put_nowait(None)
        except GatewayError as e:
            queue.put_nowait(e)
        finally:
            await stage.aclose()

    @staticmethod
    async def _cancel(task: asyncio.Task) -> None:
        if not task.done():
            task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            if not task.cancelled():  # this coroutine's own cancel
                raise
        except Exception:  # noqa: BLE001 - ended with an error nobody reads any more
            pass

    async def _decode_stage(self, p: Prepared, dreq: pb.GenerateRequest, deadline: float, span, source: Instance,
                            transfer_id: str, *, release: bool = True
                            ) -> AsyncIterator[tuple[pb.GenerateResponse, Instance]]:
        """The decode stage (with retries); on its failure, frees the transfer on `source` (`release`) and raises
        UNAVAILABLE for a retriable failure (the client has its first token)."""
        pd = self.config.disaggregation
        try:
            # (the decode instance counts the first token as output: its usage is the client's request's)
            async for r, inst in self._attempts(dataclasses.replace(p, pools=pd.decode_pools), dreq, deadline, span,
                                                "decode"):
                if r.finish_reason:  # counted before the last yield: a caller may stop reading after it
                    self.metrics.disaggregated.labels("prefill_decode").inc()
                yield r, inst
        except GatewayError as e:
            self.metrics.disaggregated.labels("decode_failed").inc()
            if release:
                await self._release_transfer(source, transfer_id)
            if e.code not in RETRIABLE:
                raise
            # (e.g. ABORTED: the decode side's pull from a prefill instance that died) the client's stream has its
            # first token: it ends with UNAVAILABLE, retried by nobody but the client
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"the decode stage failed after the first token was sent "
                               f"by prefill instance {source.name} ({source.config.target}) ({e.code.name}: "
                               f"{e.details}); retry the request") from None

    async def _release_transfer(self, inst: Instance, transfer_id: str) -> None:
        """After a failed decode stage: frees the prefill instance's pages now rather than at its timeout (best
        effort: a dead or unreachable instance releases nothing, and its pages died with it)."""
        try:
            await inst.stub.ReleaseKV(pb.ReleaseKVRequest(transfer_id=transfer_id), timeout=5.0,
                                      metadata=inst.metadata())
        except grpc.RpcError as e:
            log.warning("ReleaseKV %s on %s: %s", transfer_id, inst.name, e.code().name)

    def parent_context(self, metadata):
        return extract({k: v for k, v in (metadata or ()) if isinstance(v, str)})

    # ------------------------------------------------------------------ jobs
    async def _job_stream(self, request: pb.GenerateRequest, tenant_name: str) -> AsyncIterator[pb.GenerateResponse]:
        tenant = next((t for t in self.config.tenants if t.name == tenant_name), None)
        try:
            p = self.prepare(request, tenant)
            deadline = time.monotonic() + self.config.admission.request_timeout_s
            async for r in self.stream(p, deadline, count=False):
                yield r
        except GatewayError as e:
            raise JobError(e.code, e.details) from None
