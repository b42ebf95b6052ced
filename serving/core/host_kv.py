"""`HostKVPool`: the host-memory tier's data under the prefix cache: a bounded pool of KV pages in host memory laid
out like the device cache (every leaf of it: a quantized cache's values and scales; a sharded cache's pages kept and
moved shard by shard; a draft model's cache's page with the target's), the bucketed gather (device -> staging) and
scatter (host -> device pages) programs, and the copies the block manager's `HostTier` queues. Details:
docs/engine.md ("Host KV tier")."""
from __future__ import annotations

import collections
import dataclasses
import logging
import time

import jax
import numpy as np

from pallas_kernels.target import tracing_for
from sharding.mesh import mesh_context
from sharding.multihost import to_global

log = logging.getLogger(__name__)


def page_bytes(kv_caches) -> int:
    """Bytes of one page over every leaf of the device cache (values and scales), unsharded."""
    return sum(int(np.prod(leaf.shape[1:])) * leaf.dtype.itemsize for leaf in jax.tree.leaves(kv_caches))


def host_pages_for(gb: float, kv_caches) -> int:
    """Host pages `gb` GiB holds (0: the tier is off)."""
    return int(gb * (1 << 30)) // page_bytes(kv_caches) if gb > 0 else 0


def transfer_buckets(max_pages: int) -> tuple[int, ...]:
    """Pages per compiled transfer program: powers of 4 up to the first >= `max_pages` (a larger batch of copies
    runs in several calls)."""
    out = [1]
    while out[-1] < max_pages:
        out.append(out[-1] * 4)
    return tuple(out)


def _shard_key(index: tuple, shape: tuple) -> tuple:
    """A shard's place in a leaf's row dims (every axis but the pages'): ((start, stop), ...)."""
    return tuple((range(n)[s].start, range(n)[s].stop) for s, n in zip(index, shape))


class _HostLeaf:
    """One cache leaf's host pages: a numpy array [num_slots, *shard row shape] per distinct shard of the device
    leaf (a replicated shard once), so a tensor-parallel cache moves shard by shard, each device's straight to and
    from its own host array, and a process only ever holds the shards its devices hold."""

    def __init__(self, leaf, num_slots: int):
        self.row_shape = tuple(leaf.shape[1:])
        self.dtype = leaf.dtype
        self.page_bytes = int(np.prod(self.row_shape)) * leaf.dtype.itemsize
        self.shards: dict[tuple, np.ndarray] = {}
        for index in leaf.sharding.addressable_devices_indices_map(leaf.shape).values():
            if range(leaf.shape[0])[index[0]] != range(leaf.shape[0]):
                raise ValueError(f"host KV tier: the cache's page axis is sharded ({leaf.sharding}); it moves "
                                 "pages of caches sharded on their head or feature axes only")
            key = _shard_key(index[1:], self.row_shape)
            if key not in self.shards:
                self.shards[key] = np.zeros((num_slots,) + tuple(b - a for a, b in key), leaf.dtype)

    def stage(self, out) -> dict[tuple, object]:
        """One device shard of gather output `out` per host shard, its device -> host copy started."""
        staged = {}
        for shard in out.addressable_shards:
            key = _shard_key(shard.index[1:], self.row_shape)
            if key in self.shards and key not in staged:
                shard.data.copy_to_host_async()
                staged[key] = shard.data
        if staged.keys() != self.shards.keys():  # laid out unlike the cache: take the whole array
            out.copy_to_host_async()
            staged = {key: _Slice(out, key) for key in self.shards}
        return staged

    def to_device(self, leaf, slots: list[int], bucket: int, memory_kind: str | None):
        """A [bucket, ...] array laid out like device `leaf` (in `memory_kind`: the staging's), its first
        len(slots) pages from host `slots`: each device's shard copied from its host shard (padding: zeros)."""
        shape = (bucket,) + self.row_shape
        arrays = []
        for device, index in leaf.sharding.addressable_devices_indices_map(shape).items():
            host = self.shards[_shard_key(index[1:], self.row_shape)]
            d = np.zeros((bucket,) + host.shape[1:], host.dtype)
            d[:len(slots)] = host[slots]  # a copy: the slots may take new blocks before the scatter runs
            arrays.append(jax.device_put(d, jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)))
        return jax.make_array_from_single_device_arrays(shape, _in_memory(leaf.sharding, memory_kind), arrays)

    def land(self, staged: dict, slots: list[int]) -> None:
        for key, data in staged.items():
            self.shards[key][slots] = np.asarray(data)[:len(slots)]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.shards.values())


def staging_memory_kind(device) -> str | None:
    """"pinned_host" where `device` has that memory (accelerators; XLA:CPU lists it too, where it is plain host
    memory like the device's own), else None: the staging arrays of the copies then live in device memory."""
    return "pinned_host" if any(m.kind == "pinned_host" for m in device.addressable_memories()) else None


def _in_memory(sharding, memory_kind: str | None):
    return sharding.with_memory_kind(memory_kind) if memory_kind else sharding


@dataclasses.dataclass(slots=True)
class _Slice:
    """A shard read from a whole staged array (a gather laid out unlike the cache)."""
    out: object
    key: tuple

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.out)[(slice(None),) + tuple(slice(a, b) for a, b in self.key)]

    def is_ready(self) -> bool:
        return self.out.is_ready()


@dataclasses.dataclass(slots=True)
class _Offload:
    """A gather whose device -> host copy is under way: lands in `slots` of the pool when its data is on the host."""
    staging: list  # per leaf, {host shard: its [bucket, ...] device shard} (copy_to_host_async called)
    slots: list[int]


@dataclasses.dataclass(slots=True)
class _Load:
    """A host -> device copy under way: scattered into `pages` (padded index `idx`) once `data` is on the device."""
    data: list  # per leaf, [bucket, ...] jax arrays being transferred
    idx: list  # per page pool, the [bucket] pages (`HostKVPool._indices`)
    pages: list[int]
    start: float  # time.perf_counter() when it was started


class HostKVPool:
    """The host tier's pages ([num_slots, page_size, rows, row_dim] numpy per cache leaf and shard: `_HostLeaf`) and
    its transfers. Plain numpy on every platform in this cut: on CPU the device cache is host memory too, so a
    transfer is a memcpy; an accelerator's D2H copy runs asynchronously (`copy_to_host_async`) and lands at a later
    step, and an H2D copy (`device_put`) likewise: its scatter into the cache is launched only once the data is on
    the device (`poll`), so no step queues behind a load it does not read."""

    def __init__(self, runner, num_slots: int, max_pages_per_step: int, draft=None):
        self.runner = runner
        # A draft model's cache (`draft.draft_kv`: SpeculativeDecoder's) is indexed by the target's page table: its
        # leaves follow the target's in every transfer, with the page table's page ids
        self.draft = draft
        leaves = self._device_leaves()
        # Per leaf, its page pool: 0 the page table's, i + 1 the i-th sliding-window pool of a hybrid cache (its
        # pages are the block manager's window pages, moved with their block where it has one)
        windows = list(runner.window_pages or {})
        self.groups = [windows.index(spec.sliding_window) + 1 if spec.sliding_window in windows else 0
                       for spec, cache in zip(runner.kv_cache_specs, runner.kv_caches)
                       for _ in jax.tree.leaves(cache)]
        self.groups += [0] * len(jax.tree.leaves(draft.draft_kv) if draft is not None else [])  # its page table's
        assert len(self.groups) == len(leaves), "a KV cache per layer spec"
        self.group_pages = [0] * (len(windows) + 1)  # each pool's pages (an index past them is dropped)
        for g, leaf in zip(self.groups, leaves):
            self.group_pages[g] = leaf.shape[0]
        self.treedef = jax.tree.structure(runner.kv_caches)
        self.num_target_leaves = self.treedef.num_leaves
        self.num_slots = num_slots
        self.leaves = [_HostLeaf(leaf, num_slots) for leaf in leaves]
        self.page_bytes = page_bytes(leaves)
        self.buckets = transfer_buckets(max_pages_per_step)
        # the copies' staging: the gather's output and the loads' input in pinned host memory where there is one
        # (the D2H / H2D copies are then DMA from / into it)
        self.staging_memory = staging_memory_kind(next(iter(leaves[0].sharding.device_set)))
        self._donate = (0,) if runner.choices.donate_kv_cache else ()
        self._gathers: dict[tuple, object] = {}  # per cache layout: staged laid out like the cache (shard by shard)
        self._scatters: dict[tuple, object] = {}  # per cache layout: the pages leave as they came (no recompile)
        self._inflight: collections.deque[_Offload] = collections.deque()
        self._loads: collections.deque[_Load] = collections.deque()
        self.bytes_to_host = self.bytes_to_device = 0
        self.load_wait_s = 0.0  # the step thread's time blocked on copies a load needed
        self.load_time_s = 0.0  # loads' time from start to landing (what their requests waited, summed per load)
        self.hold_loads = False  # tests: a load whose copy finished still waits (makes a load in flight observable)

    # ---- programs
    def _device_leaves(self) -> list:
        """The device caches' leaves the transfers move: the target's, then the draft model's."""
        leaves = jax.tree.leaves(self.runner.kv_caches)
        return leaves + jax.tree.leaves(self.draft.draft_kv) if self.draft is not None else leaves

    def _set_device_leaves(self, leaves: list) -> None:
        n = self.num_target_leaves
        self.runner.kv_caches = jax.tree.unflatten(self.treedef, leaves[:n])
        if self.draft is not None:
            self.draft.draft_kv = jax.tree.unflatten(jax.tree.structure(self.draft.draft_kv), leaves[n:])

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    # ---- multi-host: each process moves its own devices' shards; the leader announces every launch, in order
    def _announce(self, message: tuple) -> None:
        """Multi-host leader: the followers run the same call next (`follow`), as they do the forward."""
        if self.runner.channel is not None:
            self.runner.channel.broadcast(message)

    def _global(self, idx: list) -> list:
        """A launch's page indices as the program takes them (multi-host: global arrays, equal on every process)."""
        return to_global(idx, self.runner.mesh) if self.runner.multihost else idx

    def follow(self, message: tuple) -> None:
        """Multi-host follower: one call the leader announced (its host pool mirrors the leader's: the same slots
        hold the same blocks, each process its own shards)."""
        kind = message[0]
        if kind == "host_warmup":
            self.warmup()
        elif kind == "host_run":
            self.run([tuple(op) for op in message[1]])
        elif kind == "host_scatter":
            for _ in range(message[1]):
                self._scatter_next()
        else:
            raise ValueError(f"unknown host-tier message {kind!r}")

    def warmup(self) -> int:
        """Compiles the gather and scatter of every bucket (on page 0 / no page: the cache is unchanged), for the
        layout the caches have now: call after the forward's warm-up (its output layout is the one served)."""
        self._announce(("host_warmup",))
        for b in self.buckets:
            self._launch_gather(self._indices([], b, [], 0), b)
            self._launch_scatter(self._indices([], b, []), self._to_device([], b))
            self._launch_scatter(self._indices([], b, []), self._put([np.zeros(
                (b,) + h.row_shape, h.dtype) for h in self.leaves]))  # write_pages's (the same program)
        self.flush()
        return 2 * len(self.buckets)

    def _indices(self, pages: list[int], bucket: int, windows: list[tuple], pad: int | None = None) -> list:
        """Per page pool, the [bucket] int32 page indices of a transfer of primary `pages` whose window pages are
        `windows` (per page, per window pool; -1, like the padding, reads page 0 in a gather and is dropped by a
        scatter: `pad` None puts an index past the pool's pages there)."""
        out = []
        for g, n in enumerate(self.group_pages):
            idx = np.full(bucket, n if pad is None else pad, np.int32)
            col = pages if g == 0 else [w[g - 1] if w else p for p, w in zip(pages, windows)]
            idx[:len(col)] = [i if i >= 0 else (n if pad is None else pad) for i in col]
            out.append(idx)
        return out

    def _launch_gather(self, idx: list, bucket: int, host: bool = False) -> list:
        """Gathers the pages `idx` names (`_indices`: per pool, `bucket` of them) per cache leaf, laid out like the
        leaf, and starts their device -> host copy: whole arrays, or (`host`) one shard per host shard
        (`_HostLeaf.stage`)."""
        leaves = self._device_leaves()
        layout = tuple(leaf.sharding for leaf in leaves)
        fn = self._gathers.get(layout)
        if fn is None:
            groups = self.groups
            fn = self._gathers[layout] = jax.jit(
                lambda leaves, idx: [leaf[idx[g]] for leaf, g in zip(leaves, groups)],
                out_shardings=[_in_memory(s, self.staging_memory) for s in layout])
        with mesh_context(self.runner.mesh), tracing_for(self.runner.platform):
            out = fn(leaves, self._global(idx))
        if host:
            return [h.stage(a) for h, a in zip(self.leaves, out)]
        for a in out:
            a.copy_to_host_async()
        return out

    def _scatter(self, leaves: list):
        """The scatter program for the caches' layout now (the forward's output layout once it ran)."""
        layout = tuple(leaf.sharding for leaf in leaves)
        fn = self._scatters.get(layout)
        if fn is None:
            groups = self.groups
            fn = self._scatters[layout] = jax.jit(
                lambda leaves, idx, data: [leaf.at[idx[g]].set(d, mode="drop")
                                           for leaf, d, g in zip(leaves, data, groups)],
                donate_argnums=self._donate, out_shardings=list(layout))
        return fn

    @property
    def compiled_programs(self) -> int:
        """Gather and scatter programs compiled so far (tests: none on the serving path)."""
        return sum(f._cache_size() for f in (*self._gathers.values(), *self._scatters.values()))

    def _to_device(self, slots: list[int], bucket: int) -> list:
        """Starts the host -> device copy of host `slots`, per leaf a [bucket, ...] array laid out like its cache
        leaf, shard by shard."""
        leaves = self._device_leaves()
        return [h.to_device(leaf, slots, bucket, self.staging_memory) for h, leaf in zip(self.leaves, leaves)]

    def _put(self, data: list[np.ndarray]) -> list:
        """Whole host arrays (one per cache leaf) onto the devices as the loads' staging is laid out."""
        leaves = self._device_leaves()
        return [jax.device_put(d, _in_memory(leaf.sharding, self.staging_memory)) for d, leaf in zip(data, leaves)]

    def _launch_scatter(self, idx: list, data: list) -> None:
        r = self.runner
        leaves = self._device_leaves()
        with mesh_context(r.mesh), tracing_for(r.platform):
            leaves = self._scatter(leaves)(leaves, self._global(idx), data)
        self._set_device_leaves(leaves)

    # ---- whole pages out and in (KV transfers between instances: serving.core.kv_transfer)
    def _whole_pages(self, pages: list[int]) -> list[tuple]:
        """Per page, its window pages for `_indices` when every pool is indexed by the same page id."""
        return [(p,) * (len(self.group_pages) - 1) for p in pages]

    def read_pages(self, pages: list[int]) -> list[np.ndarray]:
        """Per cache leaf, the pages' data [len(pages), ...] as numpy (waits for the copy); <= buckets[-1] pages."""
        b = self._bucket(len(pages))
        staging = self._launch_gather(self._indices(pages, b, self._whole_pages(pages), 0), b)
        return [np.asarray(a)[:len(pages)] for a in staging]

    def write_pages(self, pages: list[int], data: list[np.ndarray]) -> None:
        """Writes per cache leaf [len(pages), ...] data into device `pages` (<= buckets[-1] of them)."""
        b = self._bucket(len(pages))
        idx = self._indices(pages, b, self._whole_pages(pages))  # padding: dropped
        padded = []
        for h, d in zip(self.leaves, data):
            full = np.zeros((b,) + h.row_shape, h.dtype)
            full[:len(pages)] = d
            padded.append(full)
        self._launch_scatter(idx, self._put(padded))

    # ---- the block manager's queued copies
    def run(self, ops: list[tuple[str, int, int, tuple]]) -> None:
        """Runs the copies `HostTier.ops` queued, in order, before the next step is launched: offloads gather their
        pages into staging now (the device runs them before that step overwrites the pages) and copy to the host
        asynchronously; loads start copying host slots to the device (`poll` lands them in their pages)."""
        self._announce(("host_run", [list(op) for op in ops]))
        i = 0
        while i < len(ops):
            kind = ops[i][0]
            j = i
            while j < len(ops) and ops[j][0] == kind:
                j += 1
            run = ops[i:j]
            for k in range(0, len(run), self.buckets[-1]):
                part = run[k:k + self.buckets[-1]]
                if kind == "offload":
                    self._offload([p for _, p, _, _ in part], [s for _, _, s, _ in part], [w for *_, w in part])
                else:
                    self._load([s for _, s, _, _ in part], [p for _, _, p, _ in part], [w for *_, w in part])
            i = j

    def _offload(self, pages: list[int], slots: list[int], windows: list[tuple]) -> None:
        b = self._bucket(len(pages))
        staging = self._launch_gather(self._indices(pages, b, windows, 0), b, host=True)
        self._inflight.append(_Offload(staging, slots))
        self.bytes_to_host += len(pages) * self.page_bytes
        self.land(block=False)

    def _load(self, slots: list[int], pages: list[int], windows: list[tuple]) -> None:
        pending = {s for o in self._inflight for s in o.slots}
        if pending.intersection(slots):  # evicted and hit again before its copy landed: wait for it
            t0 = time.perf_counter()
            self.flush()
            self.load_wait_s += time.perf_counter() - t0
        b = self._bucket(len(pages))
        idx = self._indices(pages, b, windows)  # padding and absent window pages: out of range, dropped
        self._loads.append(_Load(self._to_device(slots, b), idx, list(pages), time.perf_counter()))
        self.bytes_to_device += len(pages) * self.page_bytes

    @property
    def loads_in_flight(self) -> int:
        return len(self._loads)

    def poll(self) -> list[int]:
        """Launches the scatter of every load whose data is on the device (in order); returns their pages (the
        block manager's `loaded`). Call on the step thread (the cache is donated to each step)."""
        n = 0
        while n < len(self._loads) and not self.hold_loads and all(a.is_ready() for a in self._loads[n].data):
            n += 1
        if n:
            self._announce(("host_scatter", n))
        done: list[int] = []
        for _ in range(n):
            done += self._scatter_next()
        return done

    def _scatter_next(self) -> list[int]:
        """Launches the oldest load's scatter; returns its pages."""
        load = self._loads.popleft()
        self._launch_scatter(load.idx, load.data)
        self.load_time_s += time.perf_counter() - load.start
        return load.pages

    def wait_loads(self, timeout_s: float) -> None:
        """When no step can run until a load lands: blocks on the oldest load's copy (at most `timeout_s` while
        loads are held)."""
        if not self._loads:
            return
        if self.hold_loads:
            time.sleep(timeout_s)
            return
        t0 = time.perf_counter()
        jax.block_until_ready(self._loads[0].data)
        self.load_wait_s += time.perf_counter() - t0

    def land(self, block: bool) -> None:
        """Writes finished device -> host copies into their slots, oldest first (a slot may be reused: order
        matters); `block`: waits for all of them."""
        while self._inflight:
            o = self._inflight[0]
            if not block and not all(a.is_ready() for staged in o.staging for a in staged.values()):
                return
            self._inflight.popleft()
            for h, staged in zip(self.leaves, o.staging):
                h.land(staged, o.slots)

    def flush(self) -> None:
        self.land(block=True)

    def reset(self) -> list[int]:
        """Drops copies in flight (after the device cache was lost); returns the pages of the loads dropped (the
        block manager's `loaded` releases them)."""
        self._inflight.clear()
        pages = [p for load in self._loads for p in load.pages]
        self._loads.clear()
        return pages

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.leaves)
