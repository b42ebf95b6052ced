"""Logical-axis -> mesh-axis rules, as data (`ShardingRules`, `DEFAULT_RULES`, `MESH_AXES`), and the PartitionSpecs and
shard shapes they give parameters and the KV cache (`partition_spec_for_sizes`, `shard_shape`; the cache's axes are
declared by `models.kv_cache`). Details: docs/sharding.md."""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.axes import (EMBED, EXPERT, HEAD_DIM, HEADS, KV_HEADS, KV_PAGES, LAYERS, LOGICAL_AXES, LORA_RANK,
                           LORA_SLOTS, MLP, VOCAB)

MESH_AXES = ("data", "pipeline", "tensor", "expert")
STAGE_AXIS = MESH_AXES[1]  # pipeline stages: stacked layer slots (and their KV caches) are split over it


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    rules: Mapping[str, str | None]

    def __post_init__(self):
        for logical, mesh_axis in self.rules.items():
            if logical not in LOGICAL_AXES:
                raise ValueError(f"unknown logical axis {logical!r}; known: {LOGICAL_AXES}")
            if mesh_axis is not None and mesh_axis not in MESH_AXES:
                raise ValueError(f"logical axis {logical!r} maps to unknown mesh axis {mesh_axis!r}; "
                                 f"mesh axes are {MESH_AXES}")

    def partition_spec(self, axes: Sequence[str | None], shape: Sequence[int] | None = None,
                       mesh: Mesh | None = None) -> PartitionSpec:
        used: dict[str, str] = {}
        spec = []
        for i, logical in enumerate(axes):
            mesh_axis = self.rules.get(logical) if logical is not None else None
            if mesh_axis is not None and mesh is not None:
                size = mesh.shape[mesh_axis]
                if size == 1 or (shape is not None and shape[i] % size):
                    mesh_axis = None  # replicate what the axis cannot divide
            if mesh_axis is not None:
                if mesh_axis in used:
                    raise ValueError(f"logical axes {used[mesh_axis]!r} and {logical!r} of one array both map "
                                     f"to mesh axis {mesh_axis!r}")
                used[mesh_axis] = logical
            spec.append(mesh_axis)
        return PartitionSpec(*spec)

    def named_sharding(self, mesh: Mesh, axes: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
        return NamedSharding(mesh, self.partition_spec(axes, shape, mesh))


# LoRA stacks (A [slots, rank, in..], B [slots, rank, out..]) split as the weight they modify, by its in/out axes;
# their slot and rank axes are never split (a rank is 8-64: too small to divide).
DEFAULT_RULES = ShardingRules({
    EMBED: None, HEAD_DIM: None, LAYERS: None, LORA_SLOTS: None, LORA_RANK: None,
    HEADS: "tensor", KV_HEADS: "tensor", MLP: "tensor", VOCAB: "tensor", EXPERT: "expert", KV_PAGES: "data",
})


class _AxisSizes:
    """Stands in for a Mesh where only the axis sizes matter (planning without devices)."""

    def __init__(self, axis_sizes: Mapping[str, int]):
        self.shape = {axis: int(axis_sizes.get(axis, 1)) for axis in MESH_AXES}


def partition_spec_for_sizes(rules: ShardingRules, axes: Sequence[str | None], shape: Sequence[int],
                             axis_sizes: Mapping[str, int]) -> PartitionSpec:
    """`rules.partition_spec` for a mesh known only by its axis sizes, e.g. {'tensor': 8}; missing axes are 1."""
    return rules.partition_spec(axes, shape, _AxisSizes(axis_sizes))  # type: ignore[arg-type]


def shard_shape(spec: PartitionSpec, shape: Sequence[int], axis_sizes: Mapping[str, int]) -> tuple[int, ...]:
    """Per-device shape of an array of `shape` laid out by `spec` over mesh axes of `axis_sizes`."""
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    out = []
    for dim, entry in zip(shape, entries):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        parts = 1
        for name in names:
            parts *= int(axis_sizes.get(name, 1))
        out.append(-(-int(dim) // parts))  # an uneven split pads the last shard up to the others
    return tuple(out)

