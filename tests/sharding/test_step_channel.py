"""The multi-host step channel on 127.0.0.1 sockets, in one process: its schema carries a step's real inputs and
nothing else (no pickle), the handshake admits only holders of the secret (a recorded handshake replayed, a wrong
secret, a fake leader, a silent or trickling connection: each refused without holding up the real follower), and
every message is bound to its place in the stream. The two-process attack test: tests/sharding/test_multihost.py."""
from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
import time

import ml_dtypes
import numpy as np
import pytest

from models.batch import RaggedBatch
from pallas_kernels.metadata import AttentionMetadata
from serving.core.model_runner import STEP_RECORDS
from serving.core.sampling import SamplingTensors
from sharding import step_channel as sc

SECRET = b"0123456789abcdef-test-secret"


def _batch() -> RaggedBatch:
    i32 = lambda *v: np.array(v, np.int32)  # noqa: E731
    return RaggedBatch(input_ids=i32(5, 6, 7, 0), positions=i32(0, 1, 2, 0), logits_indices=i32(2, 0),
                       attention=AttentionMetadata(slot_mapping=i32(8, 9, 10, -1), kv_lens=i32(3, 0),
                                                   page_indices=np.arange(8, dtype=np.int32).reshape(2, 4),
                                                   cu_q_lens=i32(0, 3, 3), num_seqs=i32(1)))


def _sampling() -> SamplingTensors:
    s = 2
    return SamplingTensors(temperature=np.ones(s, np.float32), top_k=np.zeros(s, np.int32),
                           top_p=np.ones(s, np.float32), min_p=np.zeros(s, np.float32),
                           repetition_penalty=np.ones(s, np.float32), presence_penalty=np.zeros(s, np.float32),
                           frequency_penalty=np.zeros(s, np.float32), seed=np.array([[1, 2], [3, 4]], np.uint32),
                           step=np.zeros(s, np.int32), valid=np.array([True, False]), token_ids=None,
                           num_prompt_tokens=None, token_bitmask=np.full((s, 3), -1, np.int32), all_greedy=False,
                           num_candidates=64, use_min_p=True)


def _same(a, b) -> None:
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and (a == b).all()
    elif hasattr(a, "__dataclass_fields__"):
        assert type(a) is type(b)
        for name in a.__dataclass_fields__:
            _same(getattr(a, name), getattr(b, name))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert type(a) is type(b) and a == b


def test_schema_round_trips_a_steps_inputs_and_refuses_everything_else():
    pipelined = {"input_ids": np.arange(4, dtype=np.int32), "micro": {"kv_lens": np.zeros((2, 3), np.int32)}}
    for message in (("forward", _batch(), True), ("sample", _sampling(), 4), ("forward", pipelined, False),
                    ("stop",), (np.array([1.5, -2], ml_dtypes.bfloat16), 2.5, None, np.int64(7))):
        got = sc.decode(sc.encode(message), STEP_RECORDS)
        _same(tuple(message[:3]) + tuple(int(x) if isinstance(x, np.integer) else x for x in message[3:]), got)
    with pytest.raises(TypeError, match="does not travel"):
        sc.encode(("forward", object()))
    good = sc.encode(("forward", _batch(), True))
    bad = {
        "a pickle": pickle.dumps(("forward", 1)),
        "an unlisted record type": sc.encode(("forward", _batch(), True)).replace(b"RaggedBatch", b"RaggedBatcX"),
        "a record missing a field": sc.encode((_batch().attention,)).replace(b"num_seqs", b"num_seqX"),
        "bytes after the value": good + b"\0",
        "a truncated message": good[:-3],
        "an array larger than the message": bytes([sc._ARRAY, 3, 1]) + struct.pack("<Q", 1 << 40),
        "an unknown dtype code": bytes([sc._ARRAY, 200, 0]),
        "a tuple of 2**32-1 entries": bytes([sc._TUPLE]) + struct.pack("<I", 2 ** 32 - 1),
        "nesting past the depth limit": bytes([sc._TUPLE, 1, 0, 0, 0]) * 20 + bytes([sc._NONE]),
    }
    for what, data in bad.items():
        with pytest.raises(sc.ProtocolError):
            sc.decode(data, STEP_RECORDS)
        assert what
    # A dataclass decodes only into the types the receiver lists.
    with pytest.raises(sc.ProtocolError, match="RaggedBatch"):
        sc.decode(good, (AttentionMetadata,))


def test_messages_are_bound_to_the_session_and_their_place_in_the_stream():
    a, b = socket.socketpair()
    with a, b:
        sender, receiver = sc._Framer(b"k" * 32, b"L", 1 << 20), sc._Framer(b"k" * 32, b"L", 1 << 20)
        f0, f1 = sender.frame(b"step zero"), sender.frame(b"step one")
        a.sendall(f0)
        assert receiver.read(b) == b"step zero"
        a.sendall(f0)  # replayed
        with pytest.raises(sc.ProtocolError, match="failed authentication"):
            receiver.read(b)
    for stream in ([f1], [f0[:6] + b"X" + f0[7:]], [sc._Framer(b"j" * 32, b"L", 1 << 20).frame(b"step zero")]):
        a, b = socket.socketpair()  # reordered, tampered with, another session's key
        with a, b:
            a.sendall(b"".join(stream))
            with pytest.raises(sc.ProtocolError, match="failed authentication"):
                sc._Framer(b"k" * 32, b"L", 1 << 20).read(b)
    a, b = socket.socketpair()
    with a, b:  # a length prefix over the cap is refused before anything is read or allocated
        a.sendall(struct.pack("<I", 2 ** 31))
        with pytest.raises(sc.ProtocolError, match="cap is 1048576"):
            sc._Framer(b"k" * 32, b"L", 1 << 20).read(b)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _leader(port, **kw):
    out = {}

    def run():
        try:
            out["channel"] = sc.LeaderChannel(port, 1, host="127.0.0.1", secret=SECRET, timeout_s=30, **kw)
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    for _ in range(200):  # until it listens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()  # refused at once: not a follower
            break
        except OSError:
            time.sleep(0.02)
    return t, out


class _Relay:
    """A TCP relay between a follower and the leader that records what the follower sent."""

    def __init__(self, target_port: int):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.from_follower = bytearray()
        self.target_port = target_port
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        client, _ = self.server.accept()
        upstream = socket.create_connection(("127.0.0.1", self.target_port))

        def pump(src, dst, record):
            while data := src.recv(65536):
                if record is not None:
                    record += data
                dst.sendall(data)
        threading.Thread(target=pump, args=(client, upstream, self.from_follower), daemon=True).start()
        pump(upstream, client, None)


def test_handshake_admits_only_the_secret_holders_and_is_not_held_up():
    port = _free_port()
    t, out = _leader(port, handshake_timeout_s=5.0)
    # A silent connection and one that trickles the right protocol bytes, one a second, hold no one up.
    silent = socket.create_connection(("127.0.0.1", port))
    trickle = socket.create_connection(("127.0.0.1", port))
    stop = threading.Event()

    def drip():
        for byte in sc.MAGIC:
            if stop.wait(1.0):
                return
            try:
                trickle.sendall(bytes([byte]))
            except OSError:
                return
    threading.Thread(target=drip, daemon=True).start()
    # The leader binds the interface it was given, not every interface.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=2)
    with pytest.raises(sc.AuthenticationError, match="refused this follower"):
        sc.FollowerChannel("127.0.0.1", port, 1, secret=b"not-the-secret-0123456789")
    relay = _Relay(port)
    t0 = time.monotonic()
    follower = sc.FollowerChannel("127.0.0.1", relay.port, 1, secret=SECRET)
    t.join(10)
    assert time.monotonic() - t0 < 4.0, "the real follower waited behind the silent connections"
    leader = out["channel"]
    assert list(leader.followers) == [1] and leader.refused >= 2  # the probe in _leader and the wrong secret
    leader.broadcast(("forward", _batch(), False))
    _same(("forward", _batch(), False), follower.recv(STEP_RECORDS))
    leader.close()
    assert follower.recv() == ("stop",)
    stop.set()
    for s in (silent, trickle):  # closed by their handshake deadline
        s.settimeout(5)
        assert s.recv(100)[:len(sc.MAGIC)] == sc.MAGIC
        assert s.recv(100) == b""
        s.close()
    follower.sock.close()

    # The follower's half of that handshake, replayed to a new leader: its nonce differs, so the proof is wrong.
    recorded = bytes(relay.from_follower)
    assert len(recorded) == len(sc.MAGIC) + 4 + sc.NONCE_BYTES + sc.MAC_BYTES
    port2 = _free_port()
    t2, out2 = _leader(port2)
    with socket.create_connection(("127.0.0.1", port2), timeout=5) as replay:
        replay.recv(len(sc.MAGIC) + sc.NONCE_BYTES)
        replay.sendall(recorded)
        assert replay.recv(100) == b""  # closed, no proof sent back
    real = sc.FollowerChannel("127.0.0.1", port2, 1, secret=SECRET)
    t2.join(10)
    assert list(out2["channel"].followers) == [1]
    out2["channel"].close()
    real.sock.close()


def test_a_follower_checks_the_leader_too():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def fake_leader():  # speaks the protocol but does not hold the secret
        conn, _ = server.accept()
        with conn:
            conn.sendall(sc.MAGIC + os.urandom(sc.NONCE_BYTES))
            sc._recv_exact(conn, len(sc.MAGIC) + 4 + sc.NONCE_BYTES + sc.MAC_BYTES)
            conn.sendall(os.urandom(sc.MAC_BYTES))
            time.sleep(1)
    threading.Thread(target=fake_leader, daemon=True).start()
    with server, pytest.raises(sc.AuthenticationError, match="does not hold the step channel secret"):
        sc.FollowerChannel("127.0.0.1", port, 1, secret=SECRET)


def test_secret_sources(tmp_path, monkeypatch):
    monkeypatch.delenv(sc.SECRET_ENV, raising=False)
    monkeypatch.delenv(sc.SECRET_FILE_ENV, raising=False)
    with pytest.raises(ValueError, match="--step_channel_secret_file"):
        sc.load_secret()
    path = tmp_path / "secret"
    path.write_bytes(b"short\n")
    with pytest.raises(ValueError, match="5 bytes; at least 16"):
        sc.load_secret(str(path))
    path.write_bytes(SECRET + b"\n")
    assert sc.load_secret(str(path)) == SECRET
    monkeypatch.setenv(sc.SECRET_ENV, SECRET.decode())
    assert sc.load_secret() == SECRET
