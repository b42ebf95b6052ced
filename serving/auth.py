"""API keys of an instance server: `KeyFile` (one or more keys in a file, re-read when it changes), `InstanceKeys` (a
caller's key checked in constant time against the regular and the admin keys; the one check the gRPC interceptor and
the HTTP middleware both call), `AuthInterceptor` (refuses a call before its request is read or decoded) and
`bind_warning`. Shared by both sides of the wire (the gateway sends its instance key): imports nothing of serving."""
from __future__ import annotations

import enum
import hmac
import ipaddress
import logging
import os
import threading
import time

import grpc

log = logging.getLogger(__name__)

MIN_KEY_CHARS = 16  # a shorter key is guessable; refused at load
RELOAD_CHECK_S = 1.0  # a key file's stat is looked at most this often
# Methods a regular key may not call: they take an instance out of service, stall its engine thread, or read a
# directory on the server's disk (LoRA loads, under --lora_root) and change what every tenant is served.
ADMIN_METHODS = frozenset({"/meshserve.v1.Inference/Drain", "/meshserve.v1.Inference/LoadLoRAAdapter",
                           "/meshserve.v1.Inference/UnloadLoRAAdapter"})
# GetLoad is regular, but with check_invariants (a scan of every page on the engine thread) it is an admin call.
INVARIANTS_METHOD = "/meshserve.v1.Inference/GetLoad"
# Open to anyone who reaches the port: orchestrators' readiness probes send no credentials.
OPEN_SERVICES = ("/grpc.health.v1.Health/",)
REFUSAL_LOG_INTERVAL_S = 60.0


def api_key_from_metadata(pairs) -> str:
    """The key of gRPC metadata or HTTP headers (lower-case names): `authorization: Bearer <key>` or `x-api-key`."""
    for key, value in pairs or ():
        if key == "authorization" and isinstance(value, str) and value.lower().startswith("bearer "):
            return value[7:].strip()
        if key == "x-api-key" and isinstance(value, str):
            return value.strip()
    return ""


class Role(enum.IntEnum):
    NONE = 0  # no key is configured for this level: anyone
    REGULAR = 1
    ADMIN = 2


class Refused(Exception):
    """A call without the key it needs: `grpc_code` / `http_status` say which refusal (UNAUTHENTICATED 401: no key
    or an unknown one; PERMISSION_DENIED 403: a regular key where an admin key is needed)."""

    def __init__(self, grpc_code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.grpc_code = grpc_code
        self.message = message

    @property
    def http_status(self) -> int:
        return 401 if self.grpc_code == grpc.StatusCode.UNAUTHENTICATED else 403


def read_keys(path: str, flag: str) -> tuple[bytes, ...]:
    """The keys in `path`: one per line; blank lines and `#` comments skipped; each at least MIN_KEY_CHARS. Errors
    name the file and the line, never a key."""
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"{flag}={path}: cannot read it: {e.strerror}") from None
    keys = []
    for number, line in enumerate(lines, 1):
        key = line.strip()
        if not key or key.startswith(b"#"):
            continue
        if len(key) < MIN_KEY_CHARS or any(b < 0x21 or b > 0x7E for b in key):
            raise ValueError(f"{flag}={path}: line {number} is not a key of {MIN_KEY_CHARS} or more printable ASCII "
                             "characters without spaces (e.g. `head -c 32 /dev/urandom | base64`)")
        keys.append(key)
    if not keys:
        raise ValueError(f"{flag}={path}: no key in the file (one key per line)")
    return tuple(keys)


class KeyFile:
    """The keys of a file, re-read when its modification time, size or inode change (looked at no more than once a
    second). A changed file that no longer reads as keys (empty, half-written) keeps the keys in force and logs why:
    a broken file never opens the port."""

    def __init__(self, path: str, flag: str):
        self.path, self.flag = path, flag
        self.keys = read_keys(path, flag)
        self._stamp = self._file_stamp()
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    def _file_stamp(self):
        try:
            st = os.stat(self.path)
            return st.st_mtime_ns, st.st_size, st.st_ino
        except OSError:
            return None

    def current(self) -> tuple[bytes, ...]:
        now = time.monotonic()
        if now - self._checked < RELOAD_CHECK_S:
            return self.keys
        with self._lock:
            self._checked = now
            stamp = self._file_stamp()
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self.keys = read_keys(self.path, self.flag)
                    log.info("%s=%s re-read: %d keys", self.flag, self.path, len(self.keys))
                except ValueError as e:
                    log.error("%s; keeping the %d keys read before", e, len(self.keys))
        return self.keys

    def first(self) -> str:
        """The key a client sends (the file's first)."""
        return self.current()[0].decode()


def _matches(key: bytes, keys: tuple[bytes, ...]) -> bool:
    found = False
    for k in keys:  # no early exit: the time does not say which key (or whether any) matched
        found |= hmac.compare_digest(k, key)
    return found


class InstanceKeys:
    """Who may call an instance: with `api_key_file`, callers need one of its keys (or an admin key); with
    `admin_key_file`, admin calls need one of its keys. Without a file for a level, that level is open; with regular
    keys but no admin keys, admin calls are refused (no key opens them)."""

    def __init__(self, api_key_file: str = "", admin_key_file: str = ""):
        self.regular = KeyFile(api_key_file, "--api_key_file") if api_key_file else None
        self.admin = KeyFile(admin_key_file, "--admin_key_file") if admin_key_file else None

    @property
    def enabled(self) -> bool:
        return self.regular is not None or self.admin is not None

    def authorize(self, pairs, *, admin: bool = False) -> Role:
        """The caller's role from its metadata or headers, if it may make a call of this level; raises Refused."""
        if not admin and self.regular is None:
            return Role.NONE
        if admin and self.admin is None and self.regular is None:
            return Role.NONE  # no keys at all: a development setup
        key = api_key_from_metadata(pairs).encode()
        if not key:
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, "no API key; send `authorization: Bearer <key>`"
                          + (" with an admin key" if admin else ""))
        if self.admin is not None and _matches(key, self.admin.current()):
            return Role.ADMIN
        if self.regular is not None and _matches(key, self.regular.current()):
            if admin:
                raise Refused(grpc.StatusCode.PERMISSION_DENIED, "this call needs an admin key (--admin_key_file)"
                              if self.admin is not None else "admin calls are off: the server has no --admin_key_file")
            return Role.REGULAR
        raise Refused(grpc.StatusCode.UNAUTHENTICATED, "unknown API key")


def _refusal(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that ends the call with `code` without reading its request: a stream handler never asks for a
    message, so not one byte of the body is parsed."""
    async def refuse(request_iterator, context):
        await context.abort(code, message)
    return grpc.stream_stream_rpc_method_handler(refuse)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Installed first on the instance's gRPC server: a call's metadata is checked before anything else runs for it
    (no handler, no deserializer). GetLoad with check_invariants is checked once its (small) request is decoded."""

    def __init__(self, keys: InstanceKeys, on_refused=None):
        self.keys = keys
        self._on_refused = on_refused or (lambda code: None)  # metrics: counts refusals by code
        self._refused_since_log = 0
        self._last_log = 0.0

    def _refused(self, e: Refused, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        self._on_refused(e.grpc_code.name)
        self._refused_since_log += 1
        now = time.monotonic()
        if now - self._last_log >= REFUSAL_LOG_INTERVAL_S:  # a flood of bad keys must not flood the log
            log.warning("refused %d calls without a valid key since the last such report (latest: %s, %s: %s)",
                        self._refused_since_log, details.method, e.grpc_code.name, e.message)
            self._refused_since_log, self._last_log = 0, now
        return _refusal(e.grpc_code, e.message)

    async def intercept_service(self, continuation, details):
        method = details.method or ""
        if not self.keys.enabled or method.startswith(OPEN_SERVICES):
            return await continuation(details)
        try:
            role = self.keys.authorize(details.invocation_metadata, admin=method in ADMIN_METHODS)
        except Refused as e:
            return self._refused(e, details)
        handler = await continuation(details)
        if method != INVARIANTS_METHOD or role == Role.ADMIN or handler is None or handler.unary_unary is None:
            return handler
        inner, keys = handler.unary_unary, self.keys

        async def get_load(request, context):
            if getattr(request, "check_invariants", False):
                try:
                    keys.authorize(context.invocation_metadata(), admin=True)
                except Refused as e:
                    self._on_refused(e.grpc_code.name)
                    await context.abort(e.grpc_code, "check_invariants: " + e.message)
            return await inner(request, context)
        return grpc.unary_unary_rpc_method_handler(get_load, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_warning(host: str, port: int, keys: InstanceKeys) -> str:
    """The warning for a server on a non-loopback address that callers need no key for; '' if none is due (a regular
    key file without an admin one closes the admin calls to everyone)."""
    if is_loopback(host) or keys.regular is not None:
        return ""
    can = "generate (bypassing the gateway's tenants and limits), read its load and its model"
    can += ", and drain it" if keys.admin is None else ""
    return (f"listening on {host}:{port} without --api_key_file: anyone who reaches the port can {can}. Give it "
            "--api_key_file (and --admin_key_file), bind 127.0.0.1, or fence the port (docs/security.md)")
