"""The serving benchmark's backends: the records of a request and of its timed stream (`SampleRequest`,
`RequestOutput`), and the clients that send it over meshserve.v1 gRPC (`GrpcBackend`) or the OpenAI-compatible HTTP
API (`OpenAIBackend` on aiohttp, its Server-Sent Events read by `SSEDecoder`); `make_backend` picks one by name."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from typing import Sequence


@dataclasses.dataclass(slots=True)
class SampleRequest:
    prompt: str | list[int]  # token ids (random) or text (ShareGPT)
    prompt_len: int
    output_len: int
    prompt_text: str = ""  # random prompts' token ids as text, for chat (OpenAIBackend.prepare fills it)
    after: int = -1  # multi-turn: the index of the request (its previous turn) that must finish before it is sent
    adapter: str = ""  # the LoRA adapter it names (gRPC sampling.adapter, OpenAI `model`); "": the base model


@dataclasses.dataclass(slots=True)
class RequestOutput:
    prompt_len: int  # the server's count where it says (HTTP usage), else the dataset's
    requested_output_len: int  # over all samples
    success: bool = False
    error: str = ""
    output_len: int = 0  # tokens streamed back, every sample's
    cached_tokens: int = 0  # prompt tokens the server found in its prefix cache
    num_samples: int = 1  # n
    start_s: float = 0.0  # sent, seconds from the benchmark's start
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = dataclasses.field(default_factory=list)  # gaps between a sample's chunks carrying tokens
    chunk_times_s: list[float] = dataclasses.field(default_factory=list)  # from the benchmark's start
    chunk_tokens: list[int] = dataclasses.field(default_factory=list)


BACKENDS = ("grpc", "openai", "openai-chat")
BACKEND_LABELS = {"grpc": "meshserve-grpc", "openai": "openai", "openai-chat": "openai-chat"}  # the JSON's "backend"


def parse_backends(spec: str) -> list[str]:
    """'grpc,openai' -> ['grpc', 'openai'] (each one of BACKENDS, once)."""
    names = [s.strip() for s in (spec or "").split(",") if s.strip()]
    unknown = [s for s in names if s not in BACKENDS]
    if not names or unknown:
        raise ValueError(f"--backend={spec!r}: expected one of {list(BACKENDS)} or a comma list of them")
    if len(set(names)) < len(names):
        raise ValueError(f"--backend={spec!r} names a backend twice")
    return names


class _Clock:
    """Stamps one request's stream: TTFT at its first chunk carrying output (any sample's), ITL between one sample's
    chunks."""

    def __init__(self, out: RequestOutput, t0: float):
        self.out, self.t0 = out, t0
        self.start = time.perf_counter()
        self.last: dict[int, float] = {}  # sample -> its last chunk's time
        out.start_s = self.start - t0

    def chunk(self, num_tokens: int, sample: int = 0) -> None:
        now, o = time.perf_counter(), self.out
        if not o.chunk_times_s:
            o.ttft_s = now - self.start
        if sample in self.last:
            o.itl_s.append(now - self.last[sample])
        self.last[sample] = now
        o.output_len += num_tokens
        o.chunk_times_s.append(now - self.t0)
        o.chunk_tokens.append(num_tokens)

    def end(self) -> None:
        o = self.out
        o.latency_s = time.perf_counter() - self.start
        o.success = o.output_len > 0
        o.error = "" if o.success else "the stream ended without a token"


class GrpcBackend:
    """meshserve.v1 Inference.Generate: every request a stream on one grpc.aio channel (HTTP/2). A response carrying
    token ids is a chunk; with n > 1, every sample's."""
    name = "grpc"

    def __init__(self, target: str, *, n: int = 1, temperature: float = 0.0, ignore_eos: bool = True,
                 timeout_s: float = 0.0):
        self.address, self.n = target, n
        self.sampling = dict(temperature=temperature, ignore_eos=ignore_eos, n=n if n > 1 else None)
        self.timeout = timeout_s or None
        self.client = None

    async def __aenter__(self) -> "GrpcBackend":
        from serving.wire.client import AsyncClient
        self.client = AsyncClient(self.address)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()

    async def prepare(self, requests: Sequence[SampleRequest]) -> None:
        pass  # token ids and text go as they are

    async def send(self, req: SampleRequest, t0: float) -> RequestOutput:
        from serving.wire.client import ClientError
        out = RequestOutput(req.prompt_len, req.output_len * self.n, num_samples=self.n)
        clock = _Clock(out, t0)
        try:
            async for r in self.client.generate(req.prompt, max_tokens=req.output_len, timeout=self.timeout,
                                                adapter=req.adapter or None, **self.sampling):
                if r.token_ids:
                    clock.chunk(len(r.token_ids), r.index)
                if r.finish_reason and r.index == 0:
                    out.cached_tokens = r.usage.cached_prompt_tokens
            clock.end()
        except ClientError as e:
            out.error = str(e)
        except Exception as e:  # noqa: BLE001 - a broken stream fails this request, not the benchmark
            out.error = f"{type(e).__name__}: {e}"
        return out


_LINE_END = re.compile(rb"\r\n|\r|\n")


class SSEDecoder:
    """Server-Sent Events from a byte stream fed in pieces of any size: `feed` returns the data of each event completed
    (its `data:` lines joined by newlines) once the blank line ending it has come. Lines end in LF, CRLF or CR (a CR
    at a piece's end waits for a possible LF); comments (`:`) and other fields (event, id, retry) are skipped; an
    event the stream's end cuts off is dropped, as the spec says."""

    def __init__(self):
        self._pending = b""
        self._data: list[str] = []

    def feed(self, piece: bytes) -> list[str]:
        buf, pos, events = self._pending + piece, 0, []
        while (m := _LINE_END.search(buf, pos)) is not None:
            if m.group() == b"\r" and m.end() == len(buf):
                break
            self._line(buf[pos:m.start()], events)
            pos = m.end()
        self._pending = buf[pos:]
        return events

    def _line(self, line: bytes, events: list[str]) -> None:
        if not line:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(b":"):
            return
        name, _, value = line.partition(b":")
        if name == b"data":
            self._data.append(value[1:].decode() if value.startswith(b" ") else value.decode())


def _error_message(body: bytes) -> str:
    """An OpenAI error body's message (else the body itself, cut short)."""
    try:
        error = json.loads(body)["error"]
        return (error.get("message") or str(error)) if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        return body[:300].decode(errors="replace")


class OpenAIBackend:
    """The OpenAI-compatible HTTP API, as `vllm bench serve`'s openai backends: one streamed POST per request
    (`stream_options.include_usage`) on one aiohttp session, its pool of keep-alive connections as large as the
    concurrency cap, the Server-Sent Events read by `SSEDecoder`. A chunk carrying text is a chunk; output tokens come
    from the usage chunk's completion_tokens (else one per chunk). chat: one user message holding the prompt's text."""

    def __init__(self, base_url: str, *, chat: bool, n: int = 1, temperature: float = 0.0, ignore_eos: bool = True,
                 timeout_s: float = 0.0, max_connections: int = 0, model: str = ""):
        if not re.match(r"https?://", base_url or ""):
            raise ValueError(f"the {'openai-chat' if chat else 'openai'} backend needs --base_url=http://HOST:PORT "
                             f"(the server's --http_port), got {base_url!r}")
        self.name = "openai-chat" if chat else "openai"
        self.address, self.chat, self.n, self.model = base_url.rstrip("/"), chat, n, model
        self.url = self.address + ("/v1/chat/completions" if chat else "/v1/completions")
        self.sampling = {"temperature": temperature, "ignore_eos": ignore_eos, **({"n": n} if n > 1 else {})}
        self.timeout = timeout_s or None
        self.max_connections = max_connections  # 0: no cap
        self.http = None

    async def __aenter__(self) -> "OpenAIBackend":
        import aiohttp
        # Keep-alive connections, as many as the concurrency cap; no read timeout (a request's deadline is
        # --request_timeout_s); trust_env off: no proxy between us and the server.
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.max_connections),
                                          timeout=aiohttp.ClientTimeout(total=None, sock_connect=30), trust_env=False)
        try:
            if not self.model:
                models = (await self._json("GET", "/v1/models")).get("data")
                if not models:
                    raise RuntimeError(f"GET {self.address}/v1/models: the server lists no model")
                self.model = models[0]["id"]
        except BaseException:
            await self.http.close()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.close()

    async def _json(self, method: str, path: str, body: dict | None = None) -> dict:
        """A small request's JSON answer; any status but 200 raises, with the server's message."""
        async with self.http.request(method, self.address + path, json=body) as resp:
            content = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{method} {self.address}{path}: HTTP {resp.status}: {_error_message(content)}")
        return json.loads(content)

    async def prepare(self, requests: Sequence[SampleRequest]) -> None:
        """chat: the token ids of random prompts as text, once per prompt and before any timing (POST /detokenize)."""
        if not self.chat:
            return
        todo = list({id(r): r for r in requests if not isinstance(r.prompt, str) and not r.prompt_text}.values())
        limit = asyncio.Semaphore(16)

        async def detokenize(r: SampleRequest) -> None:
            async with limit:
                r.prompt_text = (await self._json("POST", "/detokenize", {"tokens": list(r.prompt)}))["prompt"]
        await asyncio.gather(*(detokenize(r) for r in todo))

    def body(self, req: SampleRequest) -> dict:
        body = {"model": req.adapter or self.model, "stream": True, "stream_options": {"include_usage": True},
                **self.sampling}
        if self.chat:
            text = req.prompt if isinstance(req.prompt, str) else req.prompt_text
            if not text:
                raise ValueError("openai-chat sends text: prepare() turns token-id prompts into text first")
            body.update(messages=[{"role": "user", "content": text}], max_completion_tokens=req.output_len)
        else:
            body.update(prompt=req.prompt, max_tokens=req.output_len)
        return body

    async def send(self, req: SampleRequest, t0: float) -> RequestOutput:
        out = RequestOutput(req.prompt_len, req.output_len * self.n, num_samples=self.n)
        body = self.body(req)
        clock = _Clock(out, t0)
        try:
            async with asyncio.timeout(self.timeout):
                async with self.http.post(self.url, json=body) as resp:
                    if resp.status != 200:
                        out.error = f"HTTP {resp.status}: {_error_message(await resp.read())}"
                        return out
                    await self._read(resp, out, clock)
        except TimeoutError:
            out.success, out.error = False, f"no answer within the request's deadline of {self.timeout:g} s"
        except Exception as e:  # noqa: BLE001 - a broken stream fails this request, not the benchmark
            out.success, out.error = False, f"{type(e).__name__}: {e}"
        return out

    async def _read(self, resp, out: RequestOutput, clock: _Clock) -> None:
        decoder, usage = SSEDecoder(), None
        async for piece in resp.content.iter_any():
            for data in decoder.feed(piece):
                if data.strip() == "[DONE]":
                    continue
                event = json.loads(data)
                if event.get("error"):  # after the status line, OpenAI's servers report failures in the stream
                    out.error = f"error in the stream: {_error_message(data.encode())}"
                    return
                for choice in event.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
                    if text:
                        clock.chunk(1, choice.get("index", 0))
                usage = event.get("usage") or usage
        clock.end()
        if usage:
            completion = int(usage.get("completion_tokens") or 0)
            if completion and out.chunk_tokens:  # chunks that held several tokens (text held back mid-character)
                out.chunk_tokens[-1] = max(0, out.chunk_tokens[-1] + completion - out.output_len)
                out.output_len = completion
            out.prompt_len = int(usage.get("prompt_tokens") or out.prompt_len)
            out.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def make_backend(name: str, *, target: str = "", base_url: str = "", n: int = 1, temperature: float = 0.0,
                 ignore_eos: bool = True, timeout_s: float = 0.0, max_connections: int = 0):
    """A backend by its --backend name (an async context manager: open it, `prepare` the requests, `send` them)."""
    if name == "grpc":
        return GrpcBackend(target, n=n, temperature=temperature, ignore_eos=ignore_eos, timeout_s=timeout_s)
    if name in ("openai", "openai-chat"):
        return OpenAIBackend(base_url, chat=name == "openai-chat", n=n, temperature=temperature,
                             ignore_eos=ignore_eos, timeout_s=timeout_s, max_connections=max_connections)
    raise ValueError(f"backend {name!r}: expected one of {list(BACKENDS)}")
