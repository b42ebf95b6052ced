"""Expert placement for expert parallelism (`ExpertPlacement`, `identity_placement`, `balanced_placement`): a logical ->
physical expert map with spare slots for replicas of hot experts, rebuilt from observed load.
Details: docs/sharding.md."""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ExpertPlacement:
    slot_to_expert: np.ndarray  # [num_slots] int32: the logical expert each physical slot holds
    num_devices: int

    @property
    def num_slots(self) -> int:
        return len(self.slot_to_expert)

    @property
    def num_experts(self) -> int:
        return int(self.slot_to_expert.max()) + 1

    def replica_table(self, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(replica_slots [num_experts, width] int32, replica_count [num_experts] int32); width defaults to
        num_slots - num_experts + 1, the most replicas one expert can have."""
        n = self.num_experts
        slots = [np.flatnonzero(self.slot_to_expert == e) for e in range(n)]
        width = width or self.num_slots - n + 1
        table = np.zeros((n, width), np.int32)
        for e, s in enumerate(slots):
            table[e, :len(s)] = s
            table[e, len(s):] = s[0]
        return table, np.array([len(s) for s in slots], np.int32)

    def device_load(self, slot_counts: np.ndarray) -> np.ndarray:
        """Tokens per device from per-slot token counts."""
        return np.asarray(slot_counts).reshape(self.num_devices, -1).sum(axis=1)


def identity_placement(num_experts: int, num_slots: int, num_devices: int) -> ExpertPlacement:
    """Expert i in slot i; spare slots hold replicas of experts 0, 1, ... until load is observed."""
    _check(num_experts, num_slots, num_devices)
    return ExpertPlacement(np.arange(num_slots, dtype=np.int32) % num_experts, num_devices)


def balanced_placement(expert_load: np.ndarray, num_slots: int, num_devices: int) -> ExpertPlacement:
    """Placement for observed per-expert token counts: replicate the hottest experts into the spare slots,
    then assign replicas to devices heaviest first, each to the least-loaded device with a free slot."""
    load = np.asarray(expert_load, np.float64)
    n = len(load)
    _check(n, num_slots, num_devices)
    replicas = np.ones(n, np.int64)
    for _ in range(num_slots - n):
        replicas[int(np.argmax(load / replicas))] += 1
    items = sorted(((load[e] / replicas[e], e) for e in range(n) for _ in range(replicas[e])), reverse=True)
    per_device = num_slots // num_devices
    dev_load = np.zeros(num_devices)
    dev_slots: list[list[int]] = [[] for _ in range(num_devices)]
    for share, e in items:
        open_devices = [d for d in range(num_devices) if len(dev_slots[d]) < per_device]
        # Prefer a device without a replica of e (a replica on the same device balances nothing).
        fresh = [d for d in open_devices if e not in dev_slots[d]] or open_devices
        d = min(fresh, key=lambda d: (dev_load[d], d))
        dev_slots[d].append(e)
        dev_load[d] += share
    return ExpertPlacement(np.array([e for d in dev_slots for e in d], np.int32), num_devices)


def _check(num_experts: int, num_slots: int, num_devices: int) -> None:
    if num_slots < num_experts:
        raise ValueError(f"{num_slots} expert slots cannot hold {num_experts} experts")
    if num_slots % num_devices:
        raise ValueError(f"expert parallelism {num_devices} does not divide {num_slots} expert slots")
