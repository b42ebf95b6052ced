"""Kernels: ragged paged attention and the KV-cache write behind one entry point with a backend per platform, over a
cache in the model's dtype or quantized (`kv_quant`), a latent (MLA) cache too (docs/attention.md), and the native
CPU kernels with the model's matmul (`native`, `matmul`: docs/native-kernels.md)."""
from pallas_kernels.attention import (attention_backend, kv_storage_dtype, ragged_paged_attention,
                                     ragged_paged_latent_attention, write_kv, write_latent)
from pallas_kernels.kv_quant import KV_CACHE_DTYPES, QuantizedKV
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.reference import ragged_paged_attention_reference

__all__ = ["AttentionMetadata", "KV_CACHE_DTYPES", "QuantizedKV", "attention_backend", "kv_storage_dtype",
           "ragged_paged_attention", "ragged_paged_attention_reference", "ragged_paged_latent_attention", "write_kv",
           "write_latent"]
