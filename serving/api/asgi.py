"""What the instance's and the gateway's OpenAI HTTP APIs share: uvicorn on the caller's event loop (`HttpServer`),
OpenAI error bodies for every failure (`install_error_handlers`), request bodies parsed into the pydantic models,
and the generation response (`respond`): a run's first outputs before the status line (so a refusal is a status, not
a broken stream), then one JSON body or Server-Sent Events, the run closed however the response ends (a client that
leaves aborts it)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from typing import AsyncIterator, Callable, Protocol

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.api import protocol
from serving.api.guard import HttpLimits, guarded_protocol, request_id
from serving.api.protocol import ApiError
from serving.api.responses import DONE, Delta, ResponseBuilder, sse

log = logging.getLogger(__name__)

LARGE_BODY_BYTES = 32 << 10  # a body this large is parsed and tokenized off the event loop
CLIENT_GONE = 499  # nginx's "client closed request": the status of a request whose client left before its answer
# Request error counters name HTTP errors by the gRPC code of the same meaning: one vocabulary for both APIs.
ERROR_CODES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
               429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


class ClientGone(Exception):
    pass


class Run(Protocol):
    """The engine requests behind one HTTP request (one per prompt, each with its samples)."""

    async def open(self) -> None:
        """Until every prompt is admitted and has its first output; raises ApiError if one is refused."""

    def outputs(self) -> AsyncIterator[tuple[int, Delta]]:
        """(prompt index, delta) until every sample has finished; raises ApiError on a failure."""

    def close(self) -> None:
        """Ends the run once (unfinished samples aborted); no await: it runs inside cancelled tasks too."""


class MergedRun:
    """A `Run` over one stream per prompt (n samples each), merged as their items come. A subclass starts the streams
    (`start`), turns each item into a Delta or an ApiError (`take`), and ends what is left (`end`, once)."""

    def __init__(self, num_prompts: int, n: int):
        self.remaining = [n] * num_prompts  # samples not finished, per prompt
        self.queue: asyncio.Queue = asyncio.Queue()
        self.buffer: list = []  # outputs read by open()
        self.tasks: list[asyncio.Future] = []
        self.closed = False

    def start(self, i: int, stream) -> None:
        self.tasks.append(asyncio.ensure_future(self._pump(i, stream)))

    async def _pump(self, i: int, stream) -> None:
        try:
            async for item in stream:
                self.queue.put_nowait((i, item))
        except Exception as e:  # noqa: BLE001 - handed to the reader
            self.queue.put_nowait((i, e))
        finally:
            aclose = getattr(stream, "aclose", None)  # an async generator: its cleanup runs now, not at GC
            if aclose is not None:
                await aclose()

    def take(self, i: int, item) -> Delta:
        """Prompt i's stream item (or the exception that ended it) as a Delta; raises ApiError."""
        raise NotImplementedError

    def end(self) -> None:
        """Called once by close(), after the streams' tasks are cancelled."""

    @property
    def done(self) -> bool:
        return not any(self.remaining)

    async def _next(self) -> tuple[int, Delta]:
        i, item = await self.queue.get()
        d = self.take(i, item)
        if d.finished:
            self.remaining[i] -= 1
        return i, d

    async def open(self) -> None:
        pending = set(range(len(self.remaining)))
        while pending:
            i, d = await self._next()
            self.buffer.append((i, d))
            pending.discard(i)

    async def outputs(self):
        while self.buffer:
            yield self.buffer.pop(0)
        while not self.done:
            yield await self._next()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for t in self.tasks:
            t.cancel()
        self.end()


def install_error_handlers(app: FastAPI) -> None:
    """Every failure answers with OpenAI's error body."""
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    async def http_error(request, e: StarletteHTTPException):
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    async def client_gone(request, e: ClientGone):
        return Response(status_code=CLIENT_GONE)

    async def unexpected(request, e: Exception):  # the detail goes to the log, never to the client
        rid = request_id(request.scope)
        log.exception("HTTP %s %s failed (request id %s)", request.method, request.url.path, rid)
        return JSONResponse(internal_error(rid).body(), status_code=500)
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(ClientGone, client_gone)
    app.add_exception_handler(Exception, unexpected)


def internal_error(rid: str) -> ApiError:
    """A 500 that shows the client nothing of the process: the id finds the detail in the server's log."""
    return ApiError(500, f"internal error (request id {rid or 'unknown'}); the server's log has the details")


def parse(raw: bytes, model_cls):
    """The body as `model_cls`; a 400 naming the parameter (or saying the JSON is broken)."""
    try:
        return model_cls.model_validate_json(raw)
    except ValidationError as e:
        if any(err.get("type") == "json_invalid" for err in e.errors()):
            raise ApiError(400, f"the body is not valid JSON: {e.errors()[0].get('msg')}") from e
        raise protocol.validation_error(e) from e


def check_size(raw: bytes, limit: int, chat: bool, *, field: str = "") -> None:
    """Before the body is parsed: one a little over the limit (the guard refuses larger ones) names its field."""
    if len(raw) > limit:
        field = field or ("messages" if chat else "prompt")
        raise ApiError(400, f"{field}: the request is {len(raw)} bytes, over the server's limit of {limit} bytes "
                       "(--max_request_bytes)", param=field)


async def by_size(raw: bytes, fn):
    """fn() for a request of body `raw`: on a worker thread when the body is large (tokenizing it would hold the
    event loop, and every other request with it), inline otherwise."""
    return await asyncio.to_thread(fn) if len(raw) > LARGE_BODY_BYTES else fn()


async def until_disconnect(request: Request, coro):
    """Runs coro to its end, unless the client disconnects first (then cancels it and raises ClientGone)."""
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
    raise ClientGone()


class _EventStream(StreamingResponse):
    """A Server-Sent Events response that closes its run however the response ends, even when the client leaves
    before the body starts."""

    def __init__(self, content, run: Run):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()


async def _collect(run: Run, builder: ResponseBuilder) -> dict:
    async for i, out in run.outputs():
        builder.add(i, out)
    return builder.response()


async def _events(run: Run, builder: ResponseBuilder, count_error: Callable[[ApiError], None]):
    try:
        for chunk in builder.first_chunks():
            yield sse(chunk)
        async for i, out in run.outputs():
            for chunk in builder.chunks(i, out):
                yield sse(chunk)
        if builder.include_usage:
            yield sse(builder.usage_chunk())
        yield DONE
    except ApiError as e:  # after the status line: the error goes in the stream, as OpenAI's does
        count_error(e)
        yield sse(e.body())
        yield DONE
    finally:
        run.close()  # also when the client left: its samples are aborted now


async def respond(request: Request, run: Run, builder: ResponseBuilder, *, stream: bool,
                  count_error: Callable[[ApiError], None]):
    """The response to a generation request whose run has started: admission (and the first tokens) awaited before
    the status line, then a JSON body or an event stream. The run is closed on every path."""
    streaming = None
    try:
        await until_disconnect(request, run.open())
        if stream:
            streaming = _EventStream(_events(run, builder, count_error), run)  # it closes the run
            return streaming
        return JSONResponse(await until_disconnect(request, _collect(run, builder)))
    except ApiError as e:
        count_error(e)
        raise
    finally:
        if streaming is None:
            run.close()


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: the process drains gRPC and HTTP together on SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass


class HttpServer:
    """Serves an ASGI app with uvicorn on the running event loop: slow headers time out, connections are capped
    (`limits`; the body's limits are HttpGuard's)."""

    def __init__(self, app, limits: HttpLimits = HttpLimits()):
        self.app, self.limits = app, limits
        self._server: _Uvicorn | None = None
        self._task: asyncio.Future | None = None

    async def start(self, host: str, port: int, *, tls_cert: str = "", tls_key: str = "", tls_client_ca: str = ""
                    ) -> int:
        """Listens on host:port (0: a free port), over TLS with tls_cert (client certificates required with
        tls_client_ca); returns the port."""
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
                                timeout_graceful_shutdown=5, backlog=2048,
                                limit_concurrency=self.limits.max_connections,
                                http=guarded_protocol(AutoHTTPProtocol, self.limits.header_timeout_s), **tls)
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
