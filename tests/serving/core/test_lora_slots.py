"""The LoRA adapter slots' policy (serving/core/lora.py `LoRASlots`) on its own, with the host read and the device
write recorded instead of run: empty slots first, then the least recently used idle one; a pinned slot is never
taken; when every slot is pinned the least busy one drains until the waiting adapter gets it; a failed load frees its
slot; an unloaded adapter's slot goes first."""
import threading

from models.lora import PeftAdapter
from serving.core.lora import Adapter, LoRASlots
from serving.core.request import Request
from serving.core.sampling_params import SamplingParams


def adapter(name: str) -> Adapter:
    return Adapter(name, f"/adapters/{name}", uid=hash(name) & 0xFFFF, peft=PeftAdapter(f"/adapters/{name}", 4, ()))


def request(rid: str, a: Adapter) -> Request:
    r = Request(rid, [1, 2, 3], SamplingParams(), arrival_time=0.0)
    r.adapter = a
    return r


class Device:
    """Records slot writes; `prepare` fails for the adapters in `broken`, and waits on `gate` when given."""

    def __init__(self):
        self.writes: list[tuple[int, str]] = []
        self.broken: set[str] = set()

    def prepare(self, a: Adapter):
        if a.name in self.broken:
            raise OSError(f"{a.path}: gone")
        return a.name

    def write(self, slot: int, values) -> None:
        self.writes.append((slot, values))


def settle(slots: LoRASlots):
    """Waits for the loads under way and writes them (the engine's poll between steps)."""
    failed = []
    while slots.loading:
        slots.wait(1.0)
        failed += slots.poll()
    return failed


def admit(slots: LoRASlots, r: Request) -> bool:
    """The scheduler's admission: ready, then pin."""
    if not slots.ready(r):
        return False
    slots.pin(r)
    return True


def test_empty_slots_then_least_recently_used_and_pins_hold():
    device = Device()
    slots = LoRASlots(2, device.prepare, device.write)
    a, b, c = adapter("a"), adapter("b"), adapter("c")
    ra, rb = request("ra", a), request("rb", b)
    assert not admit(slots, ra) and not admit(slots, rb)  # both start loading, into the empty slots
    settle(slots)
    assert device.writes == [(0, "a"), (1, "b")] and admit(slots, ra) and admit(slots, rb)
    slots.release(rb)
    slots.release(ra)  # a is now the most recently used
    assert not admit(slots, request("rc", c))
    settle(slots)
    assert device.writes[-1] == (1, "c") and slots.num_evictions == 1  # b's slot: the least recently used
    assert slots.resident() == {"a": 0, "c": 1}
    rc, ra2 = request("rc2", c), request("ra2", a)
    assert admit(slots, rc) and admit(slots, ra2)
    assert not admit(slots, request("rb2", b))  # every slot pinned: nothing evicted
    assert slots.resident() == {"a": 0, "c": 1} and slots.draining is not None
    slots.check([rc, ra2])


def test_a_busy_adapter_cannot_starve_a_waiting_one():
    device = Device()
    slots = LoRASlots(1, device.prepare, device.write)
    hot, cold = adapter("hot"), adapter("cold")
    first = request("hot-0", hot)
    admit(slots, first)
    settle(slots)
    assert admit(slots, first)
    waiting = request("cold-0", cold)
    assert not admit(slots, waiting)  # the only slot is pinned: it drains
    assert slots.draining == 0
    assert not admit(slots, request("hot-1", hot))  # a newcomer on the draining slot waits too
    slots.release(first)
    assert not admit(slots, waiting)  # the drained slot is taken for cold
    settle(slots)
    assert admit(slots, waiting) and device.writes[-1] == (0, "cold") and slots.draining is None
    slots.check([waiting])


def test_a_failed_load_empties_its_slot():
    device = Device()
    device.broken.add("bad")
    slots = LoRASlots(1, device.prepare, device.write)
    bad = adapter("bad")
    assert not admit(slots, request("r", bad))
    failed = settle(slots)
    assert [(a.name, type(e)) for a, e in failed] == [("bad", OSError)] and slots.resident() == {}
    good = request("g", adapter("good"))
    assert not admit(slots, good)
    settle(slots)
    assert admit(slots, good) and device.writes == [(0, "good")]


def test_an_unloaded_adapters_slot_is_reused_first():
    device = Device()
    slots = LoRASlots(2, device.prepare, device.write)
    a, b = adapter("a"), adapter("b")
    ra, rb = request("ra", a), request("rb", b)
    for r in (ra, rb):
        admit(slots, r)
    settle(slots)
    assert admit(slots, rb) and admit(slots, ra)  # a was pinned last: b is the least recently used
    a.registered = False  # unloaded while ra runs on it
    slots.forget(a)
    assert slots.resident() == {"a": 0, "b": 1}  # ra still runs on it
    slots.release(rb)
    slots.release(ra)
    assert not admit(slots, request("rc", adapter("c")))
    settle(slots)
    assert device.writes[-1] == (0, "c") and slots.num_evictions == 0  # a's slot, though b is older


def test_loads_run_off_the_callers_thread():
    device = Device()
    threads = []
    slots = LoRASlots(1, lambda a: threads.append(threading.current_thread().name) or a.name, device.write)
    admit(slots, request("r", adapter("a")))
    settle(slots)
    assert threads and threads[0] != threading.current_thread().name and threads[0].startswith("meshserve-lora")
