"""The platform the program being traced is for (`target_platform`): JAX's default backend, or the one a
`tracing_for(platform)` block names, so a program lowered for GPU/TPU from a CPU host takes their paths, never a
CPU-only one (native FFI kernels, uint16 KV storage)."""
from __future__ import annotations

import contextlib
import contextvars

import jax

PLATFORMS = ("cpu", "gpu", "tpu")
_ALIASES = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("meshserve_target_platform", default=None)


def canonical_platform(name: str | None = None) -> str:
    """'cpu', 'gpu' or 'tpu' for a JAX platform or backend name (cuda and rocm are 'gpu'); None: JAX's default
    backend (returned as it is if it is none of those). Raises ValueError naming the platforms for any other name."""
    if name is None:
        return _ALIASES.get(jax.default_backend(), jax.default_backend())
    name = name.strip().lower()
    if name not in _ALIASES:
        raise ValueError(f"unknown platform {name!r}: expected one of {', '.join(sorted(_ALIASES))}")
    return _ALIASES[name]


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
