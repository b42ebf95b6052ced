"""Native CPU kernels (pallas_kernels/native): the matmul against NumPy, the engine's programs using them, and
the switch back to XLA's kernels. (Attention is checked with every other backend in test_attention.py.)"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

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
    return set(re.findall(r"@(meshserve_cpu_\w+)\(", text))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("k,n", [(64, 64), (33, 128), (70, 192), (768, 256)])
def test_pack_weight_round_trips_and_pads_k(dtype, k, n):
    w = jnp.asarray(np.random.default_rng(k + n).standard_normal((k, n)), dtype)
    assert native.can_pack(w)
    p = native.pack_weight(w)
    assert native.is_packed(p) and p.dtype == dtype and p.shape[0] == n // native.PANELS[jnp.dtype(dtype)]
    rows = p.shape[1] * p.shape[3]
    assert rows == (k if dtype == jnp.float32 else -(-k // 32) * 32)  # bf16 pads K to whole AMX steps
    assert p.size == rows * n
    np.testing.assert_array_equal(np.asarray(native.unpack_weight(p, k)), np.asarray(w))
    # the panel layout itself: column c of panel j, row k
    f = np.asarray(native.unpack_weight(p, k), np.float32)
    assert f[k - 1, n - 1] == np.asarray(p, np.float32)[-1, (k - 1) // p.shape[3], -1, (k - 1) % p.shape[3]]
    with pytest.raises(ValueError, match="rows of K"):
        native.packed_shape(p, k + 64)


def test_pack_weights_on_the_host_arena_equals_pack_weight():
    rng = np.random.default_rng(5)
    shapes = [(k, n, dt) for k, n in [(64, 64), (33, 128), (96, 32), (768, 256)] for dt in (jnp.float32, jnp.bfloat16)
              if n % native.PANELS[jnp.dtype(dt)] == 0]
    ws = [jnp.asarray(rng.standard_normal((k, n)), dt) for k, n, dt in shapes]
    packed = native.pack_weights(ws)
    assert len(packed) == len(ws)
    for w, p in zip(ws, packed):
        np.testing.assert_array_equal(np.asarray(p), np.asarray(native.pack_weight(w)))
        assert p.unsafe_buffer_pointer() % 64 == 0  # aligned for the kernels' loads
    x = jnp.asarray(rng.standard_normal((5, 768)), jnp.float32)
    np.testing.assert_allclose(np.asarray(jax.jit(native.matmul_packed)(x, packed[-2])),
                               np.asarray(x) @ np.asarray(ws[-2]), rtol=1e-5, atol=1e-4)
    assert native.pack_weights([]) == []
    # a list of blocks packs their concatenation along N (fused projections)
    a, b = (jnp.asarray(rng.standard_normal((40, n)), jnp.bfloat16) for n in (96, 32))
    fused, = native.pack_weights([[a, b]])
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(native.pack_weight(jnp.concatenate([a, b], axis=1))))
    with pytest.raises(ValueError, match="cannot pack"):
        native.pack_weights([[a, a[:, :16]]])  # 112 columns: not whole 64-column panels


def test_can_pack_rejects_what_the_kernel_cannot_take():
    assert not native.can_pack(jnp.ones((64, 100), jnp.float32))  # N not whole panels
    assert native.can_pack(jnp.ones((64, 96), jnp.float32)) and not native.can_pack(jnp.ones((64, 96), jnp.bfloat16))
    assert not native.can_pack(jnp.ones((64, 64), jnp.float16))
    assert not native.can_pack(jnp.ones((2, 64, 64), jnp.float32))
    assert not native.is_packed(jnp.ones((64, 64), jnp.float32))


@pytest.mark.parametrize("m", [1, 4, 6, 7, 13, 14, 16, 29, 40, 230])
@pytest.mark.parametrize("k,n", [(64, 32), (33, 192), (300, 96)])
def test_packed_matmul_f32_matches_numpy(m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    x, w = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    out = np.asarray(jax.jit(native.matmul_packed)(jnp.asarray(x), native.pack_weight(jnp.asarray(w))))
    np.testing.assert_allclose(out, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("amx", ["1", "0"])
@pytest.mark.parametrize("m", [1, 3, 6, 8, 16, 17, 40])
@pytest.mark.parametrize("k,n", [(64, 64), (33, 192), (70, 128), (256, 320)])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_packed_matmul_bf16_matches_f32_accumulation(monkeypatch, amx, m, k, n, out_dtype):
    monkeypatch.setenv(native.AMX_ENV_VAR, amx)  # AMX tiles (where the CPU has them) and the AVX-512 pairs
    rng = np.random.default_rng(m * 1000 + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    out = jax.jit(native.matmul_packed, static_argnums=2)(x, native.pack_weight(w), out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n)
    if out_dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-4)
    else:
        np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2 ** -8, atol=1e-2)


def test_packed_matmul_takes_leading_dims_and_zero_rows():
    x = jnp.arange(2 * 3 * 64, dtype=jnp.float32).reshape(2, 3, 64) / 100
    p = native.pack_weight(jnp.ones((64, 128), jnp.float32))
    np.testing.assert_allclose(np.asarray(jax.jit(native.matmul_packed)(x, p)), np.asarray(x) @ np.ones((64, 128)),
                               rtol=1e-6)
    assert jax.jit(native.matmul_packed)(jnp.zeros((0, 64), jnp.float32), p).shape == (0, 128)


def test_model_matmul_on_packed_weights_any_rows_and_xla_fallback(monkeypatch):
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((96, 128)), jnp.float32)
    p = native.pack_weight(w)
    for rows in (1, 16, 300):  # every step size, prefill included, runs the packed kernel
        x = jnp.asarray(rng.standard_normal((rows, 96)), jnp.float32)
        assert _custom_calls(matmul, x, p) == {"meshserve_cpu_matmul_packed"}
        np.testing.assert_allclose(np.asarray(jax.jit(matmul)(x, p)), np.asarray(x) @ np.asarray(w),
                                   rtol=1e-5, atol=1e-4)
    monkeypatch.setenv(native.ENV_VAR, "xla")  # switched off after packing: XLA's dot on the unpacked weight
    assert _custom_calls(matmul, x, p) == set()
    np.testing.assert_allclose(np.asarray(jax.jit(matmul)(x, p)), np.asarray(x) @ np.asarray(w), rtol=1e-5,
                               atol=1e-4)


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
    for name in ("matmul", "matmul_packed", "ragged_paged_attention"):
        fn = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _fn=fn, _name=name, **k: (traced.append(_name), _fn(*a, **k))[1])

    def run():
        llm = LLM(str(tmp_path / "qwen3"), max_num_seqs=4, num_pages=64, max_num_batched_tokens=64)
        return [o.token_ids for o in llm.generate(prompts, params)]

    native_out = run()
    assert {"matmul_packed", "ragged_paged_attention"} <= set(traced)
    assert native_out == [hf_models.hf_greedy(hf, p, 10) for p in prompts]
    traced.clear()
    monkeypatch.setenv(native.ENV_VAR, "xla")
    assert run() == native_out
    assert traced == []


def test_engine_packs_its_weights_and_leaves_the_callers_model_alone(tmp_path):
    from models.weights import load_model
    from serving.core.engine import Engine, EngineConfig
    from tests import hf_models

    hf_models.save_hf_model("qwen3", str(tmp_path / "qwen3"))
    model = load_model(str(tmp_path / "qwen3"))
    shape = model.layers[0].self_attn.q_proj[...].shape
    engine = Engine(EngineConfig(model=str(tmp_path / "qwen3"), num_pages=16, max_num_seqs=2,
                                 max_num_batched_tokens=32), model=model)
    assert engine.packed_weights > 0
    assert model.layers[0].self_attn.q_proj[...].shape == shape  # the engine packed a clone
    packed = [x for x in jax.tree_util.tree_leaves(engine.state) if native.is_packed(x)]
    assert len(packed) == engine.packed_weights
    # q|k|v and gate|up fused (one kernel call each), o/down/LM head alone: 2 layers x 4 + 1
    layer = nnx.merge(engine.graphdef, engine.state).layers[0]
    assert layer.self_attn.q_proj is None and native.is_packed(layer.self_attn.qkv_proj[...])
    assert layer.mlp.gate_proj is None and native.is_packed(layer.mlp.gate_up_proj[...])
    assert engine.packed_weights == 2 * 4 + 1
    assert sum(x.size for x in packed) == sum(
        x.size for x in jax.tree_util.tree_leaves(nnx.state(model)) if x.ndim == 2 and x is not model.embed_tokens[...]
    ) + sum(x.size for layer in model.layers for x in (layer.self_attn.q_proj[...], layer.self_attn.k_proj[...],
                                                       layer.self_attn.v_proj[...], layer.self_attn.o_proj[...]))
