"""`Request`: the host-side state of one generation request, from arrival to its finish reason, with its enums
(`Priority`, `RequestStatus`, `FinishReason`) and `RequestMetrics`. Details: docs/engine.md."""
from __future__ import annotations

import dataclasses
import enum
from typing import Sequence

from serving.core.sampling_params import SamplingParams, stop_token_set


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


class Request:
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "sampling_params", "priority", "deadline",
                 "eos_token_ids", "stop_token_ids", "status", "num_computed_tokens", "block_table",
                 "block_prefix_ids", "finish_reason", "stop_reason", "metrics", "max_num_tokens", "order",
                 "num_pending")

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                 *, arrival_time: float, priority: int = Priority.INTERACTIVE, deadline: float | None = None,
                 eos_token_ids: Sequence[int] = ()):
        self.request_id = request_id
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

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, "
                f"pages={len(self.block_table)})")
