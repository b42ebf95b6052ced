"""Ragged paged attention and the KV-cache write: one entry point, a backend per platform.

`ragged_paged_attention` and `write_kv` are what models call; the backend is chosen from the platform the
arrays live on (reference pure JAX on CPU until the kernels land; MESHSERVE_ATTENTION=reference forces it).
"""
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.reference import ragged_paged_attention_reference, write_kv

ragged_paged_attention = ragged_paged_attention_reference

__all__ = ["AttentionMetadata", "ragged_paged_attention", "ragged_paged_attention_reference", "write_kv"]
