"""`OpenAIServer`: the OpenAI-compatible HTTP API of an instance server, a FastAPI app that uvicorn serves on the gRPC
server's own event loop: POST /v1/chat/completions and /v1/completions (JSON, or Server-Sent Events with `stream`),
GET /v1/models, GET /health (503 while starting or draining), vLLM's POST /tokenize and /detokenize. Requests share
the gRPC servicer's engine, in-flight books (drain), metrics and traces; a client that goes away aborts its request.
Details: docs/server.md."""
from __future__ import annotations

import logging
import math
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from serving.api import protocol
from serving.api.asgi import (ERROR_CODES, HttpServer, MergedRun, by_size, check_size, install_error_handlers, parse,
                              respond)
from serving.api.protocol import ApiError
from serving.api.responses import Delta, ResponseBuilder
from serving.core.async_engine import EngineDeadError
from serving.core.request import FinishReason, Priority
from serving.core.sampling_params import SamplingParams, StructuredOutput
from serving.core.scheduler import QueueFullError
from serving.server.servicer import InferenceServicer
from serving.validation import check_vocabulary

log = logging.getLogger(__name__)

PRIORITIES = tuple(p.value for p in Priority)


def delta(out) -> Delta:
    """The engine's step output (serving.core.output_processor.StepOutput) as the response builder's delta."""
    r = out.request
    if not out.finished:
        return Delta(out.index, out.new_text, out.logprobs, token_ids=out.new_token_ids)
    return Delta(out.index, out.new_text, out.logprobs, out.finish_reason.value, r.num_output_tokens,
                 cached_tokens=r.metrics.num_cached_prompt_tokens, token_ids=out.new_token_ids)


class _Run(MergedRun):
    """The engine requests of one HTTP request (one per prompt, each with its n samples): admitted together, their
    outputs merged as they come, and ended exactly once by `close` (unfinished samples aborted, their pages freed),
    with the servicer's books, metrics and traces kept as for a gRPC request."""

    def __init__(self, server: OpenAIServer, base_id: str, ereq: protocol.EngineRequest, params: SamplingParams,
                 headers):
        super().__init__(len(ereq.prompts), params.n)
        self.server, self.servicer, self.ereq = server, server.servicer, ereq
        single = len(ereq.prompts) == 1
        self.rids = [base_id if single else f"{base_id}-{i}" for i in range(len(ereq.prompts))]
        self.last = [None] * len(self.rids)  # each prompt's last request state
        self.failure: str | None = None
        self.arrivals, self.spans = [], []
        for i, (rid, p) in enumerate(zip(self.rids, ereq.prompts)):
            self.arrivals.append(self.servicer.begin(rid))
            self.spans.append(self.servicer.tracer.start(rid, headers, {
                "meshserve.request_id": rid, "meshserve.priority": ereq.priority,
                "meshserve.prompt_tokens": len(p.token_ids), "meshserve.api": "openai"}))
            self.start(i, self.servicer.aengine.generate(rid, p.token_ids, params, priority=ereq.priority))

    def take(self, i: int, out) -> Delta:
        if isinstance(out, Exception):
            raise self._error(i, out)
        self.last[i] = out.request
        if out.finished:
            self.servicer.record_finished(out)
            error = self._ended_badly(i, out)
            if error is not None:
                self.remaining[i] -= 1  # it finished, though not well: nothing to abort
                raise error
        return delta(out)

    def _ended_badly(self, i: int, out) -> ApiError | None:
        reason = out.finish_reason
        if reason is FinishReason.ABORT:
            return self._fail(503, "the server shut down before the request finished; retry elsewhere")
        if reason is FinishReason.ERROR:
            log.error("request %s failed inside the engine: %s", self.rids[i], out.stop_reason)
            return self._fail(500, f"the engine failed on this request's step: {out.stop_reason}")
        if reason is FinishReason.TIMEOUT:
            return self._fail(500, "the request's deadline passed")
        return None

    def _fail(self, status: int, message: str) -> ApiError:
        self.failure = message
        return ApiError(status, message)

    def _error(self, i: int, e: Exception) -> ApiError:
        if isinstance(e, QueueFullError):
            retry = self.server.retry_after_s
            self.failure = str(e)
            return ApiError(429, f"{e}; retry in {retry:g}s", code="queue_full",
                            headers={"Retry-After": str(max(1, math.ceil(retry)))})
        if isinstance(e, EngineDeadError):
            return self._fail(503, str(e))
        if isinstance(e, ValueError):  # e.g. the scheduler's PromptTooLongError
            self.failure = str(e)
            return ApiError(400, f"{self.ereq.prompts[i].field}: {e}", param=self.ereq.prompts[i].field)
        return self._fail(500, f"{type(e).__name__}: {e}")

    def end(self) -> None:
        for i, rid in enumerate(self.rids):
            if self.remaining[i]:
                self.servicer.aengine.abort(rid, FinishReason.ABORT)  # a no-op if it never got in
                if self.failure is None:  # the client left (or the server stops): counted as aborted
                    self.servicer.record_abort(self.last[i], FinishReason.ABORT,
                                               num_prompt_tokens=len(self.ereq.prompts[i].token_ids),
                                               arrival_time=self.arrivals[i])
            self.servicer.end(rid)
            label = ("rejected" if self.last[i] is None and self.failure is not None else
                     "abort" if self.remaining[i] else "stop")
            self.servicer.tracer.finish(self.spans[i], rid, self.last[i], finish_reason=label, error=self.failure)


class OpenAIServer:
    """The HTTP app over the gRPC servicer's engine; `start` serves it on the running loop, `stop` closes it."""

    def __init__(self, servicer: InferenceServicer, *, model_name: str, max_request_bytes: int = 1 << 20,
                 retry_after_s: float = 1.0, tool_call_parser: str = ""):
        """tool_call_parser: the model's tool-call format (serving.api.tools); the reasoning parser is the
        engine's (EngineConfig.reasoning_parser)."""
        self.servicer = servicer
        self.engine = servicer.engine
        self.model_name = model_name
        self.tool_call_parser = tool_call_parser
        self.max_request_bytes = max_request_bytes
        self.retry_after_s = retry_after_s
        self.created = int(time.time())
        self.app = self._build_app()
        self.http = HttpServer(self.app)

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="meshserve", description="OpenAI-compatible API of a meshserve instance")
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        install_error_handlers(app)
        return app

    # ------------------------------------------------------------------ checks
    def _check_serving(self) -> None:
        s = self.servicer
        if not s.ready:
            raise ApiError(503, "the server is starting (warming up); retry")
        if s.draining:
            raise ApiError(503, "the server is draining and admits no new requests; send it elsewhere")
        if not s.aengine.is_alive:
            raise ApiError(503, "the engine is not running; send it elsewhere")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise protocol.model_not_found(model, self.model_name)

    def _count(self, e: ApiError) -> None:
        if self.servicer.metrics is not None:
            self.servicer.metrics.observe_error(ERROR_CODES.get(e.status, str(e.status)))

    def _params(self, ereq: protocol.EngineRequest) -> SamplingParams:
        """The engine's SamplingParams: serving.validation's checks, the gRPC servicer's reasons."""
        try:
            kw = dict(ereq.sampling)
            if "structured" in kw:  # a reasoning model's reasoning stays free: the grammar applies after it
                kw["structured"] = StructuredOutput(**kw["structured"],
                                                    after_reasoning=bool(self.engine.config.reasoning_parser))
            params = SamplingParams(**kw)
            check_vocabulary(params, self.engine.model_config.vocab_size)
            if params.structured is not None:  # compiled (or found in the cache) before anything is queued
                self.engine.structured.compile(params.structured)
        except ValueError as e:
            raise protocol.api_error(e, ereq.renames) from e
        return params

    # ------------------------------------------------------------------ generation
    async def chat_completions(self, request: Request):
        return await self._generate(request, chat=True)

    async def completions(self, request: Request):
        return await self._generate(request, chat=False)

    async def _generate(self, request: Request, *, chat: bool):
        tok = self.engine.tokenizer
        try:
            self._check_serving()
            raw = await request.body()
            req = parse(raw, protocol.ChatCompletionRequest if chat else protocol.CompletionRequest)
            self._check_model(req.model)
            check_size(raw, self.max_request_bytes, chat)

            def build():
                if chat:
                    return protocol.chat_request(req, tok, PRIORITIES, tool_call_parser=self.tool_call_parser)
                return protocol.completion_request(req, tok, self.engine.model_config.vocab_size, PRIORITIES)
            ereq = await by_size(raw, build)
            params = self._params(ereq)
            protocol.check_fits(ereq, params.max_tokens, self.engine.max_model_len)
        except ApiError as e:
            self._count(e)
            raise
        response_id = protocol.response_id(chat)
        run = _Run(self, response_id, ereq, params, request.headers.items())
        builder = ResponseBuilder(
            chat=chat, response_id=response_id, model=self.model_name, created=int(time.time()), n=params.n,
            prompt_lengths=[len(p.token_ids) for p in ereq.prompts], tokenizer=tok, logprobs=params.logprobs,
            echo_texts=[p.text for p in ereq.prompts] if ereq.echo else None, include_usage=ereq.include_usage,
            reasoning_parser=self.engine.config.reasoning_parser, tool_parser=ereq.tool_parser)
        return await respond(request, run, builder, stream=ereq.stream, count_error=self._count)

    # ------------------------------------------------------------------ other endpoints
    async def models(self):
        return protocol.model_list(self.model_name, self.created, root=self.engine.config.model,
                                   max_model_len=self.engine.max_model_len)

    async def health(self):
        try:
            self._check_serving()
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return Response(status_code=200)

    async def tokenize(self, request: Request):
        raw = await request.body()
        req = parse(raw, protocol.TokenizeRequest)
        self._check_model(req.model)
        check_size(raw, self.max_request_bytes, req.messages is not None)  # 16 MiB took 19 s on the event loop

        def tokenize():
            return protocol.tokenize_response(req, self.engine.tokenizer, self.engine.max_model_len)
        return await by_size(raw, tokenize)

    async def detokenize(self, request: Request):
        req = parse(await request.body(), protocol.DetokenizeRequest)
        self._check_model(req.model)
        return protocol.detokenize_response(req, self.engine.tokenizer, self.engine.model_config.vocab_size)

    # ------------------------------------------------------------------ serving
    async def start(self, host: str, port: int, **tls) -> int:
        """Serves the app on the running loop at host:port (0: a free port); returns the port. TLS: HttpServer.start."""
        return await self.http.start(host, port, **tls)

    async def stop(self, timeout_s: float = 10.0) -> None:
        await self.http.stop(timeout_s)
