"""`LoadTracker`: an engine step listener (it runs on the engine thread) that feeds the per-step metrics and the trace
chunk records, and keeps a rolling window of steps for the tokens/s and step-time percentiles of load reports."""
from __future__ import annotations

import collections
import threading

from serving.telemetry.metrics import ServerMetrics
from serving.telemetry.tracing import RequestTracer

STEP_WINDOW_S = 10.0


class LoadTracker:
    """Called with (engine, wall seconds) after each engine step; `snapshot(now)` gives a load report's figures."""

    def __init__(self, metrics: ServerMetrics | None, tracer: RequestTracer | None):
        self.metrics = metrics
        self.tracer = tracer
        self.steps = 0
        self.device_step_times_s: dict[str, float] = {}
        self._window: collections.deque[tuple[float, float, int, int]] = collections.deque()
        self._last = None
        self._lock = threading.Lock()

    def __call__(self, engine, wall_s: float) -> None:
        record = engine.last_step
        if record is None or record is self._last:
            return
        self._last = record
        step_time = max(record.device_step_times_s.values(), default=record.end_time - record.start_time)
        num_sampled = sum(1 for s in record.scheduled if s.sample)
        with self._lock:
            self.steps += 1
            self.device_step_times_s = dict(record.device_step_times_s)
            self._window.append((record.end_time, step_time, record.num_scheduled_tokens, num_sampled))
            while self._window and self._window[0][0] < record.end_time - STEP_WINDOW_S:
                self._window.popleft()
        if self.metrics is not None:
            self.metrics.observe_step(record.num_scheduled_tokens, record.device_step_times_s)
        if self.tracer is not None:
            self.tracer.on_step(record.scheduled, record.start_time, record.end_time)

    def snapshot(self, now: float) -> dict:
        with self._lock:
            window = list(self._window)
            devices = dict(self.device_step_times_s)
            steps = self.steps
        recent = [w for w in window if w[0] >= now - 1.0]
        times = sorted(w[1] for w in window if w[0] >= now - STEP_WINDOW_S)

        def pct(q):
            return times[min(len(times) - 1, int(q * len(times)))] if times else 0.0
        return dict(tokens_per_s=float(sum(w[2] for w in recent)), generation_tokens_per_s=float(
            sum(w[3] for w in recent)), step_time_p50_s=pct(0.5), step_time_p99_s=pct(0.99),
            device_step_times_s=devices, steps=steps)
