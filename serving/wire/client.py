"""Client library for meshserve.v1.Inference (an instance server or the gateway): `Client` (blocking) and `AsyncClient`
(asyncio); `generate` streams GenerateResponses (with n > 1, each sample's told apart by `index`), `complete` joins them
into a Completion (its samples in `outputs`); failures raise ClientError with the gRPC status code, the server's
message and its retry hint. Example: docs/server.md."""
from __future__ import annotations

import dataclasses
from typing import AsyncIterator, Iterator, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.wire import meshserve_pb2 as pb
from serving.wire import meshserve_pb2_grpc as pb_grpc

RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
FINISH_REASON_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                       pb.FINISH_REASON_ABORT: "abort", pb.FINISH_REASON_TIMEOUT: "timeout",
                       pb.FINISH_REASON_ERROR: "error", pb.FINISH_REASON_UNSPECIFIED: None}
PRIORITIES = {"interactive": pb.PRIORITY_INTERACTIVE, "batch": pb.PRIORITY_BATCH}
SAMPLING_FIELDS = frozenset(pb.SamplingParameters.DESCRIPTOR.fields_by_name)


class ClientError(Exception):
    """A failed call: `code` (grpc.StatusCode), `details` (the server's message), `retry_after_s` (or None)."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after_s: float | None = None):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.retry_after_s = retry_after_s

    @classmethod
    def from_rpc_error(cls, e) -> "ClientError":
        retry = None
        try:
            for key, value in e.trailing_metadata() or ():
                if key == RETRY_PUSHBACK_KEY:
                    retry = int(value) / 1000.0
        except Exception:  # noqa: BLE001 - some errors carry no metadata
            pass
        return cls(e.code(), e.details() or "", retry)


@dataclasses.dataclass
class Completion:
    """A joined stream. The fields are sample 0's; with n > 1, `outputs` holds every sample's Completion (index 0 ..
    n-1, their own `outputs` empty)."""
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None  # stop / length / ...
    stop_reason: int | str | None
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    logprobs: list  # TokenLogprob messages, when asked for
    time_to_first_token_s: float
    e2e_latency_s: float
    index: int = 0  # the sample
    outputs: list["Completion"] = dataclasses.field(default_factory=list)


def generate_request(prompt: str | Sequence[int] | None = None, *, messages: Sequence[Mapping[str, str]] | None = None,
                     request_id: str = "", priority: str | int = "interactive", tenant: str = "",
                     add_special_tokens: bool | None = None, add_generation_prompt: bool | None = None,
                     **sampling) -> pb.GenerateRequest:
    """Builds a GenerateRequest: a text prompt, token ids, or chat `messages`; sampling fields as keywords
    (max_tokens, temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, logprobs, n (samples),
    logit_bias ({token id: bias}), ...)."""
    unknown = set(sampling) - SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling parameters {sorted(unknown)}; known: {sorted(SAMPLING_FIELDS)}")
    req = pb.GenerateRequest(request_id=request_id, tenant=tenant,
                             priority=PRIORITIES[priority] if isinstance(priority, str) else int(priority))
    if messages is not None:
        req.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m.get("content", "")) for m in messages)
        if add_generation_prompt is not None:
            req.chat.add_generation_prompt = add_generation_prompt
    elif isinstance(prompt, str):
        req.text = prompt
    elif prompt is not None:
        req.token_ids.ids.extend(int(t) for t in prompt)
    if add_special_tokens is not None:
        req.add_special_tokens = add_special_tokens
    for name, value in sampling.items():
        if value is None:
            continue
        field = getattr(req.sampling, name)
        if name == "structured":  # {kind: value, after_reasoning: bool}, as StructuredOutput's keywords
            for key, v in value.items():
                if key == "choice":
                    field.choice.values.extend(v)
                elif v is not None and v is not False:
                    setattr(field, key, v)
        elif isinstance(value, Mapping):
            field.update(value)
        elif isinstance(value, (list, tuple)):
            field.extend(value)
        elif isinstance(value, str) and name == "stop":
            req.sampling.stop.append(value)
        else:
            setattr(req.sampling, name, value)
    return req


class _Collector:
    """Joins a stream's responses, per sample."""

    def __init__(self):
        self.samples: dict[int, tuple[list, list, list, list]] = {}  # index -> (text, ids, logprobs, [last])
        self.rid = ""

    def add(self, r: pb.GenerateResponse) -> None:
        self.rid = r.request_id
        text, ids, logprobs, last = self.samples.setdefault(r.index, ([], [], [], [None]))
        text.append(r.text)
        ids.extend(r.token_ids)
        logprobs.extend(r.logprobs)
        last[0] = r

    def _sample(self, index: int) -> Completion:
        text, ids, logprobs, (r,) = self.samples[index]
        stop = r.stop_token_id if r.WhichOneof("stop_reason") == "stop_token_id" else (r.stop_string or None)
        return Completion(self.rid, "".join(text), ids, FINISH_REASON_NAMES[r.finish_reason], stop,
                          r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.cached_prompt_tokens,
                          logprobs, r.timing.time_to_first_token_s, r.timing.e2e_latency_s, index)

    def result(self) -> Completion:
        outputs = [self._sample(i) for i in sorted(self.samples)]
        return dataclasses.replace(outputs[0], outputs=outputs)


class Client:
    def __init__(self, target: str, *, timeout: float | None = None, channel: grpc.Channel | None = None):
        """timeout: the default deadline of each call in seconds (None: none)."""
        self.channel = channel or grpc.insecure_channel(target, options=_CHANNEL_OPTIONS)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.timeout = timeout

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _t(self, timeout):
        return self.timeout if timeout is None else timeout

    def generate(self, prompt=None, *, timeout: float | None = None, metadata=None, **kw
                 ) -> Iterator[pb.GenerateResponse]:
        """Streams responses (`generate_request`'s keywords; with n > 1, every sample's, by `index`); leaving the
        loop early cancels the request on the server."""
        call = self.stub.Generate(generate_request(prompt, **kw), timeout=self._t(timeout), metadata=metadata)
        try:
            for r in call:
                yield r
        except grpc.RpcError as e:
            raise ClientError.from_rpc_error(e) from None
        finally:
            call.cancel()  # a no-op once the call has ended

    def complete(self, prompt=None, **kw) -> Completion:
        """The whole completion (with n > 1, sample 0's fields and every sample in `outputs`)."""
        c = _Collector()
        for r in self.generate(prompt, **kw):
            c.add(r)
        return c.result()

    def _unary(self, method, request, timeout, metadata=None):
        try:
            return method(request, timeout=self._t(timeout), metadata=metadata)
        except grpc.RpcError as e:
            raise ClientError.from_rpc_error(e) from None

    def load_lora_adapter(self, lora_name: str, lora_path: str, *, metadata=None,
                          timeout: float | None = None) -> pb.LoRAAdapterResponse:
        """Registers the PEFT adapter in the server's directory `lora_path` as `lora_name` (an admin call)."""
        return self._unary(self.stub.LoadLoRAAdapter, pb.LoadLoRAAdapterRequest(lora_name=lora_name,
                                                                                lora_path=lora_path),
                           timeout, metadata)

    def unload_lora_adapter(self, lora_name: str, *, metadata=None,
                            timeout: float | None = None) -> pb.LoRAAdapterResponse:
        return self._unary(self.stub.UnloadLoRAAdapter, pb.UnloadLoRAAdapterRequest(lora_name=lora_name), timeout,
                           metadata)

    def tokenize(self, text: str | None = None, *, messages=None, add_special_tokens: bool | None = None,
                 timeout: float | None = None) -> list[int]:
        return list(self._unary(self.stub.Tokenize, _tokenize_request(text, messages, add_special_tokens),
                                timeout).token_ids)

    def model_info(self, timeout: float | None = None) -> pb.ModelInfoResponse:
        return self._unary(self.stub.ModelInfo, pb.ModelInfoRequest(), timeout)

    def get_load(self, check_invariants: bool = False, timeout: float | None = None) -> pb.LoadReport:
        return self._unary(self.stub.GetLoad, pb.GetLoadRequest(check_invariants=check_invariants), timeout)

    def watch_load(self, interval_ms: int = 1000, timeout: float | None = None) -> Iterator[pb.LoadReport]:
        call = self.stub.WatchLoad(pb.WatchLoadRequest(interval_ms=interval_ms), timeout=self._t(timeout))
        try:
            yield from call
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                raise ClientError.from_rpc_error(e) from None
        finally:
            call.cancel()

    def drain(self, resume: bool = False, timeout: float | None = None) -> pb.DrainResponse:
        return self._unary(self.stub.Drain, pb.DrainRequest(resume=resume), timeout)

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """SERVING / NOT_SERVING / ... from grpc.health.v1."""
        resp = self._unary(self.health_stub.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


class AsyncClient:
    def __init__(self, target: str, *, timeout: float | None = None, channel: grpc.aio.Channel | None = None):
        self.channel = channel or grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.timeout = timeout

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    def _t(self, timeout):
        return self.timeout if timeout is None else timeout

    async def generate(self, prompt=None, *, timeout: float | None = None, metadata=None, **kw
                       ) -> AsyncIterator[pb.GenerateResponse]:
        """Streams responses (as Client.generate); leaving the loop early (or cancelling the task) cancels the
        request."""
        call = self.stub.Generate(generate_request(prompt, **kw), timeout=self._t(timeout), metadata=metadata)
        try:
            async for r in call:
                yield r
        except grpc.RpcError as e:
            raise ClientError.from_rpc_error(e) from None
        finally:
            call.cancel()

    async def complete(self, prompt=None, **kw) -> Completion:
        c = _Collector()
        async for r in self.generate(prompt, **kw):
            c.add(r)
        return c.result()

    async def _unary(self, method, request, timeout):
        try:
            return await method(request, timeout=self._t(timeout))
        except grpc.RpcError as e:
            raise ClientError.from_rpc_error(e) from None

    async def tokenize(self, text: str | None = None, *, messages=None, add_special_tokens: bool | None = None,
                       timeout: float | None = None) -> list[int]:
        resp = await self._unary(self.stub.Tokenize, _tokenize_request(text, messages, add_special_tokens), timeout)
        return list(resp.token_ids)

    async def model_info(self, timeout: float | None = None) -> pb.ModelInfoResponse:
        return await self._unary(self.stub.ModelInfo, pb.ModelInfoRequest(), timeout)

    async def get_load(self, check_invariants: bool = False, timeout: float | None = None) -> pb.LoadReport:
        return await self._unary(self.stub.GetLoad, pb.GetLoadRequest(check_invariants=check_invariants), timeout)

    async def watch_load(self, interval_ms: int = 1000, timeout: float | None = None
                         ) -> AsyncIterator[pb.LoadReport]:
        call = self.stub.WatchLoad(pb.WatchLoadRequest(interval_ms=interval_ms), timeout=self._t(timeout))
        try:
            async for r in call:
                yield r
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                raise ClientError.from_rpc_error(e) from None
        finally:
            call.cancel()

    async def drain(self, resume: bool = False, timeout: float | None = None) -> pb.DrainResponse:
        return await self._unary(self.stub.Drain, pb.DrainRequest(resume=resume), timeout)

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        resp = await self._unary(self.health_stub.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def _tokenize_request(text, messages, add_special_tokens) -> pb.TokenizeRequest:
    req = pb.TokenizeRequest()
    if messages is not None:
        req.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m.get("content", "")) for m in messages)
    elif text is not None:
        req.text = text
    if add_special_tokens is not None:
        req.add_special_tokens = add_special_tokens
    return req
