"""`OpenAIServer`: the OpenAI-compatible HTTP API of an instance server, a FastAPI app that uvicorn serves on the gRPC
server's own event loop: POST /v1/chat/completions and /v1/completions (JSON, or Server-Sent Events with `stream`),
GET /v1/models, GET /health (503 while starting or draining), vLLM's POST /tokenize and /detokenize. Requests share
the gRPC servicer's engine, in-flight books (drain), metrics and traces; a client that goes away aborts its request.
Details: docs/server.md."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import ssl
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.api import protocol
from serving.api.protocol import ApiError
from serving.api.responses import DONE, ResponseBuilder, sse
from serving.core.async_engine import EngineDeadError
from serving.core.request import FinishReason, Priority
from serving.core.sampling_params import SamplingParams
from serving.core.scheduler import QueueFullError
from serving.server.servicer import InferenceServicer
from serving.validation import check_vocabulary

log = logging.getLogger(__name__)

LARGE_BODY_BYTES = 32 << 10  # parsed and tokenized off the event loop
PRIORITIES = tuple(p.value for p in Priority)
# meshserve:request_errors_total counts HTTP errors under the gRPC code names, one vocabulary for both APIs.
ERROR_CODES = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL",
               503: "UNAVAILABLE"}
CLIENT_GONE = 499  # nginx's "client closed request": the status of a request whose client left before its answer


class _ClientGone(Exception):
    pass


class _Run:
    """The engine requests of one HTTP request (one per prompt, each with its n samples): admitted together, their
    outputs merged as they come, and ended exactly once by `close` (unfinished samples aborted, their pages freed),
    with the servicer's books, metrics and traces kept as for a gRPC request."""

    def __init__(self, server: OpenAIServer, base_id: str, ereq: protocol.EngineRequest, params: SamplingParams,
                 headers):
        self.server, self.servicer, self.ereq = server, server.servicer, ereq
        single = len(ereq.prompts) == 1
        self.rids = [base_id if single else f"{base_id}-{i}" for i in range(len(ereq.prompts))]
        self.remaining = [params.n] * len(self.rids)  # samples not finished, per prompt
        self.last = [None] * len(self.rids)  # each prompt's last request state
        self.queue: asyncio.Queue = asyncio.Queue()
        self.buffer: list = []  # outputs read by open()
        self.failure: str | None = None
        self.closed = False
        self.arrivals, self.spans, self.tasks = [], [], []
        for i, (rid, p) in enumerate(zip(self.rids, ereq.prompts)):
            self.arrivals.append(self.servicer.begin(rid))
            self.spans.append(self.servicer.tracer.start(rid, headers, {
                "meshserve.request_id": rid, "meshserve.priority": ereq.priority,
                "meshserve.prompt_tokens": len(p.token_ids), "meshserve.api": "openai"}))
            stream = self.servicer.aengine.generate(rid, p.token_ids, params, priority=ereq.priority)
            self.tasks.append(asyncio.ensure_future(self._pump(i, stream)))

    async def _pump(self, i: int, stream) -> None:
        try:
            async for out in stream:
                self.queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the reader
            self.queue.put_nowait((i, e))

    @property
    def done(self) -> bool:
        return not any(self.remaining)

    async def _next(self):
        i, out = await self.queue.get()
        if isinstance(out, Exception):
            raise self._error(i, out)
        self.last[i] = out.request
        if out.finished:
            self.remaining[i] -= 1
            self.servicer.record_finished(out)
            reason = out.finish_reason
            if reason is FinishReason.ABORT:
                raise self._fail(503, "the server shut down before the request finished; retry elsewhere")
            if reason is FinishReason.ERROR:
                log.error("request %s failed inside the engine: %s", self.rids[i], out.stop_reason)
                raise self._fail(500, f"the engine failed on this request's step: {out.stop_reason}")
            if reason is FinishReason.TIMEOUT:
                raise self._fail(500, "the request's deadline passed")
        return i, out

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

    async def open(self) -> None:
        """Waits until every prompt is admitted and has its first output (raises ApiError if one is refused)."""
        pending = set(range(len(self.rids)))
        while pending:
            i, out = await self._next()
            self.buffer.append((i, out))
            pending.discard(i)

    async def outputs(self):
        """(prompt index, step output) until every sample has finished; raises ApiError on a failure."""
        while self.buffer:
            yield self.buffer.pop(0)
        while not self.done:
            yield await self._next()

    def close(self) -> None:
        """Ends the run (idempotent, no await: it runs inside cancelled tasks too)."""
        if self.closed:
            return
        self.closed = True
        for t in self.tasks:
            t.cancel()
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


class _EventStream(StreamingResponse):
    """A Server-Sent Events response that ends its run however the response ends, even when the client leaves
    before the body starts."""

    def __init__(self, content, run: _Run):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: the instance server's drain gRPC and HTTP together on SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass


class OpenAIServer:
    """The HTTP app over the gRPC servicer's engine; `start` serves it on the running loop, `stop` closes it."""

    def __init__(self, servicer: InferenceServicer, *, model_name: str, max_request_bytes: int = 1 << 20,
                 retry_after_s: float = 1.0):
        self.servicer = servicer
        self.engine = servicer.engine
        self.model_name = model_name
        self.max_request_bytes = max_request_bytes
        self.retry_after_s = retry_after_s
        self.created = int(time.time())
        self.app = self._build_app()
        self._server: _Uvicorn | None = None
        self._task: asyncio.Future | None = None

    # ------------------------------------------------------------------ app
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="meshserve", description="OpenAI-compatible API of a meshserve instance")
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])

        async def api_error(request, e: ApiError):
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

        async def http_error(request, e: StarletteHTTPException):
            return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

        async def client_gone(request, e: _ClientGone):
            return Response(status_code=CLIENT_GONE)

        async def unexpected(request, e: Exception):
            log.exception("HTTP %s %s failed", request.method, request.url.path)
            return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500)
        app.add_exception_handler(ApiError, api_error)
        app.add_exception_handler(StarletteHTTPException, http_error)
        app.add_exception_handler(_ClientGone, client_gone)
        app.add_exception_handler(Exception, unexpected)
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

    @staticmethod
    def _parse(raw: bytes, model_cls):
        try:
            return model_cls.model_validate_json(raw)
        except ValidationError as e:
            if any(err.get("type") == "json_invalid" for err in e.errors()):
                raise ApiError(400, f"the body is not valid JSON: {e.errors()[0].get('msg')}") from e
            raise protocol.validation_error(e) from e

    def _count(self, e: ApiError) -> None:
        if self.servicer.metrics is not None:
            self.servicer.metrics.observe_error(ERROR_CODES.get(e.status, str(e.status)))

    def _params(self, ereq: protocol.EngineRequest) -> SamplingParams:
        """The engine's SamplingParams: serving.validation's checks, the gRPC servicer's reasons."""
        try:
            params = SamplingParams(**ereq.sampling)
            check_vocabulary(params, self.engine.model_config.vocab_size)
        except ValueError as e:
            raise protocol.api_error(e, ereq.renames) from e
        return params

    @staticmethod
    async def _until_disconnect(request: Request, coro):
        """Runs coro to its end, unless the client disconnects first (then cancels it and raises _ClientGone)."""
        async def gone():
            while (await request.receive())["type"] != "http.disconnect":
                pass
        task, watch = asyncio.ensure_future(coro), asyncio.ensure_future(gone())
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()
        if task in done:
            return task.result()
        raise _ClientGone()

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
            req = self._parse(raw, protocol.ChatCompletionRequest if chat else protocol.CompletionRequest)
            self._check_model(req.model)
            if len(raw) > self.max_request_bytes:
                field = "messages" if chat else "prompt"
                raise ApiError(400, f"{field}: the request is {len(raw)} bytes, over the server's limit of "
                               f"{self.max_request_bytes} bytes (--max_request_bytes)", param=field)

            def build():
                if chat:
                    return protocol.chat_request(req, tok, PRIORITIES)
                return protocol.completion_request(req, tok, self.engine.model_config.vocab_size, PRIORITIES)
            ereq = await asyncio.to_thread(build) if len(raw) > LARGE_BODY_BYTES else build()
            params = self._params(ereq)
            protocol.check_fits(ereq, params.max_tokens, self.engine.max_model_len)
        except ApiError as e:
            self._count(e)
            raise
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        run = _Run(self, response_id, ereq, params, request.headers.items())
        builder = ResponseBuilder(
            chat=chat, response_id=response_id, model=self.model_name, created=int(time.time()), n=params.n,
            prompt_lengths=[len(p.token_ids) for p in ereq.prompts], tokenizer=tok, logprobs=params.logprobs,
            echo_texts=[p.text for p in ereq.prompts] if ereq.echo else None, include_usage=ereq.include_usage)
        streaming = None
        try:
            # Admission (and the first tokens) before the status line: a full queue is a 429, not a broken stream.
            await self._until_disconnect(request, run.open())
            if ereq.stream:
                streaming = _EventStream(self._events(run, builder, ereq), run)  # it closes the run
                return streaming
            return JSONResponse(await self._until_disconnect(request, self._collect(run, builder)))
        except ApiError as e:
            self._count(e)
            raise
        finally:
            if streaming is None:
                run.close()

    @staticmethod
    async def _collect(run: _Run, builder: ResponseBuilder) -> dict:
        async for i, out in run.outputs():
            builder.add(i, out)
        return builder.response()

    async def _events(self, run: _Run, builder: ResponseBuilder, ereq: protocol.EngineRequest):
        try:
            for chunk in builder.first_chunks():
                yield sse(chunk)
            async for i, out in run.outputs():
                chunk = builder.chunk(i, out)
                if chunk is not None:
                    yield sse(chunk)
            if ereq.include_usage:
                yield sse(builder.usage_chunk())
            yield DONE
        except ApiError as e:  # after the status line: the error goes in the stream, as OpenAI's does
            self._count(e)
            yield sse(e.body())
            yield DONE
        finally:
            run.close()  # also when the client left: its samples are aborted now

    # ------------------------------------------------------------------ other endpoints
    async def models(self):
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "meshserve",
            "root": self.engine.config.model, "parent": None, "max_model_len": self.engine.max_model_len}]}

    async def health(self):
        try:
            self._check_serving()
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return Response(status_code=200)

    async def tokenize(self, request: Request):
        req = self._parse(await request.body(), protocol.TokenizeRequest)
        self._check_model(req.model)
        tok = self.engine.tokenizer
        ids = protocol.tokenize_request(req, tok)
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids,
                "token_strs": [tok.id_to_token(t) or "" for t in ids] if req.return_token_strs else None}

    async def detokenize(self, request: Request):
        req = self._parse(await request.body(), protocol.DetokenizeRequest)
        self._check_model(req.model)
        try:
            protocol.check_token_ids("tokens", req.tokens, self.engine.model_config.vocab_size)
            if self.engine.tokenizer is None:
                raise protocol.InvalidArgument("tokens: this model has no tokenizer")
        except ValueError as e:
            raise protocol.api_error(e) from e
        return {"prompt": self.engine.tokenizer.decode(req.tokens)}

    # ------------------------------------------------------------------ serving
    async def start(self, host: str, port: int, *, tls_cert: str = "", tls_key: str = "", tls_client_ca: str = ""
                    ) -> int:
        """Serves the app on the running loop at host:port (0: a free port), over TLS with the gRPC port's
        certificate (client certificates required with tls_client_ca); returns the port."""
        tls = {}
        if tls_cert:
            tls = dict(ssl_certfile=tls_cert, ssl_keyfile=tls_key)
            if tls_client_ca:
                tls.update(ssl_ca_certs=tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(info[0], info[1], info[2])
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(info[4])
        except OSError as e:
            sock.close()
            raise RuntimeError(f"cannot listen on {host}:{port} for HTTP: {e}") from e
        bound = sock.getsockname()[1]
        config = uvicorn.Config(self.app, lifespan="off", log_config=None, access_log=False,
                                timeout_graceful_shutdown=5, **tls)
        self._server = _Uvicorn(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.01)
        return bound

    async def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, timeout_s)
        except asyncio.TimeoutError:
            log.warning("the HTTP server did not stop in %.0fs", timeout_s)
