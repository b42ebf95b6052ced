"""What every HTTP request meets before a route runs (`HttpGuard`, an ASGI middleware): the caller's key, checked from
the headers alone; the body capped (a `Content-Length` over the cap refused unread, a chunked body cut off once past
it: 413) and read within a deadline (408), then handed to the app whole; a request id on every response. The uvicorn
protocols that time out slow headers (`guarded_protocol`). Who may call which route: docs/security.md."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
from typing import Callable

from serving.api.protocol import ApiError

log = logging.getLogger(__name__)

# Readiness probes send no credentials; /health says only whether the process serves.
OPEN_PATHS = frozenset({"/health"})
REQUEST_ID_HEADER = b"x-request-id"
MAX_CLIENT_REQUEST_ID = 128  # a client's x-request-id longer than this (or not printable) is replaced
MAX_HEADER_BYTES = 64 << 10  # a request line + headers larger than this close the connection (nginx's 4 x 8K, x2)


@dataclasses.dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one HTTP client may cost the process, before the app sees its request."""
    header_timeout_s: float = 10.0  # from the connection (or the last response) to a request's complete headers
    body_timeout_s: float = 60.0  # from the headers to the body's last byte
    max_connections: int = 1024  # past this many open connections (or running requests), new requests get 503

    def __post_init__(self):
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")


def request_id(scope) -> str:
    """The id of the request in `scope` (set by the guard; '' outside it)."""
    return scope.get("state", {}).get("request_id", "")


def _client_request_id(headers) -> str:
    for name, value in headers:
        if name == REQUEST_ID_HEADER:
            if 0 < len(value) <= MAX_CLIENT_REQUEST_ID and all(0x21 <= b <= 0x7E for b in value):
                return value.decode()
            break
    return "req-" + secrets.token_hex(12)


class _Refusal(Exception):
    def __init__(self, error: ApiError):
        self.error = error


class HttpGuard:
    """Wraps the app: `authorize(headers)` (lower-case str pairs; raises ApiError 401 / 403) runs on every path but
    OPEN_PATHS before a byte of the body is read; then the body is read, at most `max_body()` bytes within
    `limits.body_timeout_s`, and replayed to the app."""

    def __init__(self, app, limits: HttpLimits, authorize: Callable[[list[tuple[str, str]]], object],
                 max_body: Callable[[], int]):
        self.app, self.limits, self.authorize, self.max_body = app, limits, authorize, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = _client_request_id(scope["headers"])
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (REQUEST_ID_HEADER, rid.encode())]}
            await send(message)
        try:
            if scope["path"] not in OPEN_PATHS:
                self.authorize([(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"]])
            body = await self._read_body(scope, receive)
        except (ApiError, _Refusal) as e:  # the body is not read to its end: the connection carries nothing more
            return await _send_error(send_with_id, e.error if isinstance(e, _Refusal) else e)
        return await self.app(scope, _replay(body, receive), send_with_id)

    async def _read_body(self, scope, receive) -> bytes:
        cap = self.max_body()
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    raise _Refusal(ApiError(400, f"Content-Length must be an integer, got {value[:32]!r}")) from None
                if length > cap:
                    raise _Refusal(_too_large(f"Content-Length is {length} bytes", cap))
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        break
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > cap:
                        raise _Refusal(_too_large(f"the body passed {cap} bytes", cap))
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            raise _Refusal(ApiError(408, f"the request body did not arrive within {self.limits.body_timeout_s:g}s "
                                    f"({size} bytes came)", code="request_timeout")) from None
        return b"".join(chunks)


def _too_large(what: str, cap: int) -> ApiError:
    return ApiError(413, f"{what}, over the server's limit of {cap} bytes (--max_request_bytes + 64 KiB); send a "
                    "smaller request", code="request_too_large")


async def _send_error(send, e: ApiError) -> None:
    body = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    headers += [(k.lower().encode(), v.encode()) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _replay(body: bytes, receive):
    """The app's receive: the body read by the guard once, then the connection's own messages (a disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replayed


def guarded_protocol(base: type, header_timeout_s: float) -> type:
    """uvicorn's HTTP protocol class `base` (h11 or httptools) closing a connection whose request headers are not
    complete `header_timeout_s` after it opened or after its last response (one byte a second holds nothing), or
    whose headers pass MAX_HEADER_BYTES (a fast client cannot make the parser buffer without end either)."""

    class Guarded(base):
        _header_timer: asyncio.TimerHandle | None = None
        _header_bytes = 0

        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._header_timer is None and self._waiting_for_headers():
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self._waiting_for_headers() and not self.transport.is_closing():
                log.debug("HTTP: closed %s: no complete request headers within %gs", self.client, header_timeout_s)
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            self._arm()
            super().data_received(data)
            if not self._waiting_for_headers():
                self._disarm()
                self._header_bytes = 0
                return
            self._header_bytes += len(data)  # all of it went to headers not complete yet
            if self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
                log.debug("HTTP: closed %s: request headers past %d bytes", self.client, MAX_HEADER_BYTES)
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._header_bytes = 0
            self._arm()  # the next request's headers are due in time too (the keep-alive timeout closes idle ones)

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded
