"""Multi-host start-up (`DistributedConfig`, `initialize`, `shutdown`, `to_global`, `local_value`); the leader ->
follower step channel (`LeaderChannel`, `FollowerChannel`: each jitted call's host inputs sent over authenticated
TCP, a dead follower seen at once by the leader's watchdog) lives in sharding/step_channel.py. Details:
docs/sharding.md, docs/security.md."""
from __future__ import annotations

import dataclasses
import logging
import os

import jax
import numpy as np

from sharding.step_channel import FollowerChannel, LeaderChannel, load_secret

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str  # host:port of the JAX coordination service (process 0)
    num_processes: int
    process_id: int
    step_channel_port: int  # leader's port for the step channel (on the coordinator's host)
    local_device_count: int | None = None
    # The step channel's shared secret (sharding.step_channel.load_secret); never printed.
    secret: bytes = dataclasses.field(default=b"", repr=False)

    def __post_init__(self):
        if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, {self.num_processes}), got {self.process_id}")

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @property
    def leader_host(self) -> str:
        """The coordinator address's host (an IPv6 literal without its brackets)."""
        return self.coordinator_address.rsplit(":", 1)[0].strip("[]")

    @classmethod
    def from_env(cls) -> "DistributedConfig | None":
        """MESHSERVE_COORDINATOR, MESHSERVE_NUM_PROCESSES, MESHSERVE_PROCESS_ID, MESHSERVE_STEP_PORT, and the secret
        from MESHSERVE_STEP_SECRET_FILE or MESHSERVE_STEP_SECRET."""
        addr = os.environ.get("MESHSERVE_COORDINATOR")
        if not addr:
            return None
        return cls(addr, int(os.environ["MESHSERVE_NUM_PROCESSES"]), int(os.environ["MESHSERVE_PROCESS_ID"]),
                   int(os.environ.get("MESHSERVE_STEP_PORT", "0")) or int(addr.rsplit(":", 1)[1]) + 1,
                   secret=load_secret())

    def leader_channel(self, **kw) -> LeaderChannel:
        """The leader's step channel, listening on the coordinator address's host; waits for every follower."""
        return LeaderChannel(self.step_channel_port, self.num_processes - 1, host=self.leader_host,
                             secret=self.secret, **kw)

    def follower_channel(self, **kw) -> FollowerChannel:
        return FollowerChannel(self.leader_host, self.step_channel_port, self.process_id, secret=self.secret, **kw)


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
