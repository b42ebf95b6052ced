"""Kernels: ragged paged attention and the KV-cache write behind one entry point with a backend per platform, over a
cache in the model's dtype or quantized (`kv_quant`), a latent (MLA) cache too (docs/attention.md), and the native
CPU kernels with the model's matmul (`native`, `matmul`: docs/native-kernels.md). The re-exports below are imported
on first use (PEP 562), so a JAX-free submodule (`names`: what flags list) imports without JAX."""
import importlib

_EXPORTS = {
    "pallas_kernels.attention": ("attention_backend", "kv_storage_dtype", "ragged_paged_attention",
                                 "ragged_paged_latent_attention", "write_kv", "write_latent"),
    "pallas_kernels.kv_quant": ("KV_CACHE_DTYPES", "QuantizedKV"),
    "pallas_kernels.metadata": ("AttentionMetadata",),
    "pallas_kernels.reference": ("ragged_paged_attention_reference",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:  # a submodule not imported yet (`pallas_kernels.native`) or a missing name
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
