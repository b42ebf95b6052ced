"""Slow-node isolation and failure handling as a pure state machine per instance (`HealthTracker`, `Transition`):
quarantine after N slow windows against the peers, readmission after M healthy ones, failures and admin drains; each
transition is returned to the caller, which logs and counts it. Details: docs/gateway.md."""
from __future__ import annotations

import dataclasses
import statistics

from serving.gateway.config import IsolationConfig

HEALTHY, QUARANTINED, FAILED, DRAINED = "healthy", "quarantined", "failed", "drained"


@dataclasses.dataclass(slots=True)
class Transition:
    name: str
    old: str
    new: str
    reason: str


@dataclasses.dataclass(slots=True)
class _Node:
    state: str = HEALTHY
    reason: str = ""
    samples: list = dataclasses.field(default_factory=list)
    abnormal_streak: int = 0
    healthy_streak: int = 0
    window_latency_s: float = 0.0  # last window's measurement (0: none)
    probe_ok: bool | None = None  # quarantined / failed: this window's probe or health check result


class HealthTracker:
    def __init__(self, config: IsolationConfig):
        self.config = config
        self.nodes: dict[str, _Node] = {}
        self.baseline_s = 0.0  # EWMA of the fastest normal window latency: the reference when no peer has data

    def add(self, name: str) -> None:
        self.nodes.setdefault(name, _Node())

    def remove(self, name: str) -> None:
        self.nodes.pop(name, None)

    def state(self, name: str) -> str:
        node = self.nodes.get(name)
        return node.state if node else FAILED

    def routable(self, name: str) -> bool:
        return self.state(name) == HEALTHY

    def observe_latency(self, name: str, seconds: float) -> None:
        node = self.nodes.get(name)
        if node is not None and len(node.samples) < 10_000:
            node.samples.append(seconds)

    def _move(self, name: str, new: str, reason: str) -> Transition:
        node = self.nodes[name]
        t = Transition(name, node.state, new, reason)
        node.state, node.reason = new, reason
        node.abnormal_streak = node.healthy_streak = 0
        node.samples.clear()
        return t

    def mark_failed(self, name: str, reason: str) -> Transition | None:
        node = self.nodes.get(name)
        if node is None or node.state in (FAILED, DRAINED):
            if node is not None and node.state == FAILED:
                node.healthy_streak = 0
            return None
        return self._move(name, FAILED, reason)

    def drain(self, name: str, resume: bool) -> Transition | None:
        node = self.nodes[name]
        if resume and node.state == DRAINED:
            return self._move(name, HEALTHY, "resumed by an admin")
        if not resume and node.state != DRAINED:
            return self._move(name, DRAINED, "drained by an admin")
        return None

    def probe_result(self, name: str, ok: bool, latencies: list[float] = ()) -> None:
        """A quarantined instance's probe (latencies between its tokens), or a failed one's health check."""
        node = self.nodes.get(name)
        if node is None:
            return
        node.probe_ok = ok and (node.probe_ok is not False)
        node.samples.extend(latencies)

    def _abnormal(self, latency: float, reference: float) -> bool:
        c = self.config
        return latency > c.slow_ratio * reference and latency > reference + c.slow_min_delta_s

    def end_window(self, fallback_latency: dict[str, float] | None = None) -> list[Transition]:
        """Closes the window: judges every instance. `fallback_latency`: a healthy instance's step time from its
        load report, used when the gateway saw none of its tokens this window (traffic from elsewhere)."""
        c = self.config
        fallback_latency = fallback_latency or {}
        measured: dict[str, float] = {}
        for name, node in self.nodes.items():
            if node.samples:
                measured[name] = statistics.median(node.samples)
            elif node.state == HEALTHY and fallback_latency.get(name, 0) > 0:
                measured[name] = fallback_latency[name]
            node.window_latency_s = measured.get(name, 0.0)
        transitions = []
        normal: list[float] = []  # healthy instances judged normal: what the baseline learns from
        num_healthy = sum(1 for node in self.nodes.values() if node.state == HEALTHY)
        for name, node in self.nodes.items():
            latency = measured.get(name)
            peers = [measured[n] for n, p in self.nodes.items() if p.state == HEALTHY and n != name and n in measured]
            reference = statistics.median(peers) if peers else self.baseline_s
            if node.state == HEALTHY:
                if latency is not None and reference <= 0:
                    normal.append(latency)  # nothing to compare with yet
                if not c.enabled or latency is None or reference <= 0:
                    pass
                elif self._abnormal(latency, reference):
                    node.abnormal_streak += 1
                    if node.abnormal_streak >= c.abnormal_windows and num_healthy > 1:
                        transitions.append(self._move(name, QUARANTINED, (
                            f"inter-token latency {latency * 1e3:.0f} ms vs peers' {reference * 1e3:.0f} ms for "
                            f"{c.abnormal_windows} windows")))
                        num_healthy -= 1
                else:
                    node.abnormal_streak = 0
                    normal.append(latency)
            elif node.state == QUARANTINED:
                ok = node.probe_ok
                if ok is not None:
                    healthy = ok and latency is not None and (reference <= 0 or not self._abnormal(latency, reference))
                    node.healthy_streak = node.healthy_streak + 1 if healthy else 0
                    if node.healthy_streak >= c.healthy_windows:
                        transitions.append(self._move(name, HEALTHY, (
                            f"probes healthy for {c.healthy_windows} windows ({(latency or 0) * 1e3:.0f} ms vs "
                            f"{reference * 1e3:.0f} ms)")))
            elif node.state == FAILED:
                ok = node.probe_ok
                if ok is not None:
                    node.healthy_streak = node.healthy_streak + 1 if ok else 0
                    if node.healthy_streak >= c.healthy_windows:
                        transitions.append(self._move(name, HEALTHY, f"serving again for {c.healthy_windows} windows"))
            node.samples.clear()
            node.probe_ok = None
        if normal:
            # The fastest normal instance: a slow one never drags the reference up with it, even in windows where
            # it is the only one measured (all traffic stuck on it).
            m = min(normal)
            self.baseline_s = m if self.baseline_s == 0 else 0.8 * self.baseline_s + 0.2 * m
        return transitions
