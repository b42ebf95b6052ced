"""Compile-only checks from CPU: the GPU (Triton) and TPU (Mosaic) kernels must keep lowering.

A change that breaks either kernel's lowering fails here without an accelerator. This checks lowering to
the platform's MLIR (Pallas -> Triton / Mosaic), not the accelerator compiler that runs afterwards.
"""
import functools
import re

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels
from pallas_kernels import gpu, kv_quant, tpu
from pallas_kernels.kv_quant import QuantizedKV


def _abstract_args(*, t=32, s=4, hq=8, hkv=2, d=128, ps=16, max_pages=8, dtype=jnp.bfloat16, kv_values=None):
    """Abstract attention operands; `kv_values`: a QuantizedKV cache with values of that dtype."""
    kv = jax.ShapeDtypeStruct((24, ps, 2 * hkv, d), dtype)
    if kv_values is not None:
        kv = QuantizedKV(jax.ShapeDtypeStruct(kv.shape, kv_values), jax.ShapeDtypeStruct(kv.shape[:-1], jnp.float32))
    return (jax.ShapeDtypeStruct((t, hq, d), dtype), kv,
            jax.ShapeDtypeStruct((s,), jnp.int32), jax.ShapeDtypeStruct((s, max_pages), jnp.int32),
            jax.ShapeDtypeStruct((s + 1,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))


CONFIGS = {
    "bf16_d128_ps16": dict(),
    "f32_d64_ps8_gqa1": dict(dtype=jnp.float32, d=64, ps=8, hq=2, hkv=2),
    "bf16_d256_ps128_gqa8": dict(d=256, ps=128, hq=8, hkv=1, max_pages=2),
    "decode_bucket": dict(t=16, s=16),
    "batch1_long_table": dict(t=8, s=1, max_pages=8192),  # 128K-token block table: split-K over the real pages
    "f16_d64_gqa4": dict(dtype=jnp.float16, d=64),
}
OPTIONS = {"plain": {}, "window_softcap": dict(sliding_window=64, logit_soft_cap=30.0)}
KERNELS = {"cuda": gpu.ragged_paged_attention_gpu, "tpu": tpu.ragged_paged_attention_tpu}


def _lower(fn, args, platform, **jit_kw):
    return jax.jit(fn, **jit_kw).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("platform", KERNELS)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("options", OPTIONS)
def test_attention_kernel_lowers(platform, config, options):
    fn = functools.partial(KERNELS[platform], sm_scale=0.1, **OPTIONS[options])
    text = _lower(fn, _abstract_args(**CONFIGS[config]), platform)
    assert ("ragged_paged_attention_triton" if platform == "cuda" else "tpu_custom_call") in text


@pytest.mark.parametrize("platform,forced", [("cuda", "gpu"), ("tpu", "tpu")])
def test_entry_point_lowers_for_platform(monkeypatch, platform, forced):
    monkeypatch.setenv("MESHSERVE_ATTENTION", forced)
    fn = functools.partial(pallas_kernels.ragged_paged_attention, sm_scale=0.1)
    _lower(fn, _abstract_args(), platform)


# What a quantized cache's 8-bit tiles are read as: Triton loads them, Mosaic DMAs them from HBM to VMEM.
EIGHT_BIT_READS = {"cuda": r"tt\.load %\S+ : tensor<[0-9x]+x!tt\.ptr<({})>>",
                   "tpu": r"tpu\.enqueue_dma source\(%\S+ : memref<[0-9x]+x({})"}
MLIR_TYPES = {"int8": "i8", "fp8_e4m3": "f8E4M3FN"}


@pytest.mark.parametrize("platform", KERNELS)
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("config", ["bf16_d128_ps16", "f32_d64_ps8_gqa1", "bf16_d256_ps128_gqa8"])
def test_attention_kernel_lowers_with_a_quantized_cache(capsys, platform, kv_cache_dtype, config):
    """int8 / float8_e4m3 caches (the storage of each platform: `kv_quant.values_dtype`) lower on both kernels, the
    kernel reading the 8-bit pages themselves: no XLA op converts the cache before the kernel."""
    values = kv_quant.values_dtype(kv_cache_dtype, "gpu" if platform == "cuda" else platform)
    assert values == (jnp.int8 if kv_cache_dtype == "int8" else jnp.float8_e4m3fn)
    args = _abstract_args(**CONFIGS[config], kv_values=values)
    fn = functools.partial(KERNELS[platform], sm_scale=0.1, debug=True, **OPTIONS["window_softcap"])
    text = _lower(fn, args, platform)
    module = capsys.readouterr().out
    assert re.search(EIGHT_BIT_READS[platform].format(MLIR_TYPES[kv_cache_dtype]), module)
    cache_shape = "x".join(map(str, args[1].shape))
    assert not re.search(rf"stablehlo\.convert [^\n]*tensor<{cache_shape}x", text)
    if platform == "tpu":  # the chunk is widened to f32 in VMEM and read per head by 32-bit strided loads
        loads = re.findall(r"tpu\.strided_load [^\n]*: memref<[0-9x]*x(\w+),", module)
        assert set(loads) <= {"i32", "f32"}, loads


@pytest.mark.parametrize("platform,forced", [("cuda", "gpu"), ("tpu", "tpu")])
def test_entry_points_lower_for_platform_with_a_quantized_cache(monkeypatch, platform, forced):
    monkeypatch.setenv("MESHSERVE_ATTENTION", forced)
    q, kv, *rest = _abstract_args(kv_values=jnp.float8_e4m3fn)
    fn = functools.partial(pallas_kernels.ragged_paged_attention, sm_scale=0.1)
    _lower(fn, (q, kv, *rest), platform)
    k = jax.ShapeDtypeStruct((32, 2, 128), jnp.bfloat16)
    # a fresh partial: a fresh trace (jit's cache would reuse another platform's trace)
    text = _lower(functools.partial(pallas_kernels.write_kv), (kv, k, k, jax.ShapeDtypeStruct((32,), jnp.int32)),
                  platform, donate_argnums=0)
    if platform == "tpu":  # the aliased DMA kernel, values and scales both in place
        assert "tpu_custom_call" in text and text.count("tf.aliasing_output") == 2


def test_tpu_kv_write_lowers_aliased():
    args = (jax.ShapeDtypeStruct((24, 16, 4, 128), jnp.bfloat16), jax.ShapeDtypeStruct((32, 2, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((32, 2, 128), jnp.bfloat16), jax.ShapeDtypeStruct((32,), jnp.int32))
    text = _lower(tpu.write_kv_tpu, args, "tpu", donate_argnums=0)
    assert "tpu_custom_call" in text


@pytest.mark.parametrize("config", ["bf16_d128_ps16", "f32_d64_ps8_gqa1", "bf16_d256_ps128_gqa8", "f16_d64_gqa4"])
def test_tpu_kernel_strided_loads_are_32_bit(capsys, config):
    """Mosaic's strided load takes 32-bit data only: 16-bit K/V are read through a uint32 view of the VMEM buffer
    (`tpu._head_kv`), never by a strided load on bf16/f16 (which lowered to MLIR here but fails in Mosaic's
    compiler on a TPU). Checked on the Mosaic module the kernel lowers to."""
    fn = functools.partial(tpu.ragged_paged_attention_tpu, sm_scale=0.1, debug=True)
    _lower(fn, _abstract_args(**CONFIGS[config]), "tpu")
    module = capsys.readouterr().out
    loads = re.findall(r"tpu\.strided_load [^\n]*: memref<[0-9x]*x(\w+),", module)
    assert set(loads) <= {"i32", "f32"}, loads
    if CONFIGS[config].get("hkv", 2) > 1:  # one KV head: K and V rows alternate, a stride-1 load
        assert loads
    if CONFIGS[config].get("dtype", jnp.bfloat16) != jnp.float32:
        assert re.search(r"tpu\.memref_bitcast [^\n]*x(bf16|f16),[^\n]*-> memref<[0-9x]*xi32", module)


def test_gpu_kernel_refuses_head_dim_80_with_a_clear_error():
    fn = functools.partial(gpu.ragged_paged_attention_gpu, sm_scale=0.1)
    with pytest.raises(ValueError, match="power-of-two head_dim >= 16, got 80"):
        _lower(fn, _abstract_args(d=80), "cuda")
    assert gpu.unsupported_reason(80, 16) and gpu.unsupported_reason(128, 16) is None


def test_gpu_kernel_addresses_a_cache_past_2_31_elements_with_64_bit_offsets(capsys):
    """A KV cache of more than 2^31 elements (4 GiB of bf16): the page loads' offsets are 64-bit."""
    fn = functools.partial(gpu.ragged_paged_attention_gpu, sm_scale=0.1, debug=True)
    kv_loads = r"tt\.addptr [^\n]*x!tt\.ptr<bf16>>, tensor<\d+x16x128x(i\d+)>"  # [pages, page_size, D] gathers
    for num_pages, offsets in [(1024, "i32"), (70_000, "i64")]:  # 70,000 x 16 x 16 x 128 > 2^31
        args = list(_abstract_args(hkv=8, hq=32, max_pages=64))
        args[1] = jax.ShapeDtypeStruct((num_pages, 16, 16, 128), jnp.bfloat16)
        _lower(fn, args, "cuda")
        assert set(re.findall(kv_loads, capsys.readouterr().out)) == {offsets}


@pytest.mark.parametrize("config,tile", [("bf16_d128_ps16", "8x16x128"), ("bf16_d256_ps128_gqa8", "64x256"),
                                         ("f32_d64_ps8_gqa1", "8x8x64")])
def test_gpu_kernel_reads_a_step_of_pages_per_loop_iteration(capsys, config, tile):
    """Each loop step reads `gpu.default_step_tokens` KV tokens of one head: 8 pages of 16 (128 tokens) at bf16
    head_dim 128, half a 128-token page at head_dim 256 (two stages of K and V within shared memory), and no more
    pages than the block table has (8 pages of 8 tokens in a table of 8)."""
    fn = functools.partial(gpu.ragged_paged_attention_gpu, sm_scale=0.1, debug=True)
    _lower(fn, _abstract_args(**CONFIGS[config]), "cuda")
    kv_tiles = re.findall(r"tt\.addptr [^\n]*: tensor<([0-9x]+)x!tt\.ptr<(?:bf16|f32)>", capsys.readouterr().out)
    assert tile in kv_tiles, kv_tiles


# Multi-head latent attention (DeepSeek-V2 / V3's cache: one row of kv_lora_rank 512 + RoPE 64 per token).
LATENT_CONFIGS = {"v3_decode_h128": dict(t=16, s=16, h=128), "v2lite_prefill_h16": dict(t=64, s=4, h=16),
                  "f32_small": dict(t=32, s=4, h=4, rank=64, rope=32, dtype=jnp.float32)}
LATENT_KERNELS = {"cuda": ("latent_attention_gpu", "latent_attention_triton"),
                  "tpu": ("latent_attention_tpu", "tpu_custom_call")}


def _latent_args(*, t, s, h, rank=512, rope=64, ps=16, max_pages=8, dtype=jnp.bfloat16, kv_values=None):
    d = rank + rope
    pages = jax.ShapeDtypeStruct((24, ps, 1, d), dtype)
    if kv_values is not None:
        pages = QuantizedKV(jax.ShapeDtypeStruct(pages.shape, kv_values),
                            jax.ShapeDtypeStruct(pages.shape[:-1], jnp.float32))
    return (jax.ShapeDtypeStruct((t, h, d), dtype), pages, jax.ShapeDtypeStruct((s,), jnp.int32),
            jax.ShapeDtypeStruct((s, max_pages), jnp.int32), jax.ShapeDtypeStruct((s + 1,), jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.int32)), rank


@pytest.mark.parametrize("platform", LATENT_KERNELS)
@pytest.mark.parametrize("config", LATENT_CONFIGS)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_latent_attention_kernel_lowers(platform, config, kv_cache_dtype):
    from pallas_kernels import mla_gpu, mla_tpu
    module, name = LATENT_KERNELS[platform]
    kw = dict(LATENT_CONFIGS[config])
    if kv_cache_dtype != "auto":
        kw["kv_values"] = kv_quant.values_dtype(kv_cache_dtype, "gpu" if platform == "cuda" else platform)
    args, rank = _latent_args(**kw)
    fn = functools.partial(getattr({"cuda": mla_gpu, "tpu": mla_tpu}[platform], module), sm_scale=0.1,
                           value_dim=rank)
    text = _lower(fn, args, platform)
    assert name in text
    cache_shape = "x".join(map(str, args[1].shape))
    assert not re.search(rf"stablehlo\.convert [^\n]*tensor<{cache_shape}x", text)  # the kernel reads the pages


@pytest.mark.parametrize("platform,forced", [("cuda", "gpu"), ("tpu", "tpu")])
def test_latent_entry_points_lower_for_platform(monkeypatch, platform, forced):
    monkeypatch.setenv("MESHSERVE_ATTENTION", forced)
    args, rank = _latent_args(t=16, s=4, h=16)
    text = _lower(functools.partial(pallas_kernels.ragged_paged_latent_attention, sm_scale=0.1, value_dim=rank),
                  args, platform)
    assert LATENT_KERNELS[platform][1] in text
    rows = jax.ShapeDtypeStruct((16, 1, 576), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((16,), jnp.int32)
    text = _lower(functools.partial(pallas_kernels.write_latent), (args[1], rows, slots), platform, donate_argnums=0)
    if platform == "tpu":  # the aliased DMA kernel writes the rows in place
        assert "tpu_custom_call" in text and "tf.aliasing_output" in text


def test_gpu_latent_kernel_refuses_a_rank_triton_cannot_tile():
    from pallas_kernels import mla_gpu
    assert "power-of-two kv_lora_rank >= 16, got 96" in mla_gpu.unsupported_reason(96, 64, 16)
    assert "power-of-two qk_rope_head_dim >= 16, got 8" in mla_gpu.unsupported_reason(512, 8, 16)
    assert mla_gpu.unsupported_reason(512, 64, 16) is None
    assert pallas_kernels.attention.unsupported_reason("gpu", 192, 16, latent_dims=(96, 64))
