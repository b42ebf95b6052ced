"""Serving core, host side: sampling parameters, request state, KV block manager + prefix cache, scheduler.

Pure Python/NumPy (no JAX): the engine step (serving.core.engine) turns a SchedulerOutput into a device batch
and hands the sampled tokens back to Scheduler.update.
"""
from serving.core.batch import BatchBuilder, SeqChunk, build_batch, build_layout
from serving.core.block_manager import BlockManager
from serving.core.request import FinishReason, Priority, Request, RequestMetrics, RequestStatus
from serving.core.sampling_params import MAX_LOGPROBS, SamplingParams
from serving.core.scheduler import (PromptTooLongError, QueueFullError, RequestOutput, ScheduledSequence,
                                    Scheduler, SchedulerConfig, SchedulerOutput)

__all__ = [
    "BatchBuilder", "BlockManager", "SeqChunk", "FinishReason", "MAX_LOGPROBS", "Priority", "PromptTooLongError",
    "QueueFullError", "Request", "RequestMetrics", "RequestOutput", "RequestStatus", "SamplingParams",
    "ScheduledSequence", "Scheduler", "SchedulerConfig", "SchedulerOutput", "build_batch", "build_layout",
]
