"""Native CPU kernels (pallas_kernels/native): the matmul against NumPy, the engine's programs using them, and
the switch back to XLA's kernels. (Attention is checked with every other backend in test_attention.py.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.transformer import matmul
from pallas_kernels import native

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None,
                                reason=f"native CPU kernels cannot run here: {native.unavailable_reason()}")


def test_kernels_build_on_this_machine():
    # The CI machine has AVX-512 BF16 and g++: the kernels must build there, not silently fall back.
    assert native.enabled()
    assert native.build().exists()


@pytest.mark.parametrize("m", [1, 3, 7, 8, 13, 16, 17, 33])
@pytest.mark.parametrize("k,n", [(64, 48), (96, 200), (33, 130), (256, 1000)])
def test_matmul_f32_matches_numpy(m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    x, w = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    out = np.asarray(jax.jit(native.matmul)(jnp.asarray(x), jnp.asarray(w)))
    np.testing.assert_allclose(out, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", [1, 2, 5, 7, 8, 12, 16, 20])
@pytest.mark.parametrize("k,n", [(64, 48), (33, 130), (256, 1000)])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_matmul_bf16_matches_f32_accumulation(m, k, n, out_dtype):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)  # bf16 products are exact in f32
    out = jax.jit(native.matmul, static_argnums=2)(x, w, out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n)
    if out_dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-4)
    else:  # one rounding to bf16 of the f32 sum
        np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2 ** -8, atol=1e-2)


def test_matmul_takes_leading_dims_and_zero_rows():
    x = jnp.arange(2 * 3 * 64, dtype=jnp.float32).reshape(2, 3, 64) / 100
    w = jnp.ones((64, 32), jnp.float32)
    np.testing.assert_allclose(np.asarray(jax.jit(native.matmul)(x, w)), np.asarray(x) @ np.ones((64, 32)),
                               rtol=1e-6)
    assert jax.jit(native.matmul)(jnp.zeros((0, 64), jnp.float32), w).shape == (0, 32)


def _custom_calls(fn, *args) -> set[str]:
    text = jax.jit(lambda *a: fn(*a)).lower(*args).as_text()  # a fresh trace each time
    return {t for t in ("meshserve_cpu_matmul", "meshserve_cpu_ragged_paged_attention") if t in text}


def test_model_matmul_dispatch_follows_rows_dtype_and_switch(monkeypatch):
    w32, w16 = jnp.ones((64, 32), jnp.float32), jnp.ones((64, 32), jnp.bfloat16)
    assert _custom_calls(matmul, jnp.ones((16, 64), jnp.float32), w32) == {"meshserve_cpu_matmul"}
    assert _custom_calls(matmul, jnp.ones((4, 64), jnp.bfloat16), w16) == {"meshserve_cpu_matmul"}
    assert _custom_calls(matmul, jnp.ones((16, 64), jnp.bfloat16), w16) == {"meshserve_cpu_matmul"}
    # above the row limits XLA's matmul (packing; AMX for bf16) is faster and is used
    assert _custom_calls(matmul, jnp.ones((64, 64), jnp.float32), w32) == set()
    assert _custom_calls(matmul, jnp.ones((32, 64), jnp.bfloat16), w16) == set()
    monkeypatch.setenv(native.ENV_VAR, "xla")
    assert _custom_calls(matmul, jnp.ones((16, 64), jnp.float32), w32) == set()
    native._load.cache_clear()  # first load while switched off: a direct call still works, and the switch
    assert _custom_calls(native.matmul, jnp.ones((2, 64), jnp.float32), w32) == {"meshserve_cpu_matmul"}
    monkeypatch.delenv(native.ENV_VAR)  # flipped back turns the model's path on again
    assert _custom_calls(matmul, jnp.ones((16, 64), jnp.float32), w32) == {"meshserve_cpu_matmul"}


def test_native_and_xla_kernels_give_the_same_generations(tmp_path, monkeypatch):
    """The engine's step runs both native kernels, and its greedy generations equal those with XLA's kernels
    and HF's (untied LM head, so the logits matmul is native too)."""
    from serving.core.llm import LLM
    from serving.core.sampling_params import SamplingParams
    from tests import hf_models

    hf = hf_models.save_hf_model("qwen3", str(tmp_path / "qwen3"))
    prompts = [hf_models.random_prompt(n, hf.config.vocab_size, seed=n) for n in (5, 2, 37)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    traced = []
    for name in ("matmul", "ragged_paged_attention"):
        fn = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _fn=fn, _name=name, **k: (traced.append(_name), _fn(*a, **k))[1])

    def run():
        llm = LLM(str(tmp_path / "qwen3"), max_num_seqs=4, num_pages=64, max_num_batched_tokens=64)
        return [o.token_ids for o in llm.generate(prompts, params)]

    native_out = run()
    assert {"matmul", "ragged_paged_attention"} <= set(traced)
    assert native_out == [hf_models.hf_greedy(hf, p, 10) for p in prompts]
    traced.clear()
    monkeypatch.setenv(native.ENV_VAR, "xla")
    assert run() == native_out
    assert traced == []
