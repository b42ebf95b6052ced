"""`Request`: the host-side state of one generation request, from arrival to its finish reason, with its enums
(`Priority`, `RequestStatus`, `FinishReason`), `RequestMetrics`, and the `SampleGroup` of an n > 1 request's samples
(`sample_seed`: each sample's seed). Details: docs/engine.md."""
from __future__ import annotations

import dataclasses
import enum
from typing import Sequence

from serving.params import SamplingParams, stop_token_set


class Priority(enum.IntEnum):
    """Priority classes; a lower value is served first (see SchedulerConfig.priority_ageing_s)."""
    INTERACTIVE = 0
    BATCH = 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and queued again
    RUNNING = "running"  # holds pages; scheduled every step while budget allows
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token, EOS or stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the client
    TIMEOUT = "timeout"  # deadline passed
    ERROR = "error"  # the engine failed on it


@dataclasses.dataclass(slots=True)
class RequestMetrics:
    """Timestamps (the scheduler's clock, seconds) and counters reported with a request's output."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)  # one per output token
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache at first admission


_MASK64 = (1 << 64) - 1


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample `index` of an n > 1 request: sample 0 keeps the request's seed (it draws what the same
    request with n = 1 draws); sample i > 0 gets splitmix64 of (seed, i), a 64-bit value that differs per sample and
    is the same run to run."""
    if seed is None or index == 0:
        return seed
    x = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class SampleGroup:
    """The samples of one n > 1 request: `samples[0]` is the Request the caller made (its id is the request's id),
    samples 1..n-1 are built with it (id `<request_id>#<i>`, seed `sample_seed(seed, i)`, n = 1 in their params).

    The scheduler admits samples 1.. once sample 0 has scheduled the prompt's full pages; from then until every
    sample has been admitted the group holds those pages too (a BlockManager fork: `block_table` and
    `block_prefix_ids` as a request's), so a sample finishing or being preempted early does not lose them."""
    __slots__ = ("request_id", "samples", "block_table", "block_prefix_ids", "num_computed_tokens", "prompt_ready",
                 "hold_step")

    def __init__(self, request_id: str, samples: list[Request]):
        self.request_id = request_id
        self.samples = samples
        self.block_table: list[int] = []  # the held prompt pages (empty: none held)
        self.block_prefix_ids: list[int] = []
        self.num_computed_tokens = 0
        self.prompt_ready = False  # the prompt's full pages were scheduled once: samples 1.. may be admitted
        self.hold_step = -1  # the scheduler step that took the hold

    @property
    def is_finished(self) -> bool:
        return all(r.status is RequestStatus.FINISHED for r in self.samples)

    def __repr__(self) -> str:
        return f"SampleGroup({self.request_id!r}, n={len(self.samples)}, held pages={len(self.block_table)})"


class Request:
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "sampling_params", "priority", "deadline",
                 "eos_token_ids", "stop_token_ids", "status", "num_computed_tokens", "block_table",
                 "block_prefix_ids", "finish_reason", "stop_reason", "metrics", "max_num_tokens", "order",
                 "num_pending", "sample_index", "group", "grammar", "cache_salt", "adapter", "lora_slot",
                 "rope_original", "rope_long")

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                 *, arrival_time: float, priority: int = Priority.INTERACTIVE, deadline: float | None = None,
                 eos_token_ids: Sequence[int] = (), cache_salt: str = ""):
        self.request_id = request_id
        # Prefix-cache entries are shared only between requests of one salt (the tenant, or the client's cache_salt):
        # cached_tokens must not tell one tenant whether another sent a prompt.
        self.cache_salt = cache_salt
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling_params = sampling_params
        self.priority = int(priority)
        self.deadline = deadline  # absolute time on the scheduler's clock; None = none
        self.eos_token_ids = tuple(eos_token_ids)
        self.stop_token_ids = stop_token_set(sampling_params, self.eos_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []  # page ids; replaced (never cleared in place) when freed
        self.block_prefix_ids: list[int] = []  # prefix-cache ids of this request's leading full blocks
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.max_num_tokens = 0  # prompt + output cap; set by the scheduler from max_tokens and the context
        self.order = 0  # admission sequence number; set by the scheduler, breaks arrival-time ties
        # Scheduled steps that sample a token for it and whose results update() has not applied yet (0-2: the
        # engine may schedule a decode on the token of a step still on the device, see Scheduler.schedule).
        self.num_pending = 0
        self.sample_index = 0  # which of the request's n samples this is
        self.group: SampleGroup | None = None  # the request's samples when n > 1
        self.grammar = None  # structured outputs: its GrammarState (serving.core.structured), set by the engine
        self.adapter = None  # its LoRA adapter (serving.core.lora.Adapter), set by the engine; None: the base model
        self.lora_slot = -1  # the device slot holding that adapter while it runs (serving.core.lora.LoRASlots)
        # Longrope (Phi-3): the original context (0: not longrope; set by the engine) and whether this request's
        # K/V is computed with the long factors, decided when it is admitted (`Scheduler`): a sequence longer
        # than the original context is, as HF computes it (the scheduler recomputes one that grows past it)
        self.rope_original = 0
        self.rope_long = False
        if sampling_params.n > 1:
            self.group = SampleGroup(request_id, [self])
            for i in range(1, sampling_params.n):
                sample = Request(f"{request_id}#{i}", prompt_token_ids, dataclasses.replace(
                    sampling_params, n=1, seed=sample_seed(sampling_params.seed, i)), arrival_time=arrival_time,
                    priority=priority, deadline=deadline, eos_token_ids=eos_token_ids, cache_salt=cache_salt)
                sample.sample_index, sample.group = i, self.group
                self.group.samples.append(sample)

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def parent_id(self) -> str:
        """The id the caller gave: this request's, or for a sample of an n > 1 request, sample 0's."""
        return self.request_id if self.group is None else self.group.request_id

    @property
    def samples(self) -> list[Request]:
        """Every sample of the request this one belongs to (itself alone when n = 1), sample 0 first."""
        return [self] if self.group is None else self.group.samples

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, "
                f"pages={len(self.block_table)})")
