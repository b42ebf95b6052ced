"""The platform the program being traced is for (`target_platform`): JAX's default backend, or the one a
`tracing_for(platform)` block names, so a program lowered for GPU/TPU from a CPU host takes their paths, never a
CPU-only one (native FFI kernels, uint16 KV storage)."""
from __future__ import annotations

import contextlib
import contextvars

from pallas_kernels.names import PLATFORMS, canonical_platform  # noqa: F401 - re-exported

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("meshserve_target_platform", default=None)


def lowering_platform(platform: str) -> str:
    """The name `Traced.lower(lowering_platforms=...)` takes for a platform ('gpu' -> 'cuda')."""
    return {"gpu": "cuda"}.get(canonical_platform(platform), canonical_platform(platform))


def target_platform() -> str:
    """Trace-time. The platform the program being traced will run on."""
    return _TARGET.get() or canonical_platform()


@contextlib.contextmanager
def tracing_for(platform: str | None):
    """Programs traced inside take `platform`'s paths (None: the default backend's)."""
    token = _TARGET.set(canonical_platform(platform) if platform else None)
    try:
        yield
    finally:
        _TARGET.reset(token)
