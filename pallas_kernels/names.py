"""The names of what the kernels take, free of JAX so that flag definitions (`serving.core.config`: `--help`) can
list them without importing it: the platforms, the float dtypes, the KV-cache storage formats and the weight
quantizations. Their arrays and checks live beside the kernels (`target`, `kv_quant`, `models.quant`)."""
from __future__ import annotations

PLATFORMS = ("cpu", "gpu", "tpu")
PLATFORM_ALIASES = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}
FLOAT_DTYPES = ("float32", "bfloat16", "float16")  # the model and activation dtypes served
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")  # "auto": the model's dtype, unquantized
WEIGHT_QUANTIZATIONS = ("int8", "fp8")


def canonical_platform(name: str | None = None) -> str:
    """'cpu', 'gpu' or 'tpu' for a JAX platform or backend name (cuda and rocm are 'gpu'); None: JAX's default
    backend (returned as it is if it is none of those). Raises ValueError naming the platforms for any other name."""
    if name is None:
        import jax
        return PLATFORM_ALIASES.get(jax.default_backend(), jax.default_backend())
    name = name.strip().lower()
    if name not in PLATFORM_ALIASES:
        raise ValueError(f"unknown platform {name!r}: expected one of {', '.join(sorted(PLATFORM_ALIASES))}")
    return PLATFORM_ALIASES[name]


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """`kv_cache_dtype` if it is one of KV_CACHE_DTYPES, else ValueError naming them."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    return kv_cache_dtype

# int8 LoRA adapter stacks (EngineConfig.lora_dtype, pallas_kernels/lora.py) hold ranks in blocks of this many rows,
# and B in strips of this many columns (native/lora.h kLoraI8Block, kLoraI8Strip).
LORA_INT8_RANK_ROWS = 32
LORA_INT8_STRIP = 64
# bfloat16 LoRA stacks on the native CPU kernel (pallas_kernels/lora.py `to_layout`): A in blocks of this many rank
# rows and chunks of this many columns, B in strips of this many columns (native/lora.h kLoraABlock, kLoraAChunk,
# kLoraStrip).
LORA_LAYOUTS = ("rows", "pairs", "blocks", "strips")  # a stack's forms; the index: the kernel's code (api.h LoraLayout)
LORA_BLOCK_ROWS = 4
LORA_BLOCK_COLUMNS = 32
LORA_STRIP = 64
