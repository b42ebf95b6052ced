"""The one place device meshes are built (`make_mesh`, `serving_mesh`, `mesh_context`); `mesh_axis` and `axis_size`
tell code inside `shard_map` which mesh axis a logical axis maps to and how many ways it is split. Details:
docs/sharding.md."""
from __future__ import annotations

import contextlib

import jax
from jax.sharding import Mesh

from sharding.rules import DEFAULT_RULES, MESH_AXES, ShardingRules


def make_mesh(dp: int = 1, pp: int = 1, tp: int = 1, ep: int = 1, devices=None, *, auto: bool = False) -> Mesh:
    """A mesh over ('data', 'pipeline', 'tensor', 'expert') from the given degrees, on the first devices.
    `auto`: Auto axes (an engine's mesh: XLA propagates shardings from the parameters and inserts the collectives;
    kernels run per shard inside shard_map); else Explicit."""
    devices = list(devices if devices is not None else jax.devices())
    need = dp * pp * tp * ep
    if need > len(devices):
        raise ValueError(f"mesh dp={dp} pp={pp} tp={tp} ep={ep} needs {need} devices; {len(devices)} available")
    kind = jax.sharding.AxisType.Auto if auto else jax.sharding.AxisType.Explicit
    return jax.make_mesh((dp, pp, tp, ep), MESH_AXES, devices=devices[:need], axis_types=(kind,) * 4)


def serving_mesh(*, pp: int = 1, tp: int = 1, ep: int = 1, devices=None) -> Mesh:
    """One engine's mesh (data parallelism is replicas of engines, each with its own mesh)."""
    return make_mesh(1, pp, tp, ep, devices, auto=True)


def mesh_axis(logical: str, rules: ShardingRules = DEFAULT_RULES) -> str | None:
    """The mesh axis a logical axis (`sharding.axes`) is split over, or None."""
    return rules.rules.get(logical)


def axis_size(logical: str, rules: ShardingRules = DEFAULT_RULES) -> int:
    """Trace-time. How many ways the mesh in context splits `logical` (1 without a mesh or a mapping)."""
    axis = mesh_axis(logical, rules)
    mesh = jax.sharding.get_abstract_mesh()
    if axis is None or mesh.empty or axis not in mesh.axis_names:
        return 1
    return mesh.shape[axis]


def mesh_context(mesh: Mesh | None):
    """`jax.set_mesh(mesh)`, or nothing without a mesh."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
