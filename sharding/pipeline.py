"""Pipeline parallelism: decoder layers split into stages over the mesh's 'pipeline' axis (`stage_layers`, as even
as the count allows; `stack_stage_slots`, padding a short stage with no-op slots), micro-batches flowing stage to
stage with `ppermute` inside `jax.shard_map` (`pipelined`; GPipe-style, `bubble_fraction`). Details:
docs/sharding.md."""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sharding.rules import STAGE_AXIS


def bubble_fraction(num_stages: int, num_micro_batches: int) -> float:
    """Idle share of each stage over one pipelined step."""
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer ranges, one per stage, as even as possible: the first `num_layers % num_stages` stages take
    one layer more (61 on 2: 31 + 30; 80 on 3: 27 + 27 + 26), so the last stage, the one a stage-resident final
    norm and LM head would join, is never among the longer ones."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"pipeline parallelism {num_stages} needs 1 .. {num_layers} stages (one layer or more "
                         f"per stage), the model has {num_layers} layers")
    base, extra = divmod(num_layers, num_stages)
    starts = [s * base + min(s, extra) for s in range(num_stages + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(num_stages)]


def stage_slots(stages: Sequence[Sequence[int]]) -> int:
    """Slots every stage allocates: the longest stage's layer count (a shorter stage pads the rest)."""
    return max(len(layers) for layers in stages)


def active_slots(stages: Sequence[Sequence[int]]) -> np.ndarray:
    """bool [stages, slots]: True where slot j of stage s holds a real layer, False on a padding slot."""
    return np.arange(stage_slots(stages))[None, :] < np.array([len(layers) for layers in stages])[:, None]


def pipelined(stage_fn: Callable, stages: Sequence[Sequence[int]], num_micro: int):
    """Returns f(slot_params, slot_caches, x[M, Tm, E], micro_md) -> (y[M, Tm, E], slot_caches), to be called
    inside jit under a mesh with a 'pipeline' axis. `stage_fn(params, caches, x, md, valid, active)` runs one
    stage's slots on one micro-batch (params/caches: this device's slot lists, leading stage axis removed); `valid`
    is False on bubble ticks, where it must not write the KV cache, and `active` (bool [slots]) is False on a
    padding slot, which must pass the activation through unchanged and write no KV."""
    P = jax.sharding.PartitionSpec
    num_stages = len(stages)
    perm = [(s, s + 1) for s in range(num_stages - 1)]
    active_table = active_slots(stages)

    def body(slot_params, slot_caches, x_all, micro_md):
        stage = jax.lax.axis_index(STAGE_AXIS)
        params = jax.tree.map(lambda a: a[0], slot_params)
        caches = [jax.tree.map(lambda a: a[0], c) for c in slot_caches]  # an array, or a quantized cache's pair
        active = jnp.asarray(active_table)[stage]
        act = jnp.zeros_like(x_all[0])
        outs = jnp.zeros_like(x_all)
        for tick in range(num_micro + num_stages - 1):
            mb = tick - stage
            valid = (mb >= 0) & (mb < num_micro)
            mbc = jnp.clip(mb, 0, num_micro - 1)
            md = jax.tree.map(lambda a: a[mbc], micro_md)
            x = jnp.where(stage == 0, x_all[mbc], act)
            y, caches = stage_fn(params, caches, x, md, valid, active)
            outs = jnp.where((stage == num_stages - 1) & valid, outs.at[mbc].set(y), outs)
            act = jax.lax.ppermute(y, STAGE_AXIS, perm)
        outs = jax.lax.psum(outs, STAGE_AXIS)  # only the last stage holds them: share with every stage
        return outs, [jax.tree.map(lambda a: a[None], c) for c in caches]

    def run(slot_params, slot_caches, x_all, micro_md):
        stage_spec = jax.tree.map(lambda _: P(STAGE_AXIS), slot_params)
        cache_spec = [P(STAGE_AXIS)] * len(slot_caches)
        md_spec = jax.tree.map(lambda _: P(), micro_md)
        # Manual over the stages and every axis of size 1 (a Mosaic kernel inside must see no automatic axis);
        # the tensor axis, when it splits, stays automatic and the attention's own shard_map takes it.
        mesh = jax.sharding.get_abstract_mesh()
        manual = {STAGE_AXIS} | {name for name, size in mesh.shape.items() if size == 1}
        return jax.shard_map(body, in_specs=(stage_spec, cache_spec, P(), md_spec), out_specs=(P(), cache_spec),
                             axis_names=manual, check_vma=False)(slot_params, slot_caches, x_all, micro_md)

    return run


def stack_stage_slots(layer_states: Sequence, stages: Sequence[Sequence[int]], mesh) -> list:
    """Per slot j, the states of layers {stages[s][j]} stacked on a leading axis sharded over 'pipeline' (each
    array keeps its other dimensions' sharding). A stage shorter than the longest gets zeros in its missing slots
    (a padding slot: its shard costs one layer's weights on that stage's devices, as the stacked array is even)."""
    slots = []
    for j in range(stage_slots(stages)):
        like = next(layer_states[layers[j]] for layers in stages if j < len(layers))
        padding = [j >= len(layers) for layers in stages]
        members = [like if pad else layer_states[layers[j]] for layers, pad in zip(stages, padding)]

        def stack(*arrays):
            spec = getattr(arrays[0].sharding, "spec", jax.sharding.PartitionSpec())
            sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(STAGE_AXIS, *spec))
            host = np.stack([np.zeros(a.shape, a.dtype) if pad else np.asarray(a) for a, pad in zip(arrays, padding)])
            return jax.device_put(host, sharding)

        slots.append(jax.tree.map(stack, *members))
    return slots
