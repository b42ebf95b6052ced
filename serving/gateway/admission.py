"""Admission: bounded waiting queues per class (interactive, long, batch) for requests no instance can take yet,
served in that order whenever capacity frees; a full queue is RESOURCE_EXHAUSTED at once. Per-tenant token-bucket
rate limits."""
from __future__ import annotations

import asyncio
import collections
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
    """Token bucket per tenant: `requests_per_s` refill, `burst` capacity. `allow` returns 0 when the request may
    go, else the seconds until a token is available."""

    def __init__(self):
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, last refill)

    def allow(self, tenant: str, requests_per_s: float, burst: int, now: float | None = None) -> float:
        if requests_per_s <= 0:
            return 0.0
        now = time.monotonic() if now is None else now
        cap = float(burst or max(1.0, requests_per_s))
        tokens, last = self._buckets.get(tenant, (cap, now))
        tokens = min(cap, tokens + (now - last) * requests_per_s)
        if tokens >= 1.0:
            self._buckets[tenant] = (tokens - 1.0, now)
            return 0.0
        self._buckets[tenant] = (tokens, now)
        return (1.0 - tokens) / requests_per_s
