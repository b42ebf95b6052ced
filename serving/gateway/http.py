"""`GatewayHTTP`: the gateway's frontend of the OpenAI-compatible HTTP API (serving.api.app.OpenAIApp,
`--http_port`), on the gRPC server's event loop. Each OpenAI request becomes meshserve.v1 GenerateRequests (one per
prompt) that take the gRPC path: `Authorization: Bearer` key -> tenant (its rate limit, priority and pools), the same
checks, admission queues, long lane, load-aware routing with prefix affinity, quarantine, and the retry before the
first token. With a tokenizer (the configuration's `tokenizer`, else the instances' model directory where the gateway
can read it) the gateway renders chats itself, so affinity and lane come from the exact prompt tokens; without one,
text and chat go on for the instance to render. Details: docs/gateway.md."""
from __future__ import annotations

import logging
import math
import time

import grpc

from serving.api import protocol
from serving.api.app import ChatParsers, OpenAIApp
from serving.api.asgi import ERROR_CODES, MergedRun, internal_error
from serving.api.guard import HttpLimits
from serving.api.protocol import ApiError, EngineRequest
from serving.api.responses import Delta, TokenLogprob
from serving.gateway.app import Gateway, GatewayError, Prepared
from serving.gateway.lora import AdapterError
from serving.gateway.security import AuthError
from serving.params import ModelLimits
from serving.wire import meshserve_pb2 as pb
from serving.wire.client import RETRY_PUSHBACK_KEY, generate_request

log = logging.getLogger(__name__)

FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}
STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
          grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403,
          grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
          grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504}
# The gRPC API's field names in messages, as the OpenAI request names them.
_PROMPT_FIELDS = ("token_ids", "text", "chat.messages")


def api_error(e: GatewayError | AuthError, *, field: str = "prompt", renames: dict | None = None) -> ApiError:
    """A gateway or instance status as an OpenAI error: a bad field named as the HTTP request names it, a rate or
    queue limit with Retry-After."""
    status = STATUS.get(e.code, 500)
    if status == 400:
        details = e.details
        for name in _PROMPT_FIELDS:
            if details.startswith(name):
                details = field + details[len(name):]
                break
        code = "context_length_exceeded" if "context" in details and "tokens" in details else None
        return protocol.api_error(ValueError(details), renames, code=code)
    headers = {}
    if status == 429:
        ms = next((int(v) for k, v in getattr(e, "trailing", ()) if k == RETRY_PUSHBACK_KEY), 1000)
        headers["Retry-After"] = str(max(1, math.ceil(ms / 1000)))
    code = {429: "rate_limit_exceeded", 401: "invalid_api_key"}.get(status)
    return ApiError(status, e.details, code=code, headers=headers)


def lora_api_error(e: AdapterError, param: str) -> ApiError:
    """A refused LoRA load or unload as vLLM answers it: 404 for an unknown adapter (lora_name), 403 for a path an
    instance may not read, 400 for one that does not fit (the instance's message), 503 with no instance to load on."""
    status = STATUS.get(e.code, 500)
    if status == 404:
        return ApiError(404, e.details, param="lora_name", code="model_not_found")
    return ApiError(status, e.details, param=param if status == 400 else ("lora_path" if status == 403 else None))


def delta(r: pb.GenerateResponse) -> Delta:
    lps = [TokenLogprob(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in r.logprobs]
    d = Delta(r.index, r.text, lps or None, prompt_tokens=r.usage.prompt_tokens, token_ids=list(r.token_ids))
    if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
        d.finish_reason = FINISH.get(r.finish_reason, "stop")
        d.completion_tokens, d.cached_tokens = r.usage.completion_tokens, r.usage.cached_prompt_tokens
    return d


class _GatewayRun(MergedRun):
    """The gateway streams of one HTTP request (one per prompt), merged as they come; `close` cancels the ones
    still running (the instances abort them). Counted in the gateway's request metrics like gRPC requests."""

    def __init__(self, api: GatewayHTTP, prepared: list[Prepared], fields: list[str], n: int, deadline: float,
                 parent, renames: dict):
        super().__init__(len(prepared), n)
        self.api, self.gw = api, api.gw
        self.fields, self.renames = fields, renames
        self.rids = [p.request.request_id for p in prepared]
        self.t0 = time.monotonic()
        self.first = True
        self.code = grpc.StatusCode.OK
        for i, p in enumerate(prepared):
            self.start(i, self.gw.stream(p, deadline, parent))

    def take(self, i: int, r) -> Delta:
        if isinstance(r, Exception):
            if isinstance(r, GatewayError):
                self.code = r.code
                raise api_error(r, field=self.fields[i], renames=self.renames)
            self.code = grpc.StatusCode.INTERNAL
            rid = self.rids[i]
            log.error("HTTP request %s failed: %s: %s", rid, type(r).__name__, r)  # the detail stays here
            raise internal_error(rid)
        if self.first:
            self.first = False
            self.gw.metrics.ttft.observe(time.monotonic() - self.t0)
        return delta(r)

    def end(self) -> None:
        if not self.done and self.code == grpc.StatusCode.OK:
            self.code = grpc.StatusCode.CANCELLED  # the client left
        elif self.done:
            self.gw.metrics.e2e.observe(time.monotonic() - self.t0)
        self.gw.metrics.requests.labels(self.code.name).inc()


class GatewayHTTP:
    """The gateway's frontend of the OpenAI app (serving.api.app.Frontend); `start` serves the app on the running
    loop, `stop` closes it."""
    render_elsewhere = True  # without a tokenizer, text and chats go on for an instance to render

    def __init__(self, gateway: Gateway, limits: HttpLimits = HttpLimits()):
        self.gw = gateway
        self.api = OpenAIApp(self, title="meshserve gateway",
                             description="OpenAI-compatible API of a meshserve gateway", limits=limits)
        self.app = self.api.app

    # ------------------------------------------------------------------ the frontend
    @property
    def tokenizer(self):
        return self.gw.tokenizer

    def model_name(self) -> str:
        name = self.gw.model_name
        if not name:
            raise ApiError(503, "the gateway has not heard from an instance yet (starting); retry")
        return name

    def model_card(self) -> dict:
        return dict(max_model_len=self.gw.limits.max_model_len or None)

    def limits(self) -> ModelLimits:
        return self.gw.limits

    def parsers(self) -> ChatParsers:
        """The configuration's parsers, else those the instances report (ModelInfo); the instances' grammars apply
        after the reasoning when they have a reasoning parser."""
        tool, reasoning = self.gw.config.tool_call_parser, self.gw.config.reasoning_parser
        mi = next((i.model_info for i in self.gw.pools.instances.values() if i.model_info is not None), None)
        if mi is None:
            return ChatParsers(tool, reasoning)
        return ChatParsers(tool or mi.tool_call_parser, reasoning or mi.reasoning_parser, bool(mi.reasoning_parser))

    def refusal(self) -> ApiError | None:
        return ApiError(503, "the gateway is draining; send it elsewhere") if self.gw.draining else None

    def unhealthy(self) -> ApiError | None:
        gw = self.gw
        if gw.draining:
            return ApiError(503, "the gateway is draining")
        if not any(gw.health.routable(name) and i.report is not None and i.report.serving
                   for name, i in gw.pools.instances.items()):
            return ApiError(503, "no instance is serving yet")
        return None

    def authorize(self, headers):
        """The tenant of the request's `Authorization: Bearer` key (None without keys configured); checked by the
        guard before the body is read, again by the route for the tenant."""
        try:
            return self.gw.auth.tenant(headers)
        except AuthError as e:
            raise api_error(e) from None

    def count_error(self, e: ApiError) -> None:
        self.gw.metrics.requests.labels(ERROR_CODES.get(e.status, "INTERNAL")).inc()

    def adapters(self) -> list[dict]:
        """The LoRA adapters the instances report serving (their paths are the instances' business)."""
        return [{"name": a} for a in self.gw.adapters()]

    def authorize_admin(self, request) -> None:
        try:
            self.gw.auth.check_admin(request.headers.items())
        except AuthError as e:
            raise api_error(e) from None

    async def load_adapter(self, name: str, path: str) -> dict:
        """Loads the adapter on every instance with LoRA on (serving.gateway.lora); their refusal, as vLLM answers."""
        try:
            r = await self.gw.lora.load(name, path)
        except AdapterError as e:
            raise lora_api_error(e, "lora_path") from None
        return {"name": r.adapter.name, "path": r.adapter.path}

    async def unload_adapter(self, name: str) -> dict:
        try:
            n = await self.gw.lora.unload(name)
        except AdapterError as e:
            raise lora_api_error(e, "lora_name") from None
        return {"name": name, "requests_in_flight": n}

    def run(self, ereq: EngineRequest, response_id: str, tenant, headers) -> _GatewayRun:
        """Each prompt as a GenerateRequest through the gateway's checks (serving.wire.requests, as an instance
        reads it), then the tenant's rate limit; raises ApiError naming the request's parameter."""
        gw = self.gw
        prepared = []
        for i, p in enumerate(ereq.prompts):
            rid = response_id if len(ereq.prompts) == 1 else f"{response_id}-{i}"
            if p.messages is not None:
                req = generate_request(messages=p.messages, add_generation_prompt=p.add_generation_prompt,
                                       request_id=rid, priority=ereq.priority, **ereq.sampling)
            elif p.token_ids is None:
                req = generate_request(p.text, add_special_tokens=p.add_special_tokens, request_id=rid,
                                       priority=ereq.priority, **ereq.sampling)
            else:
                req = generate_request(p.token_ids, request_id=rid, priority=ereq.priority, **ereq.sampling)
            req.cache_salt = ereq.cache_salt  # within the tenant's salt (the instance joins them)
            try:
                prepared.append(gw.prepare(req, tenant))
            except GatewayError as e:
                raise api_error(e, field=p.field, renames=ereq.renames) from None
        try:
            gw.check_rate(tenant, prepared)  # every prompt's tokens (prompt + max_tokens x n), as the gRPC API counts
        except GatewayError as e:
            raise api_error(e) from None
        deadline = time.monotonic() + gw.config.admission.request_timeout_s
        return _GatewayRun(self, prepared, [p.field for p in ereq.prompts], ereq.n, deadline,
                           gw.parent_context(headers), ereq.renames)

    # ------------------------------------------------------------------ serving
    async def start(self, host: str, port: int, **tls) -> int:
        return await self.api.start(host, port, **tls)

    async def stop(self, timeout_s: float = 10.0) -> None:
        await self.api.stop(timeout_s)
