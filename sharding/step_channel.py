"""The leader -> follower step channel of a multi-host instance: a fixed wire schema (`encode` / `decode`: tagged
scalars, strings, tuples, dicts, allow-listed dataclasses and raw little-endian array buffers; never pickle), a
mutual HMAC challenge-response over a shared secret, and a MAC plus sequence number on every message, so whoever
reaches the port can neither run code, join as a follower, nor inject, replay or reorder steps. Details:
docs/security.md."""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import queue
import secrets
import socket
import struct
import threading
import time
from typing import Any, Callable, Iterable

import ml_dtypes
import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"MSSTEP1\0"  # protocol and version: the first bytes each side sends
NONCE_BYTES = 32
MAC_BYTES = 32  # HMAC-SHA256
MIN_SECRET_BYTES = 16
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30  # a step's inputs, penalty windows of long contexts included
HANDSHAKE_TIMEOUT_S = 10.0
MAX_PENDING_HANDSHAKES = 32  # connections in their handshake at once; more are closed on accept
_MAX_DEPTH = 8
_MAX_ITEMS = 4096  # tuple / dict / record entries in one message
_MAX_NDIM = 8
_MAX_STR = 256
SECRET_ENV = "MESHSERVE_STEP_SECRET"
SECRET_FILE_ENV = "MESHSERVE_STEP_SECRET_FILE"

# The only array types that travel; each a one-byte code (a new one takes the next code).
_DTYPES = [np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                                 np.uint64, np.float16, np.float32, np.float64)] + [np.dtype(ml_dtypes.bfloat16)]
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
_NONE, _BOOL, _INT, _FLOAT, _STR, _ARRAY, _TUPLE, _DICT, _RECORD = range(9)


class ProtocolError(ConnectionError):
    """Bytes that do not follow the step channel's schema, or a message that fails its MAC."""


class AuthenticationError(ConnectionError):
    """The other end does not hold the shared secret (or is not a step channel peer)."""


def load_secret(path: str = "", value: str = "") -> bytes:
    """The shared secret: from `path` (a file), else `value`, else $MESHSERVE_STEP_SECRET_FILE, else
    $MESHSERVE_STEP_SECRET; surrounding whitespace stripped. Raises ValueError when none is given or it is shorter
    than MIN_SECRET_BYTES."""
    path = path or ("" if value else os.environ.get(SECRET_FILE_ENV, ""))
    if path:
        with open(path, "rb") as f:
            secret = f.read().strip()
        where = f"step channel secret file {path}"
    else:
        secret = (value or os.environ.get(SECRET_ENV, "")).strip().encode()
        where = "step channel secret" if value else f"${SECRET_ENV}"
    if not secret:
        raise ValueError(f"a multi-host instance needs a step channel secret shared by all its processes "
                         f"(--step_channel_secret_file, ${SECRET_FILE_ENV} or ${SECRET_ENV}); e.g. "
                         "`head -c 32 /dev/urandom | base64 > step.secret`")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{where}: {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed")
    return secret


# ---------------------------------------------------------------------------------------------------- the schema
def encode(obj: Any) -> bytes:
    """`obj` in the wire schema: None, bool, int, float, str, numpy arrays (and scalars), tuples / lists, dicts with
    str keys, dataclass instances (by class name and fields). Raises TypeError for anything else."""
    out = bytearray()
    _encode(obj, out, 0)
    return bytes(out)


def _encode(x, out: bytearray, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise TypeError(f"nested deeper than {_MAX_DEPTH}")
    if x is None:
        out.append(_NONE)
    elif isinstance(x, (bool, np.bool_)):
        out += struct.pack("<BB", _BOOL, bool(x))
    elif isinstance(x, (int, np.integer)):
        out += struct.pack("<Bq", _INT, int(x))
    elif isinstance(x, (float, np.floating)) and not isinstance(x, np.ndarray):
        out += struct.pack("<Bd", _FLOAT, float(x))
    elif isinstance(x, str):
        out.append(_STR)
        _encode_str(x, out)
    elif isinstance(x, np.ndarray) or hasattr(x, "__array__") and hasattr(x, "dtype"):
        a = np.asarray(x)
        if a.dtype not in _DTYPE_CODE:
            raise TypeError(f"array dtype {a.dtype} does not travel; dtypes: {', '.join(map(str, _DTYPES))}")
        if a.ndim > _MAX_NDIM:
            raise TypeError(f"array of {a.ndim} dimensions; at most {_MAX_NDIM}")
        a = np.ascontiguousarray(a, a.dtype.newbyteorder("<"))
        out += struct.pack("<BBB", _ARRAY, _DTYPE_CODE[a.dtype.newbyteorder("=")], a.ndim)
        out += struct.pack(f"<{a.ndim}Q", *a.shape)
        out += a.tobytes()
    elif isinstance(x, (tuple, list)):
        out += struct.pack("<BI", _TUPLE, len(x))
        for item in x:
            _encode(item, out, depth + 1)
    elif isinstance(x, dict):
        out += struct.pack("<BI", _DICT, len(x))
        for k, v in x.items():
            if not isinstance(k, str):
                raise TypeError(f"dict key {k!r}: only str keys travel")
            _encode_str(k, out)
            _encode(v, out, depth + 1)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = dataclasses.fields(x)
        out.append(_RECORD)
        _encode_str(type(x).__name__, out)
        out += struct.pack("<I", len(fields))
        for f in fields:
            _encode_str(f.name, out)
            _encode(getattr(x, f.name), out, depth + 1)
    else:
        raise TypeError(f"{type(x).__name__} does not travel on the step channel")


def _encode_str(s: str, out: bytearray) -> None:
    b = s.encode()
    if len(b) > _MAX_STR:
        raise TypeError(f"string of {len(b)} bytes; at most {_MAX_STR}")
    out += struct.pack("<H", len(b)) + b


class _Reader:
    def __init__(self, data, records: dict[str, type]):
        self.data = memoryview(data)
        self.pos = 0
        self.items = 0
        self.records = records

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise ProtocolError(f"message truncated: {n} bytes wanted at offset {self.pos} of {len(self.data)}")
        view = self.data[self.pos:self.pos + n]
        self.pos += n
        return view

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def string(self) -> str:
        (n,) = self.unpack("<H")
        if n > _MAX_STR:
            raise ProtocolError(f"string of {n} bytes; at most {_MAX_STR}")
        try:
            return bytes(self.take(n)).decode()
        except UnicodeDecodeError as e:
            raise ProtocolError(f"string not UTF-8: {e}") from None

    def count(self) -> int:
        (n,) = self.unpack("<I")
        self.items += n
        if self.items > _MAX_ITEMS:
            raise ProtocolError(f"more than {_MAX_ITEMS} entries in one message")
        return n

    def value(self, depth: int = 0):
        if depth > _MAX_DEPTH:
            raise ProtocolError(f"nested deeper than {_MAX_DEPTH}")
        (tag,) = self.unpack("<B")
        if tag == _NONE:
            return None
        if tag == _BOOL:
            (b,) = self.unpack("<B")
            if b > 1:
                raise ProtocolError(f"bool byte {b}")
            return bool(b)
        if tag == _INT:
            return self.unpack("<q")[0]
        if tag == _FLOAT:
            return self.unpack("<d")[0]
        if tag == _STR:
            return self.string()
        if tag == _ARRAY:
            code, ndim = self.unpack("<BB")
            if code >= len(_DTYPES) or ndim > _MAX_NDIM:
                raise ProtocolError(f"array dtype code {code} (0..{len(_DTYPES) - 1}) or ndim {ndim} (<= {_MAX_NDIM})")
            shape = self.unpack(f"<{ndim}Q")
            dtype = _DTYPES[code].newbyteorder("<")
            size = dtype.itemsize
            for d in shape:
                if d > 1 << 40:
                    raise ProtocolError(f"array dimension {d} in shape {shape}")
                size *= d
                if size > len(self.data):  # before anything is allocated
                    raise ProtocolError(f"array of shape {shape} is larger than the message")
            a = np.frombuffer(bytearray(self.take(size)), dtype).reshape(shape)
            return a.astype(_DTYPES[code], copy=False)
        if tag == _TUPLE:
            return tuple(self.value(depth + 1) for _ in range(self.count()))
        if tag == _DICT:
            n = self.count()
            return {self.string(): self.value(depth + 1) for _ in range(n)}
        if tag == _RECORD:
            name = self.string()
            cls = self.records.get(name)
            if cls is None:
                raise ProtocolError(f"record type {name!r} is not one this side takes ({', '.join(self.records)})")
            n = self.count()
            kw = {}
            for _ in range(n):
                key = self.string()
                kw[key] = self.value(depth + 1)
            names = {f.name for f in dataclasses.fields(cls)}
            if set(kw) != names:
                raise ProtocolError(f"record {name}: fields {sorted(kw)}, expected {sorted(names)}")
            try:
                return cls(**kw)
            except (TypeError, ValueError) as e:
                raise ProtocolError(f"record {name}: {e}") from None
        raise ProtocolError(f"unknown value tag {tag}")


def decode(data, records: Iterable[type] = ()) -> Any:
    """The value `encode` wrote; dataclasses only of the types in `records` (matched by class name, every field
    present). Raises ProtocolError naming what does not fit the schema."""
    reader = _Reader(data, {cls.__name__: cls for cls in records})
    value = reader.value()
    if reader.pos != len(reader.data):
        raise ProtocolError(f"{len(reader.data) - reader.pos} bytes after the value")
    return value


# ---------------------------------------------------------------------------------------------------- the handshake
def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    """n bytes, read in chunks (a length that lies allocates only what really arrives); with a `deadline`
    (time.monotonic()), socket.timeout once it passes, however slowly the bytes trickle in."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(f"handshake not finished in time ({len(buf)} of {n} bytes)")
            sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), 1 << 24))
        if not chunk:
            raise ConnectionError("the step channel closed")
        buf += chunk
    return buf


class _Framer:
    """Messages after the handshake: [u32 length][body][HMAC(session key, direction, sequence, length, body)]; the
    sequence is counted by both ends, never sent, so a replayed, dropped or reordered message fails its MAC."""

    def __init__(self, session_key: bytes, direction: bytes, max_message_bytes: int):
        self.key = session_key
        self.direction = direction
        self.max_message_bytes = max_message_bytes
        self.seq = 0

    def frame(self, body: bytes) -> bytes:
        if len(body) > self.max_message_bytes:
            raise ValueError(f"step message of {len(body)} bytes; the cap is {self.max_message_bytes}")
        head = struct.pack("<I", len(body)) if len(body) < 1 << 32 else None
        if head is None:
            raise ValueError(f"step message of {len(body)} bytes does not fit a u32 length")
        tag = _mac(self.key, self.direction, struct.pack("<Q", self.seq), head, body)
        self.seq += 1
        return head + body + tag

    def read(self, sock: socket.socket) -> bytes:
        head = bytes(_recv_exact(sock, 4))
        (n,) = struct.unpack("<I", head)
        if n > self.max_message_bytes:
            raise ProtocolError(f"step message announces {n} bytes; the cap is {self.max_message_bytes}")
        body = _recv_exact(sock, n)
        tag = bytes(_recv_exact(sock, MAC_BYTES))
        if not hmac.compare_digest(tag, _mac(self.key, self.direction, struct.pack("<Q", self.seq), head, body)):
            raise ProtocolError(f"step message {self.seq} failed authentication (injected, replayed or reordered)")
        self.seq += 1
        return body


def _proofs(secret: bytes, leader_nonce: bytes, follower_nonce: bytes, process_id: int):
    ctx = leader_nonce + follower_nonce + struct.pack("<I", process_id)
    return (_mac(secret, b"follower", ctx), _mac(secret, b"leader", ctx), _mac(secret, b"session", ctx))


class LeaderChannel:
    """Leader side: listens on `host` (the interface the coordinator address names), authenticates each follower
    (each connection's handshake on its own thread, with a deadline, so a stray or hostile one never holds up the
    real followers), then broadcasts each step's inputs to them."""

    def __init__(self, port: int, num_followers: int, *, host: str, secret: bytes, timeout_s: float = 300.0,
                 on_follower_lost: Callable[[int, BaseException], None] | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S):
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"step channel secret of {len(secret)} bytes; at least {MIN_SECRET_BYTES}")
        self.on_follower_lost = on_follower_lost
        self._secret = secret
        self._lost = False
        self._closing = False
        self._num_followers = num_followers
        self._max_message_bytes = max_message_bytes
        self._handshake_timeout_s = handshake_timeout_s
        self.refused = 0  # connections that failed the handshake
        self.followers: dict[int, socket.socket] = {}
        self._framers: dict[int, _Framer] = {}
        try:
            server = socket.create_server((host, port), reuse_port=False)
        except OSError as e:
            raise OSError(f"cannot listen for the step channel on {host}:{port} (the coordinator address's host): "
                          f"{e}") from e
        joined: queue.Queue = queue.Queue()
        pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        claimed: set[int] = set()
        claim_lock = threading.Lock()
        deadline = time.monotonic() + timeout_s
        server.settimeout(0.2)
        try:
            while len(self.followers) < num_followers:
                while not joined.empty():
                    pid, conn, framer = joined.get()
                    self.followers[pid] = conn
                    self._framers[pid] = framer
                if len(self.followers) >= num_followers:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(self.followers)} of {num_followers} followers joined the step channel "
                                       f"in {timeout_s:.0f}s ({self.refused} connections refused)")
                try:
                    conn, addr = server.accept()
                except socket.timeout:
                    continue
                if not pending.acquire(blocking=False):
                    log.warning("step channel: %s closed: %d handshakes already pending", addr, MAX_PENDING_HANDSHAKES)
                    conn.close()
                    continue
                threading.Thread(target=self._handshake, args=(conn, addr, joined, pending, claimed, claim_lock),
                                 name="step-channel-handshake", daemon=True).start()
        finally:
            server.close()
        for pid, conn in self.followers.items():
            threading.Thread(target=self._watch, args=(pid, conn), name=f"follower-{pid}-watch",
                             daemon=True).start()

    def _handshake(self, conn, addr, joined, pending, claimed, claim_lock) -> None:
        deadline = time.monotonic() + self._handshake_timeout_s  # the whole handshake, not each read
        try:
            conn.settimeout(self._handshake_timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            leader_nonce = secrets.token_bytes(NONCE_BYTES)
            conn.sendall(MAGIC + leader_nonce)
            if bytes(_recv_exact(conn, len(MAGIC), deadline)) != MAGIC:
                raise AuthenticationError("not a step channel follower (wrong protocol bytes)")
            hello = bytes(_recv_exact(conn, 4 + NONCE_BYTES + MAC_BYTES, deadline))
            (pid,) = struct.unpack("<I", hello[:4])
            follower_nonce, proof = hello[4:4 + NONCE_BYTES], hello[4 + NONCE_BYTES:]
            want, answer, session = _proofs(self._secret, leader_nonce, follower_nonce, pid)
            if not hmac.compare_digest(proof, want):
                raise AuthenticationError(f"claims process {pid} without the shared secret")
            if not 1 <= pid <= self._num_followers:
                raise AuthenticationError(f"process id {pid} is not a follower (1..{self._num_followers})")
            with claim_lock:
                if pid in claimed:
                    raise AuthenticationError(f"process {pid} has already joined")
                claimed.add(pid)
            conn.sendall(answer)
            conn.settimeout(None)
            joined.put((pid, conn, _Framer(session, b"L", self._max_message_bytes)))
            log.info("step channel: follower process %d joined from %s", pid, addr)
        except (OSError, ValueError) as e:
            self.refused += 1
            log.warning("step channel: connection from %s refused and closed: %s", addr, e)
            conn.close()
        finally:
            pending.release()

    def _watch(self, pid: int, conn: socket.socket) -> None:
        """Followers never send after the handshake: any read that returns means the follower is gone."""
        try:
            data = conn.recv(1)
            err: BaseException = ConnectionError(f"follower process {pid} closed its step channel"
                                                 + ("" if not data else " (unexpected data)"))
        except OSError as e:
            err = ConnectionError(f"follower process {pid} is unreachable: {e}")
        self._follower_lost(pid, err)

    def _follower_lost(self, pid: int, err: BaseException) -> None:
        if self._lost or self._closing:
            return
        self._lost = True
        log.error("%s", err)
        if self.on_follower_lost is not None:
            self.on_follower_lost(pid, err)

    def broadcast(self, message: Any) -> None:
        body = encode(message)
        for pid, conn in self.followers.items():
            try:
                conn.sendall(self._framers[pid].frame(body))
            except OSError as e:
                self._follower_lost(pid, ConnectionError(f"follower process {pid} is unreachable: {e}"))
                raise ConnectionError(f"follower process {pid} is unreachable: {e}") from e

    def close(self) -> None:
        """Tells the followers to stop (a normal shutdown is not a lost follower)."""
        self._closing = True
        for pid, conn in self.followers.items():
            try:
                conn.sendall(self._framers[pid].frame(encode(("stop",))))
            except OSError:
                pass


class FollowerChannel:
    """Follower side: connects to the leader, proves it holds the secret and checks that the leader does too, then
    receives step messages (each checked against its MAC and sequence number)."""

    def __init__(self, leader_host: str, port: int, process_id: int, *, secret: bytes, timeout_s: float = 300.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.sock = socket.create_connection((leader_host, port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        where = f"{leader_host}:{port}"
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = bytes(_recv_exact(self.sock, len(MAGIC) + NONCE_BYTES, deadline))
            if hello[:len(MAGIC)] != MAGIC:
                raise AuthenticationError(f"{where} is not a step channel leader (wrong protocol bytes)")
            leader_nonce = hello[len(MAGIC):]
            follower_nonce = secrets.token_bytes(NONCE_BYTES)
            proof, want, session = _proofs(secret, leader_nonce, follower_nonce, process_id)
            self.sock.sendall(MAGIC + struct.pack("<I", process_id) + follower_nonce + proof)
            try:
                answer = bytes(_recv_exact(self.sock, MAC_BYTES, deadline))
            except ConnectionError:
                raise AuthenticationError(f"the leader at {where} refused this follower (process {process_id}): "
                                          "a different step channel secret, or the process id is taken") from None
            if not hmac.compare_digest(answer, want):
                raise AuthenticationError(f"{where} failed authentication: it does not hold the step channel secret")
        except BaseException:
            self.sock.close()
            raise
        self.sock.settimeout(None)
        self._framer = _Framer(session, b"L", max_message_bytes)

    def recv(self, records: Iterable[type] = ()) -> Any:
        """The next message; dataclasses only of the types in `records`."""
        return decode(self._framer.read(self.sock), records)
