"""`KVEventPublisher`: the prefix cache's block-stored / block-removed events, per tier, as vLLM's KV-event stream
(msgpack `KVEventBatch` on a ZMQ PUB socket, a ROUTER socket replaying recent batches), so an external router can
route by what the instance holds. Details and who may connect: docs/engine.md ("KV events"), docs/security.md."""
from __future__ import annotations

import collections
import ipaddress
import logging
import threading
import time

import msgpack
import zmq

from serving.core.block_manager import DEVICE_MEDIUM, HOST_MEDIUM  # noqa: F401 - the tiers' names, re-exported

log = logging.getLogger(__name__)
REPLAY_END = -1  # the replay's last message: this sequence number and an empty payload


def check_endpoint(endpoint: str, allow_remote: bool) -> str:
    """`endpoint` (a ZMQ bind address); raises ValueError unless it is ipc:// or tcp:// on a loopback address, or
    `allow_remote` (the stream carries the token ids of cached prompts)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc") and rest:
        return endpoint
    host, _, port = rest.rpartition(":")
    host = host.strip("[]")
    if scheme != "tcp" or not host or not (port.isdigit() or port == "*"):
        raise ValueError(f"KV-events endpoint {endpoint!r}: expected tcp://HOST:PORT (PORT may be *) or ipc://PATH")
    if not allow_remote:
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(f"KV-events endpoint {endpoint!r} is not loopback: the events carry prompt token ids; "
                             f"bind 127.0.0.1 (or ipc://), or set --kv_events_allow_remote on a trusted network")
    return endpoint


def encode_event(event: tuple) -> list:
    """A block manager event as vLLM's tagged array (its BlockStored fields in their order): ["BlockStored",
    [hash], parent hash | None, token ids, block size, lora id | None, medium, lora name | None, [extra keys] |
    None], ["BlockRemoved", [hash], medium] or ["AllBlocksCleared"]. The extra keys are the block's as vLLM hashes
    them: the adapter's name on each of an adapter's blocks, the cache salt on a first block."""
    kind = event[0]
    if kind == "stored":
        _, block_hash, parent, tokens, medium, lora_id, lora_name, extra = event
        return ["BlockStored", [block_hash], parent, list(tokens), len(tokens), lora_id, medium, lora_name,
                None if extra is None else [list(extra)]]
    if kind == "removed":
        return ["BlockRemoved", [event[1]], event[2]]
    return ["AllBlocksCleared"]


class KVEventPublisher:
    """Publishes each step's events as one batch [ts, events, data_parallel_rank], multipart (topic, sequence
    number: 8 bytes big-endian, payload); keeps the last `replay_batches` for the replay socket, which answers a
    request of one sequence number (8 bytes) with every kept batch from there, then (REPLAY_END, b"")."""

    def __init__(self, endpoint: str, replay_endpoint: str = "", *, topic: str = "", allow_remote: bool = False,
                 replay_batches: int = 10000, data_parallel_rank: int = 0):
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(check_endpoint(endpoint, allow_remote))
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic.encode()
        self.rank = data_parallel_rank
        self._seq = 0
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=replay_batches)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._replay_thread = None
        self.replay_endpoint = ""
        if replay_endpoint:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(check_endpoint(replay_endpoint, allow_remote))
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay_thread = threading.Thread(target=self._serve_replay, args=(router,), daemon=True,
                                                   name="kv-events-replay")
            self._replay_thread.start()

    def publish(self, events: list[tuple]) -> None:
        """One batch of the block manager's events (nothing sent when empty). Never blocks: a slow subscriber
        loses messages at the socket's high-water mark (then replays them)."""
        if not events:
            return
        payload = msgpack.packb([time.time(), [encode_event(e) for e in events], self.rank])
        seq = self._seq.to_bytes(8, "big", signed=True)
        with self._lock:
            self._buffer.append((self._seq, payload))
        self._seq += 1
        try:
            self._pub.send_multipart((self.topic, seq, payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("KV events: batch %d dropped at the publisher (no room)", self._seq - 1)

    def _serve_replay(self, router) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = router.recv_multipart()
            identity, request = frames[0], frames[-1]
            if len(request) != 8:  # not a sequence number: answered with the end marker only
                router.send_multipart((identity, b"", REPLAY_END.to_bytes(8, "big", signed=True), b""))
                continue
            start = int.from_bytes(request, "big", signed=True)
            with self._lock:
                kept = [(s, p) for s, p in self._buffer if s >= start]
            for s, p in kept:
                router.send_multipart((identity, b"", s.to_bytes(8, "big", signed=True), p))
            router.send_multipart((identity, b"", REPLAY_END.to_bytes(8, "big", signed=True), b""))
        router.close()

    def close(self) -> None:
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2)
        self._pub.close()
        self._ctx.term()
