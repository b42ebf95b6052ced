"""`platform_choices`: every path the engine takes because of the platform it runs on (attention backend, KV storage
dtype, token buckets, native CPU kernels and the greedy head screen, compilation cache, donation), decided in one
function of the platform, so 'cpu', 'gpu' and 'tpu' can each be checked from any host."""
from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from pallas_kernels import native
from pallas_kernels.attention import attention_backend
from pallas_kernels.reference import kv_storage_dtype
from pallas_kernels.names import FLOAT_DTYPES
from pallas_kernels.target import canonical_platform, tracing_for

COMPILATION_CACHE_ENV = "MESHSERVE_COMPILATION_CACHE"
DTYPES = {name: getattr(jnp, name) for name in FLOAT_DTYPES}  # the scalar types


@dataclasses.dataclass(frozen=True)
class PlatformChoices:
    platform: str  # 'cpu' | 'gpu' | 'tpu'
    # Attention: 'native' (C++ kernels on CPU), 'cpu' (XLA on CPU), 'gpu' (Triton), 'tpu' (Mosaic), 'reference'
    attention_backend: str
    kv_storage_dtype: str  # what the KV cache's pages hold (uint16 bits for 16-bit floats on XLA:CPU only)
    min_token_bucket: int
    token_buckets: tuple[int, ...]  # the compiled step heights, smallest to largest
    native_kernels: bool  # weights packed for the native CPU kernels, which run the small matmuls
    greedy_head_screen: bool  # greedy steps of few sequences take the LM head's int8 screen (native kernels only)
    compilation_cache_dir: str | None  # JAX's persistent compilation cache (None: off)
    donate_kv_cache: bool  # the step programs update the KV caches in place (donated buffers)


def min_token_bucket(platform: str, dtype: str, native_kernels: bool) -> int:
    """The smallest step height worth compiling. CPU: a float32 step costs about its weights' read at any height,
    so a lone decode runs as 1 row; XLA:CPU's bf16 matmuls fall off below ~8 rows unless the native kernels run
    them. GPU: 8 rows (an MMA tile's side). TPU: a sublane tile, 8 rows of float32 or 16 of a 16-bit dtype."""
    dt = jnp.dtype(DTYPES[dtype])
    if platform == "cpu":
        return 1 if dt.itemsize == 4 or (dt == jnp.bfloat16 and native_kernels) else 8
    if platform == "tpu":
        return 8 if dt.itemsize == 4 else 16
    return 8


def bucket_ladder(smallest: int, largest: int, platform: str) -> tuple[int, ...]:
    """Heights doubling from `smallest` up to `largest` (which the scheduler's token budget never exceeds); on an
    accelerator the last is rounded up to a multiple of the smallest, so every program's rows fill whole tiles."""
    if platform != "cpu":
        largest = -(-largest // smallest) * smallest
    out, t = [], min(smallest, largest)
    while t < largest:
        out.append(t)
        t *= 2
    return tuple(out + [largest])


def default_compilation_cache_dir(platform: str) -> str:
    """$MESHSERVE_COMPILATION_CACHE, else ~/.cache/meshserve/xla/<platform> (one directory per platform: a home
    directory shared by CPU and accelerator hosts keeps their programs apart)."""
    return os.environ.get(COMPILATION_CACHE_ENV,
                          os.path.join(os.path.expanduser("~"), ".cache", "meshserve", "xla", platform))


def platform_choices(platform: str | None = None, *, dtype: str = "float32", max_num_batched_tokens: int = 512,
                     min_bucket: int = 0, greedy_head_screen: bool = True, compilation_cache_dir: str | None = None,
                     num_devices: int = 1, num_processes: int = 1) -> PlatformChoices:
    """The engine's platform-dependent choices for `platform` ('cpu', 'gpu'/'cuda'/'rocm', 'tpu'; None: JAX's
    default backend), whatever this host is. `min_bucket` > 0 overrides the smallest token bucket;
    `compilation_cache_dir` "" (or "off") turns the cache off, None takes the default; the native CPU kernels
    (and with them the greedy head screen) run only for one CPU device in one process, where they build and the
    CPU runs one of their paths."""
    platform = canonical_platform(platform)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    with tracing_for(platform):
        native_on = platform == "cpu" and native.enabled()
        backend = attention_backend(platform)
    native_matmuls = native_on and num_devices == 1 and num_processes == 1
    if backend == "cpu" and native_on and jnp.dtype(DTYPES[dtype]) in native.PANELS:
        backend = "native"
    smallest = min_bucket or min_token_bucket(platform, dtype, native_on)
    cache = default_compilation_cache_dir(platform) if compilation_cache_dir is None else compilation_cache_dir
    if cache.lower() in ("", "off", "none", "0"):
        cache = None
    return PlatformChoices(
        platform=platform, attention_backend=backend,
        kv_storage_dtype=jnp.dtype(kv_storage_dtype(DTYPES[dtype], "cpu" if backend == "native" else backend)).name,
        min_token_bucket=smallest, token_buckets=bucket_ladder(smallest, max_num_batched_tokens, platform),
        native_kernels=native_matmuls, greedy_head_screen=greedy_head_screen and native_matmuls,
        compilation_cache_dir=cache, donate_kv_cache=True)


def cpu_only_pieces(program_text: str) -> list[str]:
    """What in a lowered program's text (StableHLO) belongs on CPU only: a native CPU kernel's FFI target, or a
    uint16 array (the XLA:CPU storage of 16-bit float KV caches). Empty for a program fit for GPU/TPU."""
    found = [f"native CPU kernel {name}" for name in native.FFI_TARGETS if name in program_text]
    if "xui16>" in program_text or "<ui16>" in program_text:
        found.append("uint16 arrays (XLA:CPU's KV storage)")
    return found
