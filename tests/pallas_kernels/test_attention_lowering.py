"""Compile-only checks from CPU: the GPU (Triton) and TPU (Mosaic) kernels must keep lowering.

A change that breaks either kernel's lowering fails here without an accelerator. This checks lowering to
the platform's MLIR (Pallas -> Triton / Mosaic), not the accelerator compiler that runs afterwards.
"""
import functools

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels
from pallas_kernels import gpu, tpu


def _abstract_args(*, t=32, s=4, hq=8, hkv=2, d=128, ps=16, max_pages=8, dtype=jnp.bfloat16):
    return (jax.ShapeDtypeStruct((t, hq, d), dtype), jax.ShapeDtypeStruct((24, ps, 2 * hkv, d), dtype),
            jax.ShapeDtypeStruct((s,), jnp.int32), jax.ShapeDtypeStruct((s, max_pages), jnp.int32),
            jax.ShapeDtypeStruct((s + 1,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))


CONFIGS = {
    "bf16_d128_ps16": dict(),
    "f32_d64_ps8_gqa1": dict(dtype=jnp.float32, d=64, ps=8, hq=2, hkv=2),
    "bf16_d256_ps128_gqa8": dict(d=256, ps=128, hq=8, hkv=1, max_pages=2),
    "decode_bucket": dict(t=16, s=16),
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


def test_tpu_kv_write_lowers_aliased():
    args = (jax.ShapeDtypeStruct((24, 16, 4, 128), jnp.bfloat16), jax.ShapeDtypeStruct((32, 2, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((32, 2, 128), jnp.bfloat16), jax.ShapeDtypeStruct((32,), jnp.int32))
    text = _lower(tpu.write_kv_tpu, args, "tpu", donate_argnums=0)
    assert "tpu_custom_call" in text
