"""Choosing an instance: round-robin and least-requests baselines, and the load-aware score over each
instance's WatchLoad reports plus an approximate prefix-affinity index. Pure Python over `InstanceView`s, so
every policy is testable without processes. The score is explained in docs/gateway.md.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import statistics
from typing import Sequence

from serving.gateway.config import RoutingConfig, ScoreWeights
from serving.wire import meshserve_pb2 as pb

PROMPT_BLOCK_TOKENS = 16  # affinity granularity of token-id prompts
MAX_SLOWNESS = 10.0


@dataclasses.dataclass(slots=True)
class InstanceView:
    """What routing reads of one instance (pools.Instance has one)."""
    name: str
    inflight: int = 0  # this gateway's requests running there
    sent_since_report: int = 0  # routed after its last report was taken (not in num_waiting yet)
    report: pb.LoadReport | None = None
    report_age_s: float = float("inf")
    latency_ewma_s: float = 0.0  # inter-token latency seen by the gateway (0: none yet)
    step_time_s: float = 0.0  # the last reported step-time p50 that had steps behind it (0: none yet)
    capacity: int = 64  # the gateway's cap on inflight there


def prompt_blocks(req: pb.GenerateRequest, block_chars: int) -> list[bytes]:
    """Chain hashes of the prompt's full leading blocks (h(parent, block)), the affinity index's keys."""
    which = req.WhichOneof("prompt")
    if which == "token_ids":
        ids = list(req.token_ids.ids)
        chunks = [repr(ids[i:i + PROMPT_BLOCK_TOKENS]).encode()
                  for i in range(0, len(ids) - PROMPT_BLOCK_TOKENS + 1, PROMPT_BLOCK_TOKENS)]
    else:
        if which == "text":
            data = req.text.encode()
        elif which == "chat":
            data = b"".join(m.role.encode() + b"\x00" + m.content.encode() + b"\x01" for m in req.chat.messages)
        else:
            return []
        chunks = [data[i:i + block_chars] for i in range(0, len(data) - block_chars + 1, block_chars)]
    out, parent = [], b""
    for c in chunks:
        parent = hashlib.blake2b(parent + c, digest_size=12).digest()
        out.append(parent)
    return out


class PrefixIndex:
    """Approximate: block hash -> the few instances it was last sent to, LRU-bounded. Affinity of an instance is
    the fraction of the prompt's blocks matched there, counted from the start (the instance's prefix cache can
    only reuse a leading run). Entries age out; an instance's prefix cache may have evicted them anyway."""

    def __init__(self, max_entries: int = 100_000, per_block: int = 4):
        self.max_entries = max_entries
        self.per_block = per_block
        self._index: collections.OrderedDict[bytes, list[str]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._index)

    def affinity(self, blocks: Sequence[bytes]) -> dict[str, float]:
        if not blocks:
            return {}
        depth: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(blocks):
            names = self._index.get(h)
            if not names:
                break
            alive = set(names) if alive is None else alive & set(names)
            if not alive:
                break
            for n in alive:
                depth[n] = i + 1
        return {n: d / len(blocks) for n, d in depth.items()}

    def record(self, blocks: Sequence[bytes], name: str) -> None:
        for h in blocks:
            names = self._index.pop(h, None) or []
            if name in names:
                names.remove(name)
            names.insert(0, name)
            del names[self.per_block:]
            self._index[h] = names
        while len(self._index) > self.max_entries:
            self._index.popitem(last=False)

    def forget(self, name: str) -> None:
        for h in [h for h, names in self._index.items() if name in names]:
            self._index[h].remove(name)
            if not self._index[h]:
                del self._index[h]


def _step_time(v: InstanceView) -> float:
    """How fast it steps: the larger of its reported step time and the token gaps the gateway saw (0: unknown)."""
    return max(v.step_time_s, v.latency_ewma_s)


def load_scores(views: Sequence[InstanceView], weights: ScoreWeights, stale_after_s: float,
                affinity: dict[str, float] | None = None) -> dict[str, float]:
    """Lower is better. A fresh report: waiting + running + KV + slowness + throughput deficit - affinity.
    A stale or missing one (unknown load): the gateway's own in-flight count plus the `unknown` penalty."""
    affinity = affinity or {}
    steps = [s for s in (_step_time(v) for v in views) if s > 0]
    median_step = statistics.median(steps) if steps else 0.0
    rates = {}
    for v in views:
        r = v.report
        if r is not None and v.report_age_s <= stale_after_s and r.num_running > 0 and r.generation_tokens_per_s > 0:
            rates[v.name] = r.generation_tokens_per_s / r.num_running
    best_rate = max(rates.values(), default=0.0)
    scores = {}
    for v in views:
        r = v.report
        step = _step_time(v)
        slowness = min(MAX_SLOWNESS, max(0.0, step / median_step - 1.0)) if step > 0 and median_step > 0 else 0.0
        if r is None or v.report_age_s > stale_after_s:
            seqs = max(1, r.max_num_seqs) if r is not None else max(1, v.capacity)
            s = weights.waiting * v.inflight / seqs + weights.unknown + weights.slowness * slowness
        else:
            seqs = max(1, r.max_num_seqs)
            waiting = (r.num_waiting + v.sent_since_report) / seqs
            running = r.num_running / seqs
            deficit = 1.0 - rates[v.name] / best_rate if v.name in rates and best_rate > 0 else 0.0
            s = (weights.waiting * waiting + weights.running * running + weights.kv * r.kv_cache_usage
                 + weights.slowness * slowness + weights.throughput * deficit)
        scores[v.name] = s - weights.affinity * affinity.get(v.name, 0.0)
    return scores


def adapter_candidates(views: Sequence[InstanceView], adapter: str) -> list[InstanceView]:
    """The instances a request for LoRA adapter `adapter` should go to, by their load reports: those with it in a
    device slot (affinity: no load, its prefix cache), else those with a free slot (it loads there off the step's
    path), else any that serves it (one evicts its least recently used idle adapter). [] when none serves it."""
    serving = [v for v in views if v.report is not None and adapter in v.report.lora_adapters]
    for tier in ([v for v in serving if adapter in v.report.lora_resident],
                 [v for v in serving if len(v.report.lora_resident) < v.report.max_loras]):
        if tier:
            return tier
    return serving


class Router:
    """Picks one of the candidate instances (already filtered: routable, in the right lane and pool, below
    their in-flight cap) by the configured policy."""

    def __init__(self, config: RoutingConfig):
        self.config = config
        self.prefix_index = PrefixIndex(config.prefix_index_size)
        self._rr = itertools.count()
        self.last_scores: dict[str, float] = {}

    def reconfigure(self, config: RoutingConfig) -> None:
        if config.prefix_index_size != self.config.prefix_index_size:
            self.prefix_index.max_entries = config.prefix_index_size
        self.config = config

    def choose(self, candidates: Sequence[InstanceView], blocks: Sequence[bytes] = (),
               held: dict[str, float] | None = None) -> InstanceView | None:
        """`held`: per instance whose KV events the gateway follows, the fraction of the prompt's blocks it holds
        (replaces the guess from `blocks` there)."""
        if not candidates:
            return None
        policy = self.config.policy
        if policy == "round_robin":
            ordered = sorted(candidates, key=lambda v: v.name)
            return ordered[next(self._rr) % len(ordered)]
        if policy == "least_requests":
            ordered = sorted(candidates, key=lambda v: v.name)
            start = next(self._rr) % len(ordered)  # rotate among equals
            rotated = ordered[start:] + ordered[:start]
            return min(rotated, key=lambda v: v.inflight)
        affinity = self.prefix_index.affinity(blocks)
        if held:
            affinity.update(held)
        scores = load_scores(candidates, self.config.weights, self.config.stale_after_s, affinity)
        self.last_scores.update(scores)
        ordered = sorted(candidates, key=lambda v: v.name)
        start = next(self._rr) % len(ordered)
        rotated = ordered[start:] + ordered[:start]  # equal scores: spread
        return min(rotated, key=lambda v: scores[v.name])

    def record(self, blocks: Sequence[bytes], name: str) -> None:
        if blocks and self.config.policy == "load_aware":
            self.prefix_index.record(blocks, name)
