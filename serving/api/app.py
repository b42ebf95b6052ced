"""`OpenAIApp`: the one OpenAI-compatible HTTP API, each endpoint written once over the `Frontend` a process implements
(the instance server's engine: serving/server/http.py; the gateway's instances: serving/gateway/http.py): POST
/v1/chat/completions and /v1/completions (parse -> build -> run -> respond, one JSON body or Server-Sent Events),
GET /v1/models (with the LoRA adapters), GET /health, vLLM's POST /tokenize, /detokenize, /v1/load_lora_adapter and
/v1/unload_lora_adapter (admin). Who may call each route: docs/security.md."""
from __future__ import annotations

import dataclasses
import inspect
import time
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from serving.api import protocol
from serving.api.asgi import HttpServer, Run, by_size, check_size, install_error_handlers, parse, respond
from serving.api.guard import HttpGuard, HttpLimits
from serving.api.protocol import ApiError, EngineRequest
from serving.api.responses import ResponseBuilder
from serving.params import ModelLimits
from serving.transport import transport_limit


@dataclasses.dataclass(slots=True)
class ChatParsers:
    tool_call: str = ""  # the model's tool-call format (serving.api.tools); "": tool calls are not parsed
    reasoning: str = ""  # its reasoning format (serving.api.reasoning); "": no reasoning_content
    after_reasoning: bool = False  # grammars apply after the reasoning (the engine knows where it ends)


class Frontend(Protocol):
    """What the app asks of the process it serves."""
    render_elsewhere: bool  # without a tokenizer, text and chats go on as they are (for an instance to tokenize)

    @property
    def tokenizer(self): ...  # models.tokenizer.Tokenizer, or None
    def model_name(self) -> str: ...  # the served model's name; raises ApiError (503) while not known
    def model_card(self) -> dict: ...  # /v1/models' `root` and `max_model_len`
    def limits(self) -> ModelLimits: ...
    def parsers(self) -> ChatParsers: ...
    def refusal(self) -> ApiError | None: ...  # why no request is admitted now (starting, draining)
    def unhealthy(self) -> ApiError | None: ...  # GET /health's 503, None when healthy
    def authorize(self, headers): ...  # the caller of (lower-case) header pairs; raises ApiError (401, 403)
    def count_error(self, e: ApiError) -> None: ...  # a refused generation request, in the process's metrics
    def adapters(self) -> list[dict]: ...  # the LoRA adapters served ({name, path}); a request's `model` may name one
    def authorize_admin(self, request: Request): ...  # raises ApiError (401, 403) unless an admin may call
    async def load_adapter(self, name: str, path: str) -> dict: ...  # raises ApiError naming why not
    async def unload_adapter(self, name: str) -> dict: ...

    def run(self, ereq: EngineRequest, response_id: str, caller, headers) -> Run:
        """Checks what only the engine's side knows (raising ApiError before anything is queued), then starts the
        engine requests, one per prompt; `headers` carry the trace context. May return an awaitable of the Run."""


class OpenAIApp:
    """The FastAPI app of one frontend; `start` serves it on the running event loop, `stop` closes it."""

    def __init__(self, frontend: Frontend, *, title: str, description: str, limits: HttpLimits = HttpLimits()):
        self.frontend = frontend
        self.created = int(time.time())
        app = FastAPI(title=title, description=description)
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        app.add_api_route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"])
        app.add_api_route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"])
        install_error_handlers(app)
        self.app = app
        # Keys, then the body's size and deadline, before any route (or FastAPI) sees the request.
        self.guarded = HttpGuard(app, limits, frontend.authorize,
                                 lambda: transport_limit(frontend.limits().max_request_bytes))
        self.http = HttpServer(self.guarded, limits)

    async def start(self, host: str, port: int, **tls) -> int:
        """Serves the app on the running loop at host:port (0: a free port); returns the port. TLS: HttpServer.start."""
        return await self.http.start(host, port, **tls)

    async def stop(self, timeout_s: float = 10.0) -> None:
        await self.http.stop(timeout_s)

    # ------------------------------------------------------------------ parse
    async def _body(self, request: Request) -> bytes:
        """Every route's request body, read here only."""
        return await request.body()

    async def _read(self, request: Request, model_cls, *, chat: bool):
        """The body as `model_cls`, for the model served, within the request size limit; returns (raw, parsed)."""
        raw = await self._body(request)
        check_size(raw, self.frontend.limits().max_request_bytes, chat)
        req = parse(raw, model_cls)
        adapter = self._check_model(req.model)
        return raw, req, adapter

    def _check_model(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names (as vLLM), None for the model itself; a 404 naming it otherwise."""
        name = self.frontend.model_name()
        if model is None or model == name:
            return None
        adapters = [a["name"] for a in self.frontend.adapters()]
        if model not in adapters:
            raise protocol.model_not_found(model, name, adapters)
        return model

    # ------------------------------------------------------------------ generation
    async def chat_completions(self, request: Request):
        return await self._generate(request, chat=True)

    async def completions(self, request: Request):
        return await self._generate(request, chat=False)

    async def _generate(self, request: Request, *, chat: bool):
        fe = self.frontend
        try:
            refusal = fe.refusal()
            if refusal is not None:
                raise refusal
            caller = fe.authorize(request.headers.items())
            raw, req, adapter = await self._read(
                request, protocol.ChatCompletionRequest if chat else protocol.CompletionRequest, chat=chat)
            tok, parsers = fe.tokenizer, fe.parsers()

            def build() -> EngineRequest:
                if chat:
                    return protocol.chat_request(req, tok, render_elsewhere=fe.render_elsewhere,
                                                 tool_call_parser=parsers.tool_call)
                return protocol.completion_request(req, tok, render_elsewhere=fe.render_elsewhere)
            ereq = await by_size(raw, build)
            ereq.cache_salt = req.cache_salt or ""
            if adapter is not None:
                ereq.sampling["adapter"] = adapter
            if parsers.after_reasoning and "structured" in ereq.sampling:  # a reasoning model's reasoning stays free
                ereq.sampling["structured"] = {**ereq.sampling["structured"], "after_reasoning": True}
            response_id = protocol.response_id(chat)
            run = fe.run(ereq, response_id, caller, request.headers.items())
            if inspect.isawaitable(run):  # the instance compiles grammars off the event loop
                run = await run
        except ApiError as e:
            fe.count_error(e)
            raise
        builder = ResponseBuilder(
            chat=chat, response_id=response_id, model=adapter or fe.model_name(), created=int(time.time()), n=ereq.n,
            prompt_lengths=[len(p.token_ids or ()) for p in ereq.prompts], tokenizer=tok,
            logprobs=ereq.sampling.get("logprobs"), echo_texts=protocol.echo_texts(ereq, tok),
            include_usage=ereq.include_usage, reasoning_parser=parsers.reasoning, tool_parser=ereq.tool_parser)
        return await respond(request, run, builder, stream=ereq.stream, count_error=fe.count_error)

    # ------------------------------------------------------------------ other endpoints
    async def models(self, request: Request):
        self.frontend.authorize(request.headers.items())
        return protocol.model_list(self.frontend.model_name(), self.created, **self.frontend.model_card(),
                                   adapters=self.frontend.adapters())

    async def load_lora_adapter(self, request: Request):
        """vLLM's body ({lora_name, lora_path}) and answer (200 and a line of text); admin only."""
        self.frontend.authorize_admin(request)
        req = parse(await self._body(request), protocol.LoadLoRAAdapterRequest)
        if req.lora_path is None:
            raise ApiError(400, "lora_path: required; the adapter's PEFT directory on the server", param="lora_path")
        await self.frontend.load_adapter(req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: Request):
        self.frontend.authorize_admin(request)
        req = parse(await self._body(request), protocol.LoadLoRAAdapterRequest)
        await self.frontend.unload_adapter(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    async def health(self):
        error = self.frontend.unhealthy()
        if error is not None:
            return JSONResponse(error.body(), status_code=error.status)
        return Response(status_code=200)

    async def tokenize(self, request: Request):
        self.frontend.authorize(request.headers.items())
        raw = await self._body(request)
        check_size(raw, self.frontend.limits().max_request_bytes, b'"messages"' in raw)
        req = parse(raw, protocol.TokenizeRequest)
        self._check_model(req.model)
        tok, max_model_len = self.frontend.tokenizer, self.frontend.limits().max_model_len
        return await by_size(raw, lambda: protocol.tokenize_response(req, tok, max_model_len))  # 16 MiB took 19 s

    async def detokenize(self, request: Request):
        self.frontend.authorize(request.headers.items())
        raw = await self._body(request)
        check_size(raw, self.frontend.limits().max_request_bytes, False, field="tokens")
        req = parse(raw, protocol.DetokenizeRequest)
        self._check_model(req.model)
        return protocol.detokenize_response(req, self.frontend.tokenizer, self.frontend.limits().vocab_size)
