"""`OpenAIServer`: the instance server's frontend of the OpenAI-compatible HTTP API (serving.api.app.OpenAIApp), served
by uvicorn on the gRPC server's own event loop. Requests share the gRPC servicer's engine, in-flight books (drain),
metrics and traces; each prompt becomes one engine request (its checks the engine's make_request), and a client that
goes away aborts its requests. Details: docs/server.md."""
from __future__ import annotations

import asyncio
import logging
import math

from serving.api import protocol
from serving.api.app import ChatParsers, OpenAIApp
from serving.api.asgi import ERROR_CODES, MergedRun, internal_error
from serving.api.guard import HttpLimits
from serving.api.protocol import ApiError, EngineRequest
from serving.api.responses import Delta
from serving.auth import InstanceKeys, Refused
from serving.core.async_engine import EngineDeadError
from serving.core.lora import UnknownAdapterError
from serving.core.request import FinishReason, Request
from serving.core.scheduler import QueueFullError
from serving.params import ContextLengthError, ModelLimits, check_max_tokens
from serving.server.servicer import InferenceServicer

log = logging.getLogger(__name__)


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

    def __init__(self, server: OpenAIServer, requests: list[Request], ereq: EngineRequest, headers):
        super().__init__(len(requests), requests[0].sampling_params.n)
        self.server, self.servicer, self.ereq = server, server.servicer, ereq
        self.rids = [r.request_id for r in requests]
        self.last = [None] * len(self.rids)  # each prompt's last request state
        self.failure: str | None = None
        self.arrivals, self.spans = [], []
        for i, r in enumerate(requests):
            self.arrivals.append(self.servicer.begin(r.request_id))
            self.spans.append(self.servicer.tracer.start(r.request_id, headers, {
                "meshserve.request_id": r.request_id, "meshserve.priority": ereq.priority,
                "meshserve.prompt_tokens": r.num_prompt_tokens, "meshserve.api": "openai"}, start_time=r.arrival_time))
            self.start(i, self.servicer.aengine.stream(r))

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
        if reason is FinishReason.ERROR:  # the engine's exception text stays in the log
            log.error("request %s failed inside the engine: %s", self.rids[i], out.stop_reason)
            self.failure = f"the engine failed on this request's step: {out.stop_reason}"
            return internal_error(self.rids[i])
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
        if isinstance(e, ValueError):  # the scheduler's (a request id in flight): the engine checked the rest
            self.failure = str(e)
            return ApiError(400, f"{self.ereq.prompts[i].field}: {e}", param=self.ereq.prompts[i].field)
        log.error("request %s failed: %s: %s", self.rids[i], type(e).__name__, e)
        self.failure = f"{type(e).__name__}: {e}"
        return internal_error(self.rids[i])

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
    """The instance's frontend of the OpenAI app (serving.api.app.Frontend) over the gRPC servicer's engine; `start`
    serves the app on the running loop, `stop` closes it."""
    render_elsewhere = False  # the instance tokenizes everything itself

    def __init__(self, servicer: InferenceServicer, *, model_name: str, max_request_bytes: int = 1 << 20,
                 retry_after_s: float = 1.0, tool_call_parser: str = "", keys: InstanceKeys | None = None,
                 limits: HttpLimits = HttpLimits()):
        """tool_call_parser: the model's tool-call format (serving.api.tools); the reasoning parser is the
        engine's (EngineConfig.reasoning_parser). keys: the gRPC server's (every route but /health needs one; the
        admin key for the adapter routes)."""
        self.keys = keys or InstanceKeys()
        self.servicer = servicer
        self.engine = servicer.engine
        self.served_model_name = model_name
        self.tool_call_parser = tool_call_parser
        self.max_request_bytes = max_request_bytes
        self.retry_after_s = retry_after_s
        self.api = OpenAIApp(self, title="meshserve", description="OpenAI-compatible API of a meshserve instance",
                             limits=limits)
        self.app = self.api.app

    # ------------------------------------------------------------------ the frontend
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def model_name(self) -> str:
        return self.served_model_name

    def model_card(self) -> dict:
        return dict(root=self.served_model_name, max_model_len=self.engine.max_model_len)  # no path on disk

    def limits(self) -> ModelLimits:
        return ModelLimits(self.engine.model_config.vocab_size, self.engine.max_model_len, self.max_request_bytes)

    def parsers(self) -> ChatParsers:
        reasoning = self.engine.config.reasoning_parser
        return ChatParsers(self.tool_call_parser, reasoning, after_reasoning=bool(reasoning))

    def refusal(self) -> ApiError | None:
        s = self.servicer
        if not s.ready:
            return ApiError(503, "the server is starting (warming up); retry")
        if s.draining:
            return ApiError(503, "the server is draining and admits no new requests; send it elsewhere")
        if not s.aengine.is_alive:
            return ApiError(503, "the engine is not running; send it elsewhere")
        return None

    def unhealthy(self) -> ApiError | None:
        return self.refusal()

    def authorize(self, headers) -> None:
        """The same keys as the gRPC port (--api_key_file); no HTTP route is an admin call."""
        try:
            self.keys.authorize(headers)
        except Refused as e:
            if self.servicer.metrics is not None:
                self.servicer.metrics.observe_error(e.grpc_code.name)
            raise ApiError(e.http_status, e.message, code="invalid_api_key" if e.http_status == 401 else None
                           ) from None

    def count_error(self, e: ApiError) -> None:
        if self.servicer.metrics is not None:
            self.servicer.metrics.observe_error(ERROR_CODES.get(e.status, str(e.status)))

    def adapters(self) -> list[dict]:
        return self.engine.list_adapters()

    def authorize_admin(self, request) -> None:
        """The server's admin key (serving.auth.InstanceKeys, as its admin RPCs): LoRA loads read its disk."""
        try:
            self.keys.authorize(request.headers.items(), admin=True)
        except Refused as e:
            raise ApiError(e.http_status, e.message) from None

    async def load_adapter(self, name: str, path: str) -> dict:
        try:
            return await self.servicer.load_adapter(name, path)
        except (ValueError, LookupError, PermissionError) as e:
            raise lora_error(e, "lora_path") from None

    async def unload_adapter(self, name: str) -> dict:
        try:
            return await self.servicer.unload_adapter(name)
        except (ValueError, LookupError) as e:
            raise lora_error(e, "lora_name") from None

    async def run(self, ereq: EngineRequest, response_id: str, caller, headers) -> _Run:
        """One engine request per prompt, each checked by the engine's make_request and the API's context rule (as
        the gRPC servicer's), before any is queued; raises ApiError naming the request's parameter. A grammar is
        compiled on a worker thread (as the gRPC servicer does): one must not stall every other stream."""
        if "structured" in ereq.sampling:
            return _Run(self, await asyncio.to_thread(self._requests, ereq, response_id), ereq, headers)
        return _Run(self, self._requests(ereq, response_id), ereq, headers)

    def _requests(self, ereq: EngineRequest, response_id: str) -> list[Request]:
        try:
            params = ereq.sampling_params()
        except ValueError as e:
            raise protocol.api_error(e, ereq.renames) from e
        single = len(ereq.prompts) == 1
        requests = []
        for i, p in enumerate(ereq.prompts):
            try:
                requests.append(self.engine.make_request(response_id if single else f"{response_id}-{i}", p.token_ids,
                                                         params, priority=ereq.priority, field=p.field,
                                                         cache_salt=ereq.cache_salt))
                check_max_tokens(len(p.token_ids), params.max_tokens, self.engine.max_model_len)
            except ContextLengthError as e:
                raise protocol.api_error(e, ereq.renames, code="context_length_exceeded") from e
            except UnknownAdapterError as e:  # unloaded since the app checked `model`
                raise ApiError(404, str(e), param="model", code="model_not_found") from e
            except ValueError as e:
                raise protocol.api_error(e, ereq.renames) from e
        return requests

    # ------------------------------------------------------------------ serving
    async def start(self, host: str, port: int, **tls) -> int:
        """Serves the app on the running loop at host:port (0: a free port); returns the port. TLS: HttpServer.start."""
        return await self.api.start(host, port, **tls)

    async def stop(self, timeout_s: float = 10.0) -> None:
        await self.api.stop(timeout_s)


def lora_error(e: Exception, param: str) -> ApiError:
    """A refused load or unload as vLLM answers it: 404 for an unknown adapter, 403 for a path the server may not
    read, 400 otherwise (the adapter does not fit the model, or the name is taken)."""
    if isinstance(e, UnknownAdapterError):
        return ApiError(404, str(e), param="lora_name", code="model_not_found")
    if isinstance(e, PermissionError):
        return ApiError(403, str(e), param="lora_path")
    return ApiError(400, str(e), param=param)
