"""`GatewayHTTP`: the gateway's OpenAI-compatible HTTP API (`--http_port`), on the gRPC server's event loop. Each
OpenAI request becomes meshserve.v1 GenerateRequests (one per prompt) that take the gRPC path: `Authorization: Bearer`
key -> tenant (its rate limit, priority and pools), the same checks, admission queues, long lane, load-aware routing
with prefix affinity, quarantine, and the retry before the first token. With a tokenizer (the configuration's
`tokenizer`, else the instances' model directory where the gateway can read it) the gateway renders chats itself,
so affinity and lane come from the exact prompt tokens; without one, text and chat go on for the instance to render.
Details: docs/gateway.md."""
from __future__ import annotations

import logging
import math
import time

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from serving.api import protocol
from serving.api.asgi import ERROR_CODES, HttpServer, MergedRun, by_size, check_size, install_error_handlers, parse, respond
from serving.api.protocol import ApiError
from serving.api.responses import Delta, ResponseBuilder, TokenLogprob
from serving.gateway.app import RETRY_PUSHBACK_KEY, Gateway, GatewayError, Prepared
from serving.gateway.security import AuthError
from serving.wire.client import generate_request
from serving.wire import meshserve_pb2 as pb

log = logging.getLogger(__name__)

PRIORITIES = (pb.PRIORITY_INTERACTIVE, pb.PRIORITY_BATCH)
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
            raise ApiError(500, f"{type(r).__name__}: {r}")
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
    """The gateway's HTTP app; `start` serves it on the running loop, `stop` closes it."""

    def __init__(self, gateway: Gateway):
        self.gw = gateway
        self.created = int(time.time())
        app = FastAPI(title="meshserve gateway", description="OpenAI-compatible API of a meshserve gateway")
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        install_error_handlers(app)
        self.app = app
        self.http = HttpServer(app)

    # ------------------------------------------------------------------ checks
    def _tenant(self, request: Request):
        try:
            return self.gw.auth.tenant(request.headers.items())
        except AuthError as e:
            raise api_error(e) from None

    def _model_name(self) -> str:
        name = self.gw.model_name
        if not name:
            raise ApiError(503, "the gateway has not heard from an instance yet (starting); retry")
        return name

    def _check_model(self, model: str | None) -> None:
        name = self._model_name()
        if model is not None and model != name:
            raise protocol.model_not_found(model, name)

    def _count(self, e: ApiError) -> None:
        self.gw.metrics.requests.labels(ERROR_CODES.get(e.status, "INTERNAL")).inc()

    def _parsers(self) -> tuple[str, str, bool]:
        """(tool-call parser, reasoning parser, whether the instances' grammars apply after the reasoning): the
        configuration's parsers, else those the instances report (ModelInfo)."""
        tool, reasoning = self.gw.config.tool_call_parser, self.gw.config.reasoning_parser
        mi = next((i.model_info for i in self.gw.pools.instances.values() if i.model_info is not None), None)
        if mi is None:
            return tool, reasoning, False
        return tool or mi.tool_call_parser, reasoning or mi.reasoning_parser, bool(mi.reasoning_parser)

    # ------------------------------------------------------------------ generation
    async def chat_completions(self, request: Request):
        return await self._generate(request, chat=True)

    async def completions(self, request: Request):
        return await self._generate(request, chat=False)

    def _prepare(self, ereq: protocol.EngineRequest, tenant, response_id: str) -> list[Prepared]:
        gw = self.gw
        out = []
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
            try:
                out.append(gw.prepare(req, tenant))
            except GatewayError as e:
                raise api_error(e, field=p.field, renames=ereq.renames) from None
        return out

    async def _generate(self, request: Request, *, chat: bool):
        gw = self.gw
        try:
            if gw.draining:
                raise ApiError(503, "the gateway is draining; send it elsewhere")
            tenant = self._tenant(request)
            raw = await request.body()
            req = parse(raw, protocol.ChatCompletionRequest if chat else protocol.CompletionRequest)
            self._check_model(req.model)
            check_size(raw, gw.limits.max_request_bytes, chat)
            tok = gw.tokenizer
            tool_call_parser, reasoning_parser, after_reasoning = self._parsers()

            def build():
                if chat:
                    return protocol.chat_request(req, tok, PRIORITIES, render_elsewhere=True,
                                                 tool_call_parser=tool_call_parser)
                return protocol.completion_request(req, tok, gw.limits.vocab_size, PRIORITIES, render_elsewhere=True)
            ereq = await by_size(raw, build)
            if after_reasoning and "structured" in ereq.sampling:  # as the instance's own HTTP API does
                ereq.sampling["structured"] = {**ereq.sampling["structured"], "after_reasoning": True}
            response_id = protocol.response_id(chat)
            prepared = self._prepare(ereq, tenant, response_id)
            try:
                gw.check_rate(tenant)
            except GatewayError as e:
                raise api_error(e) from None
        except ApiError as e:
            self._count(e)
            raise
        deadline = time.monotonic() + gw.config.admission.request_timeout_s
        run = _GatewayRun(self, prepared, [p.field for p in ereq.prompts], ereq.n, deadline,
                          gw.parent_context(request.headers.items()), ereq.renames)
        builder = ResponseBuilder(
            chat=chat, response_id=response_id, model=self._model_name(), created=int(time.time()), n=ereq.n,
            prompt_lengths=[len(p.token_ids or ()) for p in ereq.prompts], tokenizer=tok,
            logprobs=ereq.sampling.get("logprobs"), echo_texts=[p.text for p in ereq.prompts] if ereq.echo else None,
            include_usage=ereq.include_usage, reasoning_parser=reasoning_parser, tool_parser=ereq.tool_parser)
        return await respond(request, run, builder, stream=ereq.stream, count_error=self._count)

    # ------------------------------------------------------------------ other endpoints
    async def models(self, request: Request):
        self._tenant(request)
        return protocol.model_list(self._model_name(), self.created, max_model_len=self.gw.limits.max_model_len or None)

    async def health(self):
        gw = self.gw
        if gw.draining:
            return JSONResponse(ApiError(503, "the gateway is draining").body(), status_code=503)
        if not any(gw.health.routable(name) and i.report is not None and i.report.serving
                   for name, i in gw.pools.instances.items()):
            return JSONResponse(ApiError(503, "no instance is serving yet").body(), status_code=503)
        return Response(status_code=200)

    async def tokenize(self, request: Request):
        self._tenant(request)
        raw = await request.body()
        req = parse(raw, protocol.TokenizeRequest)
        self._check_model(req.model)
        check_size(raw, self.gw.limits.max_request_bytes, req.messages is not None)
        return await by_size(raw, lambda: protocol.tokenize_response(req, self.gw.tokenizer,
                                                                     self.gw.limits.max_model_len))

    async def detokenize(self, request: Request):
        self._tenant(request)
        req = parse(await request.body(), protocol.DetokenizeRequest)
        self._check_model(req.model)
        return protocol.detokenize_response(req, self.gw.tokenizer, self.gw.limits.vocab_size)

    # ------------------------------------------------------------------ serving
    async def start(self, host: str, port: int, **tls) -> int:
        return await self.http.start(host, port, **tls)

    async def stop(self, timeout_s: float = 10.0) -> None:
        await self.http.stop(timeout_s)
