"""The JAX releases meshserve runs on (0.10 to 0.12) and the few places where they differ for it: each difference is a
function here, chosen by what the installed JAX has (never by version number where a feature test works), so the
rest of the code calls one API. `USED_API.txt` beside this file lists every experimental and private JAX name the
project uses (tests/test_jax_api.py keeps it exact): the one file to check against a new JAX's changelog."""
from __future__ import annotations

import functools
import warnings

# The releases read for this module (their changelogs and sources; CI runs the lowest, see BUILD.md).
TESTED_JAX = ("0.10.2", "0.11.2", "0.12.0.1")
# The GPU a Triton kernel is lowered for on a host that has none: what JAX 0.10 assumed itself (compute capability
# 9.0, the H100 / H200 generation).
AOT_GPU_COMPUTE_CAPABILITY = 90


@functools.cache
def allow_gpu_lowering_without_gpu() -> bool:
    """Lets Pallas lower Triton kernels on a host without a GPU (the lowering tests, `Engine.lower_programs`), for a
    compute capability 9.0 GPU. JAX 0.10 did so by itself; from 0.11 the Triton lowering asks the default device for
    its GPU model and raises "No supported GPU devices found" on a CPU host (an abstract GPU device set by
    `jax.sharding.use_abstract_mesh` answers it, but only for unsharded programs: a sharded one's avals carry the
    host's mesh). JAX reads a registry of device kinds before giving up: the host's kind goes in there, answering
    for an H100. Returns whether an entry was added. Idempotent; on a GPU host nothing changes."""
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:  # JAX 0.10: no GPU-model lookup (the fallback to 9.0 is built in)
        return False
    if getattr(gpu_info, "registry", None) is None or gpu_info.get_device_platform() == "gpu":
        return False
    kind = gpu_info.get_device_kind()
    info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    assert info.compute_capability == AOT_GPU_COMPUTE_CAPABILITY, info
    gpu_info.registry.setdefault(kind, lambda: info)
    return True


def jax_gpu_paged_attention(q, k_pages, v_pages, block_tables, lengths, *, k_splits: int, interpret: bool = False):
    """JAX's own Pallas (Triton) paged attention, the bandwidth baseline of `serving.bench accelerator`: q
    `[B, Hq, D]`, k/v pages `[Hkv, P, page_size, D]`. Its module is deprecated from JAX 0.11 (a DeprecationWarning
    at import, pointing at tokamax); silenced here, since it is only a point of comparison."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention
    return paged_attention.paged_attention(q, k_pages, v_pages, block_tables, lengths, k_splits=k_splits,
                                           interpret=interpret)
