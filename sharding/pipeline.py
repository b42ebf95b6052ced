"""Pipeline parallelism: decoder layers split into stages over the mesh's 'pipeline' axis (`stage_layers`, as even
as the count allows), each stage's layers laid on slots that every stage runs in order (`plan_slots`: layers of
different kinds, e.g. DeepSeek's dense and MoE layers, on slots of their kind, a stage without a layer for a slot
padding it with a no-op; `stack_stage_slots`), micro-batches flowing stage to stage with `ppermute` inside
`jax.shard_map` (`pipelined`; GPipe-style, `bubble_fraction`). Details: docs/sharding.md."""
from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Sequence

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


@dataclasses.dataclass(frozen=True)
class SlotPlan:
    """The layer slots every stage runs, in order: `slot_layers[s][j]` is the layer stage s runs in slot j, or None
    (a padding slot: a no-op of the slot's kind). A slot's layers are all of one kind, so their parameters and KV
    caches stack into one array over the stages."""
    slot_layers: tuple[tuple[int | None, ...], ...]

    @property
    def num_stages(self) -> int:
        return len(self.slot_layers)

    @property
    def num_slots(self) -> int:
        return len(self.slot_layers[0])

    @property
    def active(self) -> np.ndarray:
        """bool [stages, slots]: True where the slot holds a real layer."""
        return np.array([[layer is not None for layer in row] for row in self.slot_layers])

    def slot_layer(self, j: int) -> int:
        """A real layer of slot j (every slot has one on some stage): its kind is the slot's."""
        return next(row[j] for row in self.slot_layers if row[j] is not None)

    def padding(self, stage: int) -> int:
        return sum(layer is None for layer in self.slot_layers[stage])


def _merge(a: list, b: list) -> list:
    """A shortest common supersequence of kind sequences a and b (dynamic programming)."""
    n, m = len(a), len(b)
    cost = np.zeros((n + 1, m + 1), np.int64)
    cost[:, 0], cost[0, :] = np.arange(n + 1), np.arange(m + 1)
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            cost[i, j] = cost[i - 1, j - 1] + 1 if a[i - 1] == b[j - 1] else min(cost[i - 1, j], cost[i, j - 1]) + 1
    out, i, j = [], n, m
    while i or j:
        if i and j and a[i - 1] == b[j - 1]:
            out.append(a[i - 1])
            i, j = i - 1, j - 1
        elif i and (not j or cost[i - 1, j] < cost[i, j - 1]):  # ties: the earlier stages' kinds first
            out.append(a[i - 1])
            i -= 1
        else:
            out.append(b[j - 1])
            j -= 1
    return out[::-1]


def plan_slots(stages: Sequence[Sequence[int]], kinds: Sequence[Hashable] | None = None) -> SlotPlan:
    """Slots for `stages` (`stage_layers`) whose layer i is of kind `kinds[i]` (None: all alike): the slots' kinds
    are a common supersequence of the stages' kind sequences (merged stage by stage, each merge a shortest one), and
    each stage's layers take, in order, the first slots of their kind. Layers all of one kind give the longest
    stage's count of slots, a shorter stage padding its last ones; DeepSeek-V3's 61 layers (3 dense, then MoE) on 2
    stages give 3 dense + 30 MoE slots, the second stage padding the dense ones and the first two MoE ones."""
    kinds = list(kinds) if kinds is not None else [0] * sum(len(s) for s in stages)
    order: list = []
    for layers in stages:
        order = _merge(order, [kinds[i] for i in layers])
    rows = []
    for layers in stages:
        row, k = [], 0
        for kind in order:
            take = k < len(layers) and kinds[layers[k]] == kind
            row.append(layers[k] if take else None)
            k += take
        rows.append(tuple(row))
    return SlotPlan(tuple(rows))


def pipelined(stage_fn: Callable, plan: SlotPlan, num_micro: int, extra_out: int = 0):
    """Returns f(slot_params, slot_caches, x[M, Tm, E], micro_md) -> (y[M, Tm, E], slot_caches, extras), to be
    called inside jit under a mesh with a 'pipeline' axis. `stage_fn(params, caches, x, md, valid, active)` runs one
    stage's slots on one micro-batch (params/caches: this device's slot lists, leading stage axis removed) and
    returns (y, caches, extras); `valid` is False on bubble ticks, where it must not write the KV cache, and `active`
    (bool [slots]) is False on a padding slot, which must pass the activation through unchanged and write no KV.
    `extra_out` > 0: stage_fn's extras are an array of that many rows per slot, [slots, extra_out, ...] (e.g. expert
    token counts), summed over the stage's valid ticks and returned per stage, [stages, slots, extra_out, ...]."""
    P = jax.sharding.PartitionSpec
    num_stages = plan.num_stages
    perm = [(s, s + 1) for s in range(num_stages - 1)]
    active_table = plan.active

    def body(slot_params, slot_caches, x_all, micro_md):
        stage = jax.lax.axis_index(STAGE_AXIS)
        params = jax.tree.map(lambda a: a[0], slot_params)
        caches = [jax.tree.map(lambda a: a[0], c) for c in slot_caches]  # an array, or a quantized cache's pair
        active = jnp.asarray(active_table)[stage]
        act = jnp.zeros_like(x_all[0])
        outs = jnp.zeros_like(x_all)
        extras = None
        for tick in range(num_micro + num_stages - 1):
            mb = tick - stage
            valid = (mb >= 0) & (mb < num_micro)
            mbc = jnp.clip(mb, 0, num_micro - 1)
            md = jax.tree.map(lambda a: a[mbc], micro_md)
            x = jnp.where(stage == 0, x_all[mbc], act)
            y, caches, extra = stage_fn(params, caches, x, md, valid, active)
            if extra_out:
                extra = jnp.where(valid, extra, jnp.zeros_like(extra))
                extras = extra if extras is None else extras + extra
            outs = jnp.where((stage == num_stages - 1) & valid, outs.at[mbc].set(y), outs)
            act = jax.lax.ppermute(y, STAGE_AXIS, perm)
        outs = jax.lax.psum(outs, STAGE_AXIS)  # only the last stage holds them: share with every stage
        caches = [jax.tree.map(lambda a: a[None], c) for c in caches]
        return outs, caches, (extras[None] if extra_out else jnp.zeros((1,), jnp.int32))

    def run(slot_params, slot_caches, x_all, micro_md):
        stage_spec = jax.tree.map(lambda _: P(STAGE_AXIS), slot_params)
        cache_spec = [P(STAGE_AXIS)] * len(slot_caches)
        md_spec = jax.tree.map(lambda _: P(), micro_md)
        # Manual over the stages and every axis of size 1 (a Mosaic kernel inside must see no automatic axis);
        # the tensor and expert axes, when they split, stay automatic and the attention's and the experts' own
        # shard_maps take them.
        mesh = jax.sharding.get_abstract_mesh()
        manual = {STAGE_AXIS} | {name for name, size in mesh.shape.items() if size == 1}
        return jax.shard_map(body, in_specs=(stage_spec, cache_spec, P(), md_spec),
                             out_specs=(P(), cache_spec, P(STAGE_AXIS)), axis_names=manual,
                             check_vma=False)(slot_params, slot_caches, x_all, micro_md)

    return run


def stack_stage_slots(layer_states: Sequence, plan: SlotPlan, mesh) -> list:
    """Per slot j, the states of the layers `plan` puts there, stacked on a leading axis sharded over 'pipeline'
    (each array keeps its other dimensions' sharding). A stage with no layer in the slot gets zeros (a padding slot:
    its shard costs one layer's weights of the slot's kind on that stage's devices, as the stacked array is even)."""
    slots = []
    for j in range(plan.num_slots):
        like = layer_states[plan.slot_layer(j)]
        padding = [row[j] is None for row in plan.slot_layers]
        members = [like if pad else layer_states[row[j]] for row, pad in zip(plan.slot_layers, padding)]

        def stack(*arrays):
            spec = getattr(arrays[0].sharding, "spec", jax.sharding.PartitionSpec())
            sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(STAGE_AXIS, *spec))
            host = np.stack([np.zeros(a.shape, a.dtype) if pad else np.asarray(a) for a, pad in zip(arrays, padding)])
            return jax.device_put(host, sharding)

        slots.append(jax.tree.map(stack, *members))
    return slots
