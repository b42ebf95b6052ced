"""Multi-host start-up (`DistributedConfig`, `initialize`, `shutdown`, `to_global`, `local_value`) and the leader ->
follower step channel (`LeaderChannel`, `FollowerChannel`: each jitted call's host inputs sent over TCP, a dead
follower seen at once by the leader's watchdog). Details: docs/sharding.md."""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import socket
import struct
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str  # host:port of the JAX coordination service (process 0)
    num_processes: int
    process_id: int
    step_channel_port: int  # leader's port for the step channel (on the coordinator's host)
    local_device_count: int | None = None

    def __post_init__(self):
        if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, {self.num_processes}), got {self.process_id}")

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @property
    def leader_host(self) -> str:
        return self.coordinator_address.rsplit(":", 1)[0]

    @classmethod
    def from_env(cls) -> "DistributedConfig | None":
        """MESHSERVE_COORDINATOR, MESHSERVE_NUM_PROCESSES, MESHSERVE_PROCESS_ID, MESHSERVE_STEP_PORT."""
        addr = os.environ.get("MESHSERVE_COORDINATOR")
        if not addr:
            return None
        return cls(addr, int(os.environ["MESHSERVE_NUM_PROCESSES"]), int(os.environ["MESHSERVE_PROCESS_ID"]),
                   int(os.environ.get("MESHSERVE_STEP_PORT", "0")) or int(addr.rsplit(":", 1)[1]) + 1)


def initialize(cfg: DistributedConfig, heartbeat_timeout_s: int = 10) -> None:
    """Joins the JAX distributed runtime (before any other JAX call in this process)."""
    # CPU collectives across processes need gloo; the setting does not touch accelerator collectives (and
    # querying the backend here would initialise it too early).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {}
    try:
        import inspect
        if "heartbeat_timeout_seconds" in inspect.signature(jax.distributed.initialize).parameters:
            kwargs["heartbeat_timeout_seconds"] = heartbeat_timeout_s
    except (TypeError, ValueError):
        pass
    jax.distributed.initialize(cfg.coordinator_address, num_processes=cfg.num_processes,
                               process_id=cfg.process_id, **kwargs)
    log.info("process %d/%d joined %s: %d local / %d global devices", cfg.process_id, cfg.num_processes,
             cfg.coordinator_address, jax.local_device_count(), jax.device_count())


def shutdown() -> None:
    """Leaves the distributed runtime together with the other processes (a barrier)."""
    jax.distributed.shutdown()


def to_global(tree, mesh):
    """Host numpy leaves -> global arrays replicated over `mesh` (each process holds the same values)."""
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def convert(x):
        if isinstance(x, np.ndarray) or np.isscalar(x):
            return jax.make_array_from_process_local_data(sharding, np.asarray(x))
        return x
    return jax.tree.map(convert, tree)


def local_value(x: jax.Array) -> np.ndarray:
    """A replicated global array's value, read from this process's first shard."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))


def _send(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(struct.pack("<Q", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the step channel closed")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> Any:
    (n,) = struct.unpack("<Q", _recv_exact(sock, 8))
    return pickle.loads(_recv_exact(sock, n))


class LeaderChannel:
    """Leader side: accepts every follower, then broadcasts each step's inputs to them."""

    def __init__(self, port: int, num_followers: int, *, host: str = "0.0.0.0", timeout_s: float = 300.0,
                 on_follower_lost: Callable[[int, BaseException], None] | None = None):
        self.on_follower_lost = on_follower_lost
        self._lost = False
        self._closing = False
        server = socket.create_server((host, port), reuse_port=False)
        server.settimeout(timeout_s)
        self.followers: dict[int, socket.socket] = {}
        while len(self.followers) < num_followers:
            conn, _ = server.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            process_id = _recv(conn)
            self.followers[process_id] = conn
        server.close()
        for pid, conn in self.followers.items():
            threading.Thread(target=self._watch, args=(pid, conn), name=f"follower-{pid}-watch",
                             daemon=True).start()

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
        for pid, conn in self.followers.items():
            try:
                _send(conn, message)
            except OSError as e:
                self._follower_lost(pid, ConnectionError(f"follower process {pid} is unreachable: {e}"))
                raise ConnectionError(f"follower process {pid} is unreachable: {e}") from e

    def close(self) -> None:
        """Tells the followers to stop (a normal shutdown is not a lost follower)."""
        self._closing = True
        for conn in self.followers.values():
            try:
                _send(conn, ("stop",))
            except OSError:
                pass


class FollowerChannel:
    """Follower side: connects to the leader and receives step messages."""

    def __init__(self, leader_host: str, port: int, process_id: int, timeout_s: float = 300.0):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.sock = socket.create_connection((leader_host, port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _send(self.sock, process_id)

    def recv(self) -> Any:
        return _recv(self.sock)
