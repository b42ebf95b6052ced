"""The entry points models call, `ragged_paged_attention` and `write_kv` (with `attention_backend`, `kv_storage_dtype`;
for a multi-head latent attention cache `ragged_paged_latent_attention` and `write_latent`),
dispatched at trace time to the platform's backend: native C++ or pure JAX on cpu, Triton on gpu, Mosaic on tpu;
MESHSERVE_ATTENTION forces one. Every backend takes a cache of the model's dtype or a quantized one (`kv_quant`).
Details: docs/attention.md."""
from __future__ import annotations

import os

from pallas_kernels import cpu, mla, native, reference
from pallas_kernels.target import target_platform

BACKENDS = ("reference", "cpu", "gpu", "tpu")
ENV_VAR = "MESHSERVE_ATTENTION"


def attention_backend(platform: str | None = None) -> str:
    """Trace-time. The backend the next trace will use: the platform's own (`platform`, else the one being traced
    for: `pallas_kernels.target`), unless MESHSERVE_ATTENTION forces one."""
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced and forced != "auto":
        if forced not in BACKENDS:
            raise ValueError(f"{ENV_VAR}={forced!r}; expected one of {BACKENDS} or 'auto'")
        return forced
    platform = platform or target_platform()
    return platform if platform in ("cpu", "gpu", "tpu") else "reference"


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                           sliding_window=None, logit_soft_cap=None, sinks=None):
    """Pure. Causal attention of a ragged batch `q[T, Hq, D]` over paged KV -> `[T, Hq, D]`.

    Same contract as `reference.ragged_paged_attention_reference` (see `metadata.py` for the arrays); `kv_pages` is
    an array or a `kv_quant.QuantizedKV`, dequantised inside the kernel. `sinks[Hq]` (float32, GPT-OSS): each query
    head's sink logit in its softmax's denominator, on every backend.
    """
    backend = attention_backend()
    if backend == "cpu":
        fn = native.ragged_paged_attention if native.attention_supported(q, kv_pages) else cpu.ragged_paged_attention_cpu
    elif backend == "gpu":  # the accelerator backends load their Pallas lowering stacks only where they run
        from pallas_kernels.gpu import ragged_paged_attention_gpu as fn
    elif backend == "tpu":
        from pallas_kernels.tpu import ragged_paged_attention_tpu as fn
    else:
        fn = reference.ragged_paged_attention_reference
    extra = {} if sinks is None else {"sinks": sinks}
    return fn(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
              sliding_window=sliding_window, logit_soft_cap=logit_soft_cap, **extra)


def ragged_paged_latent_attention(q, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                                  value_dim):
    """Pure. Multi-head latent attention in its absorbed form: `q[T, H, D]` over one latent row per token (pages
    [P, page_size, 1, D], an array or a `kv_quant.QuantizedKV`) -> `[T, H, value_dim]`. Same contract as
    `mla.latent_attention_reference`; every head reads each row once."""
    backend = attention_backend()
    if backend == "cpu":
        if native.latent_attention_supported(q, latent_pages, value_dim):
            return native.latent_attention(q, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                           sm_scale=sm_scale, value_dim=value_dim)
        mla.check_latent_shapes(q, latent_pages, value_dim)
        return cpu.ragged_paged_attention_cpu(q, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                              sm_scale=sm_scale, value_dim=value_dim)
    if backend == "gpu":
        from pallas_kernels.mla_gpu import latent_attention_gpu as fn
    elif backend == "tpu":
        from pallas_kernels.mla_tpu import latent_attention_tpu as fn
    else:
        fn = mla.latent_attention_reference
    return fn(q, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale, value_dim=value_dim)


def unsupported_reason(backend: str, head_dim: int, page_size: int,
                       latent_dims: tuple[int, int] | None = None) -> str | None:
    """Static. Why `backend`'s kernel cannot take these shapes (None: it can), for a model loader to ask before it
    builds caches rather than meet a lowering error at the first jit. `latent_dims`: a latent cache's
    (kv_lora_rank, qk_rope_head_dim), whose kernel is asked instead."""
    if backend == "gpu" and latent_dims is not None:
        from pallas_kernels.mla_gpu import unsupported_reason as latent_reason
        return latent_reason(*latent_dims, page_size)
    if backend == "gpu":
        from pallas_kernels.gpu import unsupported_reason as gpu_reason
        return gpu_reason(head_dim, page_size)
    return None


def kv_storage_dtype(dtype, kv_cache_dtype: str = "auto"):
    """Trace-time. The dtype the next trace's backend stores the pages of a KV cache of logical `dtype` in, for
    `kv_cache_dtype` (`kv_quant.KV_CACHE_DTYPES`; see `reference.kv_storage_dtype`)."""
    return reference.kv_storage_dtype(dtype, attention_backend(), kv_cache_dtype)


def write_kv(kv_pages, k, v, slot_mapping):
    """Pure. Writes `k`/`v` `[T, Hkv, D]` into flat slots `slot_mapping[T]` (-1 = padding, dropped); a
    `QuantizedKV` gets each row quantised with its scale.

    In place when the cache is donated: XLA's scatter on cpu/gpu, an aliased DMA kernel on tpu.
    """
    if attention_backend() == "tpu":
        from pallas_kernels.tpu import write_kv_tpu
        return write_kv_tpu(kv_pages, k, v, slot_mapping)
    return reference.write_kv(kv_pages, k, v, slot_mapping)


def write_latent(latent_pages, rows, slot_mapping):
    """Pure. Writes each token's latent row `rows[T, 1, D]` (`mla.latent_rows`) into flat slots `slot_mapping[T]`
    (-1 = padding, dropped); a `QuantizedKV` gets each row quantised with its one scale. In place when donated, as
    `write_kv`."""
    if attention_backend() == "tpu":
        from pallas_kernels.tpu import write_rows_tpu
        return write_rows_tpu(latent_pages, rows, slot_mapping)
    return reference.write_rows(latent_pages, rows, slot_mapping)
