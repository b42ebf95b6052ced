"""`Scheduler`: which requests run in the next step (`schedule` -> `SchedulerOutput`, preempting by recompute when pages
run out; the samples of an n > 1 request share their prompt's pages), and what their sampled tokens do to them
(`update`); `SchedulerConfig` and the admission errors. Details: docs/engine.md."""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import time
from typing import Protocol, Sequence

import numpy as np

from serving.core.block_manager import BlockManager, prefix_root
from serving.core.request import FinishReason, Request, RequestStatus, SampleGroup
from serving.params import ContextLengthError, check_prompt_length


# The input token of a decode scheduled while the step that samples it is still on the device (look-ahead): the
# engine feeds it from that step's device-side tokens.
PLACEHOLDER_TOKEN = -1


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound: the instance is busy (gRPC RESOURCE_EXHAUSTED); retry elsewhere/later."""


PromptTooLongError = ContextLengthError  # the prompt does not fit the model's context (gRPC INVALID_ARGUMENT)


@dataclasses.dataclass(slots=True)
class SchedulerConfig:
    max_model_len: int  # the model's context: prompt + output tokens never exceed it (finish reason `length`)
    num_pages: int  # KV pages; from the memory ledger once it exists
    page_size: int = 16
    max_num_batched_tokens: int = 2048  # token budget per step
    max_num_seqs: int = 256  # sequences per step (and running at once)
    max_prefill_chunk: int | None = None  # per-request prefill chunk cap; None = the token budget
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 1024  # admission bound: requests queued
    max_waiting_tokens: int = 1 << 22  # admission bound: prompt tokens queued
    long_prompt_threshold: int = 8192  # a prompt above this many tokens goes through the long lane
    max_long_prefills: int = 1  # long prompts in prefill at once
    priority_ageing_s: float = 10.0  # a class-c request queues as if it had arrived c * this later
    preempt_for_priority: bool = True  # a waiting request may preempt running ones of a lower class

    def __post_init__(self):
        for name in ("max_model_len", "num_pages", "page_size", "max_num_batched_tokens", "max_num_seqs",
                     "max_waiting_requests", "max_waiting_tokens", "long_prompt_threshold", "max_long_prefills"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an integer >= 1, got {value!r}")
        if self.max_prefill_chunk is not None and (not isinstance(self.max_prefill_chunk, int)
                                                   or self.max_prefill_chunk < 1):
            raise ValueError(f"SchedulerConfig.max_prefill_chunk must be None or >= 1, got {self.max_prefill_chunk!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"SchedulerConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({self.max_num_seqs}) so every running decode fits one step")
        if self.num_pages * self.page_size < self.max_model_len:
            raise ValueError(f"SchedulerConfig: {self.num_pages} pages of {self.page_size} tokens hold "
                             f"{self.num_pages * self.page_size} tokens, less than max_model_len "
                             f"({self.max_model_len}); lower max_model_len or add pages")
        if not self.priority_ageing_s >= 0:
            raise ValueError(f"SchedulerConfig.priority_ageing_s must be >= 0, got {self.priority_ageing_s!r}")

    @property
    def prefill_chunk(self) -> int:
        return self.max_prefill_chunk or self.max_num_batched_tokens


@dataclasses.dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step; duck-types as serving.core.batch.SeqChunk (token_ids, start, block_table)."""
    request: Request
    token_ids: list[int]  # fed this step, at positions start .. start+len-1
    start: int  # tokens already in the KV cache
    block_table: list[int]  # the request's page ids (covers start+len tokens)
    sample: bool  # this step reaches the sequence's last token: sample one from its logits

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclasses.dataclass(slots=True)
class RequestOutput:
    """What one request gained in one step (or how it ended)."""
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: int | str | None  # the stop token id (or stop string) that ended it
    request: Request  # full state: token history and metrics (timestamps, preemptions, cached tokens)


@dataclasses.dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence]  # run these this step, in this order
    finished: list[RequestOutput]  # requests that ended inside schedule() without running (deadline passed)
    preempted: list[str]  # request ids preempted this step (they wait to be recomputed)
    num_scheduled_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class AdapterSlots(Protocol):
    """What the scheduler asks of the LoRA adapter slots (serving.core.lora.LoRASlots) for requests with an adapter:
    whether its adapter is on the device (`ready`, which may start loading it), and a hold on its slot from admission
    (`pin`) until the request stops running (`release`: finished or preempted), so a slot in use is never reloaded."""

    def ready(self, request: Request) -> bool: ...
    def pin(self, request: Request) -> None: ...
    def release(self, request: Request) -> None: ...
    def check(self, running: Sequence[Request]) -> None: ...


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager | None = None,
                 adapters: AdapterSlots | None = None):
        self.config = config
        self.adapters = adapters  # LoRA adapter slots (None: requests never name an adapter)
        self.block_manager = block_manager or BlockManager(
            config.num_pages, config.page_size, enable_prefix_caching=config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}  # every unfinished request (each sample of an n > 1 request)
        self.groups: dict[str, SampleGroup] = {}  # n > 1 requests with an unfinished sample, by request id
        self.kv_holders: list = []  # pages held for KV transfers (serving.core.kv_transfer): in the invariants
        self.waiting: list[Request] = []  # sorted by _waiting_key
        self.running: list[Request] = []  # sorted by _running_key; the tail is the next preemption victim
        self.num_waiting_tokens = 0
        self._deadlines: list[tuple[float, int, Request]] = []  # heap; finished entries are skipped lazily
        self._order = itertools.count()
        # counters (Prometheus): prefix cache in tokens, as vLLM reports them
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0
        # state of the step being scheduled
        self._num_steps = 0  # schedule() calls
        self._step: dict[str, ScheduledSequence] = {}
        self._budget = 0
        self._preempted: dict[str, None] = {}  # ordered set

    # ---- ordering ------------------------------------------------------------------------------------------
    def _waiting_key(self, r: Request) -> tuple[float, int]:
        # Ageing: class c is served as if it arrived c * ageing later, so a batch request waits at most that long
        # behind interactive work, and the order never changes while requests wait (a sorted list suffices).
        return (r.metrics.arrival_time + r.priority * self.config.priority_ageing_s, r.order)

    @staticmethod
    def _running_key(r: Request) -> tuple[int, float, int]:
        return (r.priority, r.metrics.arrival_time, r.order)

    # ---- admission and cancellation ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queues a request, and the other samples of an n > 1 one. Raises ValueError (a request id in flight, a
        prompt too long) or QueueFullError (busy)."""
        cfg = self.config
        samples = request.samples
        for r in samples:
            if r.request_id in self.requests or r.request_id in self.groups:
                raise ValueError(f"request_id {r.request_id!r} is already in flight")
        n = request.num_prompt_tokens
        # The engine's make_request checked the request (serving.params.check_prompt); these keep the queue's
        # invariants for a Request made any other way.
        if n == 0:
            raise ValueError("prompt_token_ids must not be empty")
        check_prompt_length("prompt_token_ids", n, cfg.max_model_len)
        if request.priority < 0:
            raise ValueError(f"priority must be >= 0 (0 = interactive, 1 = batch), got {request.priority}")
        if request.adapter is not None and self.adapters is None:
            raise ValueError(f"adapter {request.adapter.name!r}: this engine serves no LoRA adapters")
        k = len(samples)
        if len(self.waiting) + k > cfg.max_waiting_requests:
            adds = f" and this request adds {k} samples" if k > 1 else ""
            raise QueueFullError(f"busy: {len(self.waiting)} requests are waiting{adds} (max_waiting_requests="
                                 f"{cfg.max_waiting_requests})")
        if self.num_waiting_tokens + k * n > cfg.max_waiting_tokens:
            raise QueueFullError(f"busy: {self.num_waiting_tokens} prompt tokens are waiting and this request "
                                 f"adds {k * n} (max_waiting_tokens={cfg.max_waiting_tokens})")
        max_tokens = request.sampling_params.max_tokens
        max_num_tokens = cfg.max_model_len if max_tokens is None else min(n + max_tokens, cfg.max_model_len)
        for r in samples:
            r.max_num_tokens = max_num_tokens
            r.order = next(self._order)
            r.status = RequestStatus.WAITING
            self.requests[r.request_id] = r
            self._enqueue(r)
            if r.deadline is not None:
                heapq.heappush(self._deadlines, (r.deadline, r.order, r))
        if request.group is not None:
            self.groups[request.request_id] = request.group
            request.group.prompt_ready = self._shared_pages(request) == 0  # nothing to share: all start at once

    def abort(self, request_id: str, now: float | None = None) -> RequestOutput | None:
        """Ends the request (every sample of an n > 1 one: `finish_group`) and returns the first final output, or None
        if it is unknown or already finished."""
        outputs = self.finish_group(request_id, FinishReason.ABORT, now=now)
        return outputs[0] if outputs else None

    def finish_group(self, request_id: str, reason: FinishReason, *, stop_reason: int | str | None = None,
                     now: float | None = None) -> list[RequestOutput]:
        """finish_request for every unfinished sample of the request `request_id` belongs to (the request's id, or
        any of its samples'): an abort, deadline or failure ends all n samples. Returns their final outputs."""
        group = self.groups.get(request_id)
        if group is None and request_id in self.requests:
            group = self.requests[request_id].group
        ids = [request_id] if group is None else [r.request_id for r in group.samples if not r.is_finished]
        outputs = [self.finish_request(rid, reason, stop_reason=stop_reason, now=now) for rid in ids]
        return [o for o in outputs if o is not None]

    def finish_request(self, request_id: str, reason: FinishReason, *, stop_reason: int | str | None = None,
                       now: float | None = None) -> RequestOutput | None:
        """Ends a request at once and frees its pages (abort, a stop string seen by the detokenizer, an error).

        Returns its final output, or None if it is unknown or already finished. Tokens of an in-flight step
        that update() later reports for it are dropped.
        """
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, reason, time.monotonic() if now is None else now, stop_reason=stop_reason)
        return RequestOutput(request_id, [], True, reason, stop_reason, request)

    def truncate_computed(self, request_id: str, num_computed_tokens: int) -> int:
        """Rolls a running request's K/V back (rejected speculative tokens); frees pages no longer needed.

        Returns the new num_computed_tokens (it can be lower than asked when a shared cached block is cut).
        """
        request = self.requests[request_id]
        if request.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {request_id!r} is not running")
        return self.block_manager.truncate(request, num_computed_tokens)

    # ---- the step ------------------------------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Chooses this step's sequences. Call update() with the step's sampled tokens before the next call, or,
        to look one step ahead, after it: a request whose token from the previous step is still pending then
        decodes on a PLACEHOLDER_TOKEN (the engine feeds that token from the device), unless that token surely
        ends it by length. A token that ends it otherwise (a stop token) makes update() drop the next one."""
        now = time.monotonic() if now is None else now
        cfg = self.config
        ps = cfg.page_size
        self._num_steps += 1
        finished = self._expire_deadlines(now)
        self._step, self._budget, self._preempted = {}, cfg.max_num_batched_tokens, {}
        step, running = self._step, self.running

        # 1. Running decodes, in rank order; a missing page preempts from the tail (lowest priority, newest).
        prefills: list[Request] = []
        slides = self.block_manager.slides  # sliding-window pages die as requests advance (hybrid KV cache)
        is_loading = self.block_manager.is_loading
        i = 0
        while i < len(running):
            r = running[i]
            if is_loading(r):  # its prefix-cache hit is still coming from the host tier: it waits, others step
                i += 1
                continue
            pos, n = r.num_computed_tokens, len(r.token_ids)
            if r.rope_original and not r.rope_long and pos >= r.rope_original and pos + 1 == n + r.num_pending:
                # Longrope: this decode would take the sequence past the original context. HF then recomputes it
                # all with the long factors; so do we: by preemption, once its last token is known
                if not r.num_pending:
                    self._preempt(r)  # (running[i] is now the next request)
                else:
                    i += 1
                continue
            if r.num_pending:  # its next input is the token of the step in flight
                if r.num_pending > 1 or n + 1 >= r.max_num_tokens:
                    i += 1  # that token ends it by length (or it is already a step ahead)
                    continue
                token = PLACEHOLDER_TOKEN
            elif pos + 1 != n:
                prefills.append(r)
                i += 1
                continue
            else:
                token = r.token_ids[-1]
            if slides:
                self.block_manager.slide(r, pos)
            if pos >= len(r.block_table) * ps and not self._allocate_or_preempt(r, pos + 1):
                continue  # r itself was preempted; running[i] is now the next request
            step[r.request_id] = ScheduledSequence(r, [token], pos, r.block_table, True)
            r.num_computed_tokens = pos + 1
            r.num_pending += 1
            i += 1
        self._budget -= len(step)  # victims come from the unvisited tail, so none of these was refunded

        # 2. Running prefills (chunked), in rank order.
        for r in prefills:
            if self._budget <= 0:
                break
            if r.status is RequestStatus.RUNNING:
                self._schedule_running_prefill(r)

        # 3. Admissions from the waiting queue.
        long_in_prefill = sum(1 for r in prefills if r.status is RequestStatus.RUNNING
                              and len(r.token_ids) > cfg.long_prompt_threshold)
        i = 0
        while i < len(self.waiting) and self._budget > 0 and len(running) < cfg.max_num_seqs:
            r = self.waiting[i]
            is_long = len(r.token_ids) > cfg.long_prompt_threshold
            if (is_long and long_in_prefill >= cfg.max_long_prefills or r.request_id in self._preempted
                    or r.group is not None and not self._may_admit(r)
                    or r.adapter is not None and not self.adapters.ready(r)):
                # the long lane is full (shorter requests behind may still go), it was just preempted, it is a
                # sample waiting for sample 0 to schedule the prompt, or its LoRA adapter is not on the device yet
                i += 1
                continue
            if not self._admit(r, now):
                if not running and self._drop_holds():
                    continue  # only n > 1 requests' held prompt pages were in the way
                break  # not enough pages: later requests wait too, so big requests are not starved
            long_in_prefill += is_long
            # r left the queue; requests preempted for it may have entered before its place
            i = bisect.bisect_left(self.waiting, self._waiting_key(r), key=self._waiting_key)
        scheduled = list(step.values())
        self._step = {}
        return SchedulerOutput(scheduled, finished, list(self._preempted),
                               cfg.max_num_batched_tokens - self._budget)

    def update(self, output: SchedulerOutput, sampled_token_ids: Sequence | np.ndarray,
               now: float | None = None) -> list[RequestOutput]:
        """Applies one step's results. `sampled_token_ids[i]` belongs to `output.scheduled[i]`: a token id, or a
        list of them (speculative decoding); entries of sequences with `sample=False` are ignored.

        Returns an output for every sequence that sampled (new tokens, and whether and why it finished).
        """
        now = time.monotonic() if now is None else now
        if isinstance(sampled_token_ids, np.ndarray):
            sampled_token_ids = sampled_token_ids.tolist()
        if len(sampled_token_ids) != len(output.scheduled):
            raise ValueError(f"{len(sampled_token_ids)} sampled entries for {len(output.scheduled)} sequences")
        bm, ps = self.block_manager, self.config.page_size
        running_status = RequestStatus.RUNNING
        outputs: list[RequestOutput] = []
        any_finished = False
        for seq, tokens in zip(output.scheduled, sampled_token_ids):
            r = seq.request
            if r.status is not running_status:
                continue  # finished (aborted, stop string) while the step ran
            # K/V written now: up to this step's end (a look-ahead step on this step's token is still running).
            computed = r.num_computed_tokens if r.num_pending < 2 else len(r.token_ids)
            if computed // ps > len(r.block_prefix_ids):
                bm.cache_full_blocks(r, computed)
            if not seq.sample:
                continue
            r.num_pending -= 1
            if type(tokens) is int:
                tokens = (tokens,)
            m, token_ids, stops = r.metrics, r.token_ids, r.stop_token_ids
            if m.first_token_time is None:
                m.first_token_time = now
            reason = stop_reason = None
            new = []
            for t in tokens:
                token_ids.append(t)
                m.token_times.append(now)
                new.append(t)
                if t in stops and len(token_ids) - r.num_prompt_tokens >= r.sampling_params.min_tokens:
                    reason, stop_reason = FinishReason.STOP, t
                    break
                if len(token_ids) >= r.max_num_tokens:
                    reason = FinishReason.LENGTH
                    break
            if reason is not None:
                self._finish(r, reason, now, stop_reason=stop_reason, remove_from_running=False)
                any_finished = True
            outputs.append(RequestOutput(r.request_id, new, reason is not None, reason, stop_reason, r))
        if any_finished:
            self.running = [r for r in self.running if r.status is running_status]
        return outputs

    # ---- helpers -------------------------------------------------------------------------------------------
    def _enqueue(self, r: Request) -> None:
        bisect.insort(self.waiting, r, key=self._waiting_key)
        self.num_waiting_tokens += len(r.token_ids)

    def _dequeue(self, r: Request) -> None:
        self.waiting.remove(r)
        self.num_waiting_tokens -= len(r.token_ids)

    def _finish(self, r: Request, reason: FinishReason, now: float, *, stop_reason=None,
                remove_from_running: bool = True) -> None:
        if r.status is RequestStatus.WAITING:
            self._dequeue(r)
        elif r.status is RequestStatus.RUNNING:
            self.block_manager.free(r)
            if r.adapter is not None:
                self.adapters.release(r)
            if remove_from_running:
                self.running.remove(r)
            self._step.pop(r.request_id, None)
        r.status = RequestStatus.FINISHED
        r.num_pending = 0
        r.grammar = None  # structured outputs: its matcher goes with its pages
        r.finish_reason, r.stop_reason = reason, stop_reason
        r.metrics.finished_time = now
        del self.requests[r.request_id]
        group = r.group
        if group is not None:
            self._settle_hold(group)
            if group.is_finished:
                del self.groups[group.request_id]

    def _expire_deadlines(self, now: float) -> list[RequestOutput]:
        out = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, r = heapq.heappop(heap)
            if r.status is not RequestStatus.FINISHED:
                self._finish(r, FinishReason.TIMEOUT, now)
                out.append(RequestOutput(r.request_id, [], True, FinishReason.TIMEOUT, None, r))
        return out

    def _preempt(self, victim: Request) -> None:
        """Preemption by recompute: free everything, queue again (its arrival keeps it near the front)."""
        seq = self._step.pop(victim.request_id, None)
        if seq is not None:
            self._budget += len(seq.token_ids)
            group = victim.group
            if group is not None and group.hold_step == self._num_steps:
                # its chunk of this step was to compute the pages the group forked this step: they stay uncomputed
                if group.block_table:
                    self.block_manager.free(group)
                group.prompt_ready = False
        self.block_manager.free(victim)
        if victim.adapter is not None:
            self.adapters.release(victim)
        if self.running and self.running[-1] is victim:
            self.running.pop()
        else:
            self.running.remove(victim)
        victim.status = RequestStatus.WAITING
        victim.num_pending = 0  # a token still on the device for it is dropped; recompute samples it again
        victim.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted[victim.request_id] = None
        self._enqueue(victim)

    def _allocate_or_preempt(self, r: Request, num_tokens: int) -> bool:
        """Pages for a running request, preempting from the tail; False if `r` itself had to go."""
        while not self.block_manager.allocate(r, num_tokens):
            victim = self.running[-1]
            if victim is r and self._drop_holds():
                continue
            self._preempt(victim)
            if victim is r:
                return False
        return True

    def _schedule_running_prefill(self, r: Request) -> None:
        bm, ps = self.block_manager, self.config.page_size
        start = r.num_computed_tokens
        chunk = min(len(r.token_ids) - start, self._budget, self.config.prefill_chunk)
        if chunk <= 0:
            return  # its last step was never update()d (the engine must finish_request it); nothing to feed
        if bm.slides:
            bm.slide(r, start)
        while not bm.allocate(r, start + chunk):
            room = (len(r.block_table) + bm.num_growable_blocks) * ps - start
            if room > 0:  # a smaller chunk fits in the pages there are
                chunk = min(chunk, room)
                continue
            if self.running[-1] is r:
                if self._drop_holds():
                    continue
                return  # nothing ranks below it; it keeps its pages and waits (higher ranks may preempt it)
            self._preempt(self.running[-1])
        end = start + chunk
        self._step[r.request_id] = ScheduledSequence(r, r.token_ids[start:end], start, r.block_table,
                                                     end == len(r.token_ids))
        r.num_computed_tokens = end
        r.num_pending += end == len(r.token_ids)
        self._budget -= chunk
        if r.group is not None:
            self._after_group_chunk(r)

    def _admit(self, r: Request, now: float) -> bool:
        """Moves a waiting request to running with its first chunk; False if its pages cannot be found. A sample of
        an n > 1 request forks the prompt's full pages from its group (or a running sample) when it can."""
        cfg, bm, ps = self.config, self.block_manager, self.config.page_size
        n = len(r.token_ids)
        if r.rope_original:  # longrope: the factor set of its whole K/V, as HF picks it for the sequence's length
            r.rope_long = n > r.rope_original
        # (a sample recomputed past a longrope original context shares no page with its group's short prompt)
        donor = (self._prompt_donor(r) if r.group is not None
                 and r.rope_long == (r.num_prompt_tokens > r.rope_original > 0) else None)
        if donor is None:
            # at least one token is computed
            pages, prefix_ids = bm.match_prefix(r.token_ids, (n - 1) // ps, prefix_root(r))
        else:
            pages, prefix_ids = donor.block_table[:self._shared_pages(r)], []
        cached = len(pages) * ps
        chunk = min(n - cached, self._budget, cfg.prefill_chunk)
        short = bm.shortfall(pages, cached + chunk)
        if max(short) > 0 and not self._preempt_for_admission(r, pages, short):
            return False
        self._dequeue(r)
        if r.adapter is not None:
            self.adapters.pin(r)
        m = r.metrics
        if donor is None:
            bm.acquire_cached(r, pages, prefix_ids)
            self.prefix_cache_queries += n
            self.prefix_cache_hits += cached
        else:
            bm.fork(r, donor, len(pages))
        if bm.is_loading(r):
            # Its hit (or the prompt pages it forked) is still coming from the host tier: r runs from the step after
            # those pages land (no chunk now)
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
                m.num_cached_prompt_tokens = min(cached, r.num_prompt_tokens)
            r.status = RequestStatus.RUNNING
            bisect.insort(self.running, r, key=self._running_key)
            r.num_pending = 0
            if r.group is not None:
                self._after_group_chunk(r)
            return True
        ok = bm.allocate(r, cached + chunk)
        assert ok, "pages vanished between the check and the allocation"
        if m.first_scheduled_time is None:
            m.first_scheduled_time = now
            m.num_cached_prompt_tokens = min(cached, r.num_prompt_tokens)
        r.status = RequestStatus.RUNNING
        bisect.insort(self.running, r, key=self._running_key)
        end = cached + chunk
        self._step[r.request_id] = ScheduledSequence(r, r.token_ids[cached:end], cached, r.block_table, end == n)
        r.num_computed_tokens = end
        r.num_pending = int(end == n)
        self._budget -= chunk
        if r.group is not None:
            self._after_group_chunk(r)
        return True

    # ---- the samples of n > 1 requests ---------------------------------------------------------------------
    def _shared_pages(self, r: Request) -> int:
        """The prompt's pages its samples share: its full pages but the one holding the last prompt token, whose
        logits each sample computes (so each recomputes 1..page_size tokens)."""
        return (r.num_prompt_tokens - 1) // self.config.page_size

    def _may_admit(self, r: Request) -> bool:
        """Samples 1.. wait until sample 0 (the first unfinished sample, should it end first) has scheduled the
        prompt's full pages in an earlier step (so their K/V is written before a sample's first step runs)."""
        group = r.group
        if group.prompt_ready:
            return group.hold_step != self._num_steps
        return r is next(s for s in group.samples if not s.is_finished)

    @staticmethod
    def _awaits_admission(group: SampleGroup) -> bool:
        return any(r.status is RequestStatus.WAITING and r.metrics.first_scheduled_time is None
                   for r in group.samples)

    def _prompt_donor(self, r: Request) -> Request | SampleGroup | None:
        """Who shares the prompt's full pages with sample `r`: the group's fork, else a running sample whose K/V for
        them an earlier step computed; None when neither can (then the prefix cache, or recompute)."""
        group, full = r.group, self._shared_pages(r)
        if not full:
            return None
        if group.block_table and group.hold_step != self._num_steps:
            return group
        for other in group.samples:
            if other is not r and other.status is RequestStatus.RUNNING and self.block_manager.can_fork(other, full):
                seq = self._step.get(other.request_id)
                if (other.num_computed_tokens if seq is None else seq.start) >= full * self.config.page_size:
                    return other
        return None

    def _after_group_chunk(self, r: Request) -> None:
        """After a sample's prefill chunk is scheduled: the first time the prompt's full pages are, the other samples
        may follow from the next step on, and the group forks those pages while one of them awaits admission."""
        group, full = r.group, self._shared_pages(r)
        if not group.prompt_ready and r.num_computed_tokens >= full * self.config.page_size:
            group.prompt_ready = True
            if self._awaits_admission(group):
                self.block_manager.fork(group, r, full)
                group.hold_step = self._num_steps
        self._settle_hold(group)

    def _settle_hold(self, group: SampleGroup) -> None:
        """Releases the group's fork once no sample awaits its first admission."""
        if group.block_table and not self._awaits_admission(group):
            self.block_manager.free(group)

    def _drop_holds(self) -> bool:
        """The last resort when pages run out: releases every group's fork (samples not admitted yet then compute the
        prompt themselves). True if one was held."""
        held = [g for g in self.groups.values() if g.block_table]
        for group in held:
            self.block_manager.free(group)
        return bool(held)

    def _preempt_for_admission(self, r: Request, pages: list[int], short: list[int]) -> bool:
        """Preempts running requests of a lower class than `r` if that frees enough pages for it (`short`: the
        pages missing per page pool, `BlockManager.shortfall`)."""
        if not self.config.preempt_for_priority:
            return False
        bm = self.block_manager
        victims = []
        short = list(short)
        hit = set(pages)
        for v in reversed(self.running):
            if v.priority <= r.priority or max(short) <= 0:
                break
            victims.append(v)
            short = [s - n for s, n in zip(short, bm.released_by(v, hit))]
        if max(short) > 0:
            return False
        for v in victims:
            self._preempt(v)
        return True

    # ---- introspection -------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict[str, float]:
        return dict(num_waiting=len(self.waiting), num_running=len(self.running),
                    num_waiting_tokens=self.num_waiting_tokens, kv_cache_usage=self.block_manager.usage,
                    prefix_cache_queries=self.prefix_cache_queries, prefix_cache_hits=self.prefix_cache_hits,
                    num_preemptions=self.num_preemptions)

    def check_invariants(self) -> None:
        """Raises AssertionError if any book disagrees (tests call this after every step)."""
        live = list(self.requests.values())
        assert all(r.status is RequestStatus.RUNNING for r in self.running)
        assert all(r.status is RequestStatus.WAITING for r in self.waiting)
        assert len(self.running) + len(self.waiting) == len(live), "a live request is neither waiting nor running"
        assert all(not r.block_table for r in self.waiting), "a waiting request holds pages"
        assert all(r.num_pending == 0 for r in self.waiting), "a waiting request expects a token"
        assert all(0 <= r.num_pending <= 2 for r in self.running), "a request more than one step ahead"
        assert self.num_waiting_tokens == sum(len(r.token_ids) for r in self.waiting)
        assert self.running == sorted(self.running, key=self._running_key)
        assert self.waiting == sorted(self.waiting, key=self._waiting_key)
        assert all(not g.is_finished for g in self.groups.values()), "a finished n > 1 request is still listed"
        assert all(not g.block_table or self._awaits_admission(g) for g in self.groups.values()), \
            "a group holds its prompt's pages with no sample awaiting them"
        self.block_manager.check_invariants(self.running + [g for g in self.groups.values() if g.block_table]
                                            + self.kv_holders)
        if self.adapters is not None:
            self.adapters.check(self.running)
