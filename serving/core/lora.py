"""The LoRA adapters of an engine: the registry of those it serves by name (`AdapterRegistry`, `Adapter`,
`UnknownAdapterError`) and the adapter slots on its device (`LoRASlots`): an LRU cache of adapters, each loaded on
demand off the step's critical path (the host reads and lays out its weights on a thread; the device write of its
slot is a small jitted scatter between steps), a slot in use never evicted nor overwritten. Details: docs/lora.md."""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import re
import threading
from typing import Callable, Sequence

import numpy as np

from models.config import ModelConfig
from models.lora import PeftAdapter, read_peft_adapter
from pallas_kernels.lora import quantize_adapter, to_layout
from serving.core.request import Request

log = logging.getLogger(__name__)

# An adapter's name: what requests carry (the OpenAI `model` field); printable, no spaces, at most this long.
MAX_ADAPTER_NAME = 256
_NAME = re.compile(r"[!-~]+")


class UnknownAdapterError(LookupError):
    """A request or call names an adapter the engine does not serve (the server answers 404 / NOT_FOUND)."""


@dataclasses.dataclass(eq=False)
class Adapter:
    """A registered adapter: its name, PEFT directory and checked config (`models.lora.PeftAdapter`). `uid` is this
    load's (a name loaded again is a new adapter: its own prefix-cache root, `block_manager.prefix_root`)."""
    name: str
    path: str
    uid: int
    peft: PeftAdapter
    registered: bool = True  # False once unloaded: requests that hold it finish on it; no new one may name it

    def info(self) -> dict:
        return {"name": self.name, "path": self.path, "rank": self.peft.rank,
                "target_modules": list(self.peft.target_modules)}


class AdapterRegistry:
    """The adapters an engine serves, by name (shared by the replicas of a data-parallel engine). Adding one checks
    it against the model and `max_rank` (`models.lora.read_peft_adapter`: AdapterError naming why it does not fit).
    Thread-safe: requests look adapters up on the server's threads."""

    def __init__(self, model_config: ModelConfig, max_rank: int):
        self.model_config, self.max_rank = model_config, max_rank
        self._adapters: dict[str, Adapter] = {}
        self._uids = itertools.count(1)
        self._lock = threading.Lock()

    def add(self, name: str, path: str) -> Adapter:
        """Registers the PEFT adapter in directory `path` as `name`; ValueError if the name is taken or malformed,
        AdapterError if the adapter does not fit the model."""
        if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > MAX_ADAPTER_NAME:
            raise ValueError(f"adapter name {name!r}: 1-{MAX_ADAPTER_NAME} printable characters without spaces")
        peft = read_peft_adapter(path, self.model_config, self.max_rank)
        with self._lock:
            if name in self._adapters:
                raise ValueError(f"adapter {name!r} is already loaded (from {self._adapters[name].path!r}); unload "
                                 "it first")
            adapter = self._adapters[name] = Adapter(name, path, next(self._uids), peft)
        log.info("LoRA adapter %r registered from %s: rank %d, %s", name, path, peft.rank,
                 ", ".join(peft.target_modules))
        return adapter

    def remove(self, name: str) -> Adapter:
        """Unregisters `name` (new requests naming it get UnknownAdapterError; those holding it finish on it)."""
        with self._lock:
            adapter = self._adapters.pop(name, None)
            if adapter is None:
                raise self._unknown(name)
            adapter.registered = False
        return adapter

    def get(self, name: str) -> Adapter:
        with self._lock:
            adapter = self._adapters.get(name)
            if adapter is None:
                raise self._unknown(name)
            return adapter

    def adapters(self) -> list[Adapter]:
        with self._lock:
            return list(self._adapters.values())

    def _unknown(self, name: str) -> UnknownAdapterError:
        known = ", ".join(sorted(map(repr, self._adapters))) or "none"
        return UnknownAdapterError(f"adapter {name!r} is not loaded (loaded: {known})")


def slot_values(peft: PeftAdapter, model_config: ModelConfig, layout: Sequence[tuple], dtype) -> list[np.ndarray]:
    """Host-side. An adapter's weights as one slot of each LoRA stack (`layout`: (layer, projection, A stack
    shape, B stack shape, A's form, B's form, int8) per projection, `ModelRunner.lora_layout`): per projection A
    [R, *in] and B [R, *out] in `dtype` (in those `pallas_kernels.lora.to_layout` forms), zero past
    its rank (and all zero for a projection it leaves alone), then its rank (int32); int8 stacks as
    `pallas_kernels.lora.quantize_adapter` gives them, then the rank, then the scales."""
    weights = peft.weights(model_config)
    out = []
    for layer, name, a_shape, b_shape, a_layout, b_layout, int8 in layout:
        a, b = np.zeros(a_shape[1:], np.float32), np.zeros(b_shape[1:], np.float32)
        rank = 0
        if (layer, name) in weights:
            wa, wb = weights[layer, name]
            rank = wa.shape[0]
            a[:rank], b[:rank] = wa, wb
        if int8:
            aq, bq, scale = quantize_adapter(a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1))
            out += [aq, bq, np.int32(rank), scale]
            continue
        if rank:  # (zeros are zeros in every form)
            a, b = (to_layout(w.reshape(w.shape[0], -1), form).reshape(w.shape)
                    for w, form in ((a, a_layout), (b, b_layout)))
        out += [a.astype(dtype), b.astype(dtype), np.int32(rank)]
    return out


class LoRASlots:
    """The device's adapter slots (one engine's), behind the scheduler's admission (`serving.core.scheduler.
    AdapterSlots`): `ready` says whether a request's adapter is on the device, starting its load into a free slot,
    else into the least recently used idle one (evicting it); a slot with running requests (pinned from admission
    until they finish or are preempted) is never evicted. When every slot is pinned, the one with the fewest requests
    drains: no new request pins it until a waiting adapter takes it, so no adapter waits forever. `poll` (between
    steps) writes the loads whose host side is done into their slots.

    `prepare(adapter)` -> the slot's host arrays (run on a thread), `write(slot, values)` -> the device write (the
    runner's jitted scatter)."""

    def __init__(self, max_loras: int, prepare: Callable[[Adapter], list], write: Callable[[int, list], None]):
        self.max_loras = max_loras
        self._prepare, self._write = prepare, write
        self.adapters: list[Adapter | None] = [None] * max_loras  # what each slot holds (or is loading)
        self.pins = [0] * max_loras  # running requests per slot
        self._slot: dict[Adapter, int] = {}
        # slots with no running request, least recently used first (empty ones at the front)
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(max_loras))
        self._loading: dict[int, concurrent.futures.Future] = {}
        self.draining: int | None = None
        self._idle_polls = 0  # polls the draining slot was idle through without a waiting adapter taking it
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meshserve-lora")
        self.num_loads = 0  # slots written (counters: metrics, tests)
        self.num_evictions = 0  # loaded adapters pushed out of their slot by another's load

    # ---- the scheduler's side -----------------------------------------------------------------------------
    def ready(self, request: Request) -> bool:
        adapter = request.adapter
        slot = self._slot.get(adapter)
        if slot is not None:
            return slot not in self._loading and slot != self.draining
        slot = self._take_slot()
        if slot is None:
            self._drain_one()
            return False
        self._start_load(adapter, slot)
        return False

    def pin(self, request: Request) -> None:
        slot = self._slot[request.adapter]
        self.pins[slot] += 1
        self._idle.pop(slot, None)
        request.lora_slot = slot

    def release(self, request: Request) -> None:
        slot, request.lora_slot = request.lora_slot, -1
        self.pins[slot] -= 1
        if self.pins[slot]:
            return
        self._idle[slot] = None
        if not self.adapters[slot].registered or slot == self.draining:
            self._idle.move_to_end(slot, last=False)  # the next load takes it (a waiting request may still pin it)

    def check(self, running: Sequence[Request]) -> None:
        """Raises AssertionError if the pins disagree with the running requests' slots (tests)."""
        counts = [0] * self.max_loras
        for r in running:
            if r.adapter is not None:
                assert self.adapters[r.lora_slot] is r.adapter, f"{r} runs on slot {r.lora_slot}, which holds another"
                counts[r.lora_slot] += 1
            else:
                assert r.lora_slot == -1, f"{r} has no adapter but slot {r.lora_slot}"
        assert counts == self.pins, f"slot pins {self.pins} disagree with the running requests' {counts}"
        assert all((p == 0) == (s in self._idle) for s, p in enumerate(self.pins)), "idle list disagrees with pins"

    # ---- loads --------------------------------------------------------------------------------------------
    def _take_slot(self) -> int | None:
        """A slot for a new load: an empty one, else the least recently used idle one (its adapter evicted)."""
        for slot in self._idle:
            if slot in self._loading:
                continue
            if self.adapters[slot] is not None:
                self.num_evictions += self.adapters[slot].registered  # (an unloaded one's slot is no eviction)
                self._evict(slot)
            del self._idle[slot]
            self._idle[slot] = None  # (idle until a request pins it)
            self.draining = None  # the waiting adapter has a slot
            return slot
        return None

    def _evict(self, slot: int) -> None:
        del self._slot[self.adapters[slot]]
        self.adapters[slot] = None

    def _drain_one(self) -> None:
        if self.draining is None:
            busy = [s for s in range(self.max_loras) if self.pins[s] and s not in self._loading]
            if busy:
                self.draining = min(busy, key=lambda s: self.pins[s])
                self._idle_polls = 0

    def _start_load(self, adapter: Adapter, slot: int) -> None:
        self.adapters[slot] = adapter
        self._slot[adapter] = slot
        self._loading[slot] = self._executor.submit(self._prepare, adapter)

    def prefetch(self, adapter: Adapter) -> None:
        """Starts loading `adapter` into an empty slot, if there is one and it is not on the device (no eviction)."""
        if adapter in self._slot:
            return
        empty = next((s for s in self._idle if self.adapters[s] is None and s not in self._loading), None)
        if empty is not None:
            self._start_load(adapter, empty)

    def forget(self, adapter: Adapter) -> None:
        """After `adapter` was unregistered: its slot is the next one a load takes once no request runs on it
        (requests submitted before still run on it; a preempted one reloads it if its slot was taken)."""
        slot = self._slot.get(adapter)
        if slot is not None and not self.pins[slot]:
            self._idle.move_to_end(slot, last=False)

    @property
    def loading(self) -> bool:
        return bool(self._loading)

    def wait(self, timeout: float) -> None:
        """Blocks until a load's host side is done, at most `timeout` seconds (an engine with nothing else to do)."""
        if self._loading:
            concurrent.futures.wait(list(self._loading.values()), timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def poll(self) -> list[tuple[Adapter, BaseException]]:
        """Between steps: writes the slots whose host side is done. Returns the adapters that failed to load, with
        why (their slots are empty again; the engine ends the requests waiting on them)."""
        failed = []
        for slot, future in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[slot]
            adapter = self.adapters[slot]
            try:
                self._write(slot, future.result())
                self.num_loads += 1
            except Exception as e:  # noqa: BLE001 - a file gone or unreadable: the requests on it end, not the engine
                log.warning("LoRA adapter %r failed to load from %s: %s", adapter.name, adapter.path, e)
                self._evict(slot)
                self._idle.move_to_end(slot, last=False)
                failed.append((adapter, e))
        if self.draining is not None and self.pins[self.draining] == 0:
            self._idle_polls += 1
            if self._idle_polls > 1:  # a whole step went by and no waiting adapter took it
                self.draining = None
        return failed

    def resident(self) -> dict[str, int]:
        """{adapter name: slot} of the adapters on the device (loaded, not loading)."""
        # list() copies the items in one step under the GIL: the servers read this off the engine thread
        return {a.name: s for a, s in list(self._slot.items()) if s not in self._loading}

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
