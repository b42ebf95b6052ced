"""The serving core, free of gRPC and HTTP: the engine (step loop, model runner, outputs; data-parallel, pipelined,
speculative), scheduler, KV block manager + prefix cache, requests, sampling. Re-exports the host-side pieces here."""
from serving.core.batch import BatchBuilder, SeqChunk, build_batch, build_layout
from serving.core.block_manager import BlockManager
from serving.core.request import FinishReason, Priority, Request, RequestMetrics, RequestStatus
from serving.params import MAX_LOGPROBS, SamplingParams
from serving.core.scheduler import (PromptTooLongError, QueueFullError, RequestOutput, ScheduledSequence,
                                    Scheduler, SchedulerConfig, SchedulerOutput)

__all__ = [
    "BatchBuilder", "BlockManager", "SeqChunk", "FinishReason", "MAX_LOGPROBS", "Priority", "PromptTooLongError",
    "QueueFullError", "Request", "RequestMetrics", "RequestOutput", "RequestStatus", "SamplingParams",
    "ScheduledSequence", "Scheduler", "SchedulerConfig", "SchedulerOutput", "build_batch", "build_layout",
]
