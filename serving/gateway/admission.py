"""Admission: bounded waiting queues per class (interactive, long, batch) for requests no instance can take yet,
served in that order whenever capacity frees; a full queue is RESOURCE_EXHAUSTED at once. Token buckets for the
per-tenant rate limits (requests, and tokens)."""
from __future__ import annotations

import asyncio
import collections
import math
import time
from typing import Callable, TypeVar

T = TypeVar("T")
CLASSES = ("interactive", "long", "batch")  # service order


class QueueFull(Exception):
    def __init__(self, cls: str, bound: int):
        super().__init__(f"the gateway's {cls} queue is full ({bound} requests waiting)")
        self.cls = cls
        self.bound = bound


class Admission:
    """`acquire` returns what `try_route` returns (a routed slot) as soon as it returns one. Waiters are served in
    class order and FIFO within a class; `notify` (called when capacity frees or instances change) retries them."""

    def __init__(self, on_change: Callable[["Admission"], None] | None = None):
        self._queues: dict[str, collections.deque] = {c: collections.deque() for c in CLASSES}
        self._on_change = on_change or (lambda admission: None)  # a queue grew or shrank (e.g. depth gauges)

    def depth(self, cls: str) -> int:
        return len(self._queues[cls])

    async def acquire(self, cls: str, bound: int, try_route: Callable[[], T | None], timeout: float | None,
                      release: Callable[[T], None]) -> T:
        ahead = any(self._queues[c] for c in CLASSES[:CLASSES.index(cls) + 1])
        if not ahead:
            got = try_route()
            if got is not None:
                return got
        if len(self._queues[cls]) >= bound:
            raise QueueFull(cls, bound)
        fut = asyncio.get_running_loop().create_future()
        waiter = (fut, try_route)
        self._queues[cls].append(waiter)
        self._on_change(self)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except BaseException:
            if fut.done() and not fut.cancelled():
                release(fut.result())  # assigned just as we gave up
            else:
                fut.cancel()
            raise
        finally:
            try:
                self._queues[cls].remove(waiter)
            except ValueError:
                pass
            self._on_change(self)

    def notify(self) -> int:
        """Routes as many waiters as capacity allows; returns how many were served."""
        served = 0
        for cls in CLASSES:
            q = self._queues[cls]
            for waiter in list(q):
                fut, try_route = waiter
                if fut.done():
                    continue
                got = try_route()
                if got is not None:
                    q.remove(waiter)
                    fut.set_result(got)
                    served += 1
        if served:
            self._on_change(self)
        return served


class RateLimiter:
    """Token buckets by key: `rate` refilled per second up to `burst` (default max(1, rate)). `wait` says how long
    until `cost` is in the bucket (0: now; inf: never, the cost is over the burst) without taking it; `take` takes it,
    so several buckets can be checked before any is charged. A rate of 0 is unlimited."""

    def __init__(self):
        self._buckets: dict[object, tuple[float, float]] = {}  # key -> (level, last refill)

    @staticmethod
    def _capacity(rate: float, burst: float) -> float:
        return float(burst or max(1.0, rate))

    def _level(self, key, rate: float, cap: float, now: float) -> float:
        level, last = self._buckets.get(key, (cap, now))
        return min(cap, level + (now - last) * rate)

    def wait(self, key, rate: float, burst: float, cost: float = 1.0, now: float | None = None) -> float:
        if rate <= 0 or cost <= 0:
            return 0.0
        now = time.monotonic() if now is None else now
        cap = self._capacity(rate, burst)
        if cost > cap:
            return math.inf
        level = self._level(key, rate, cap, now)
        return 0.0 if level >= cost else (cost - level) / rate

    def take(self, key, rate: float, burst: float, cost: float = 1.0, now: float | None = None) -> None:
        if rate <= 0 or cost <= 0:
            return
        now = time.monotonic() if now is None else now
        self._buckets[key] = (self._level(key, rate, self._capacity(rate, burst), now) - cost, now)

    def allow(self, key, rate: float, burst: float, now: float | None = None, cost: float = 1.0) -> float:
        """Takes `cost` if it is there (returns 0), else returns the seconds until it will be."""
        now = time.monotonic() if now is None else now
        wait = self.wait(key, rate, burst, cost, now)
        if wait == 0:
            self.take(key, rate, burst, cost, now)
        return wait
