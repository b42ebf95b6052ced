"""The serving core, free of gRPC and HTTP: the engine (step loop, model runner, outputs; data-parallel, pipelined,
speculative), scheduler, KV block manager + prefix cache, requests, sampling. Re-exports the host-side pieces here,
imported on first use (PEP 562), so importing `serving.core.config` (the flags) does not import JAX."""
import importlib

_EXPORTS = {
    "serving.core.batch": ("BatchBuilder", "SeqChunk", "build_batch", "build_layout"),
    "serving.core.block_manager": ("BlockManager",),
    "serving.core.request": ("FinishReason", "Priority", "Request", "RequestMetrics", "RequestStatus"),
    "serving.params": ("MAX_LOGPROBS", "SamplingParams"),
    "serving.core.scheduler": ("PromptTooLongError", "QueueFullError", "RequestOutput", "ScheduledSequence",
                               "Scheduler", "SchedulerConfig", "SchedulerOutput"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:  # a submodule (`from serving.core import sampling`) or a missing name
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
