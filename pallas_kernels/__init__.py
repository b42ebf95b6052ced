"""Ragged paged attention and the KV-cache write: one entry point, a backend per platform.

`ragged_paged_attention` and `write_kv` are what models call; the backend is chosen at trace time from the
platform (pure-JAX fast path on cpu, Triton Pallas kernel on gpu, Mosaic Pallas kernel on tpu);
MESHSERVE_ATTENTION=reference|cpu|gpu|tpu forces one.
"""
from pallas_kernels.attention import attention_backend, kv_storage_dtype, ragged_paged_attention, write_kv
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.reference import ragged_paged_attention_reference

__all__ = ["AttentionMetadata", "attention_backend", "kv_storage_dtype", "ragged_paged_attention", "ragged_paged_attention_reference",
           "write_kv"]
