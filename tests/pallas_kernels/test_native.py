"""Native CPU kernels (pallas_kernels/native): the matmuls and the greedy head against NumPy on every
instruction-set path this CPU runs (the `isa` fixture forces each in turn, so an AVX-512 machine tests its AVX2 and
portable paths too), the engine's programs using them, and the switch back to XLA's kernels. (Attention is checked
with every other backend in test_attention.py; the C++ self-test and the aarch64 paths in
test_native_selftest.py.)"""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels.matmul import matmul
from pallas_kernels import native

pytestmark = pytest.mark.skipif(native.machine_reason() is not None,
                                reason=f"native CPU kernels cannot run here: {native.machine_reason()}")


@pytest.fixture(autouse=True)
def _native_on(monkeypatch):
    """These tests are about the kernels: MESHSERVE_CPU_KERNELS=xla (serving without them) does not turn them off."""
    monkeypatch.delenv(native.ENV_VAR, raising=False)
RUNNABLE = native.runnable_isas()
# What each path needs beyond the one below it, as /proc/cpuinfo names it.
NEEDS = {"avx2": "avx2, fma, f16c", "avx512": "avx512f, avx512bw, avx512vl, avx512dq", "avx512_bf16": "avx512_bf16",
         "amx": "amx_tile, amx_bf16 (and Linux granting the AMX state)", "neon": "asimd", "neon_bf16": "bf16"}


@pytest.fixture(params=RUNNABLE)
def isa(request, monkeypatch):
    """Each instruction-set path this CPU runs, forced in turn (programs traced in the test use it)."""
    monkeypatch.setenv(native.ISA_ENV_VAR, request.param)
    return request.param


def _compile(fn, *args, **kwargs):
    """fn jitted from a fresh trace (the path is read at trace time, and jit's cache would hand back a program traced
    for another) and compiled for these arguments' shapes, checking that the program calls the kernels on the path
    the test forced."""
    lowered = jax.jit(lambda *a: fn(*a, **kwargs)).lower(*args)
    forced = os.environ.get(native.ISA_ENV_VAR)
    if forced:
        assert f"isa = {native.ISAS.index(forced)} : i32" in lowered.as_text()
    return lowered.compile()


def _call(fn, *args, **kwargs):
    """fn(*args, **kwargs) through `_compile`."""
    return _compile(fn, *args, **kwargs)(*args)


def _call_each(fn, cases, **kwargs):
    """fn(*case, **kwargs) for every case (a tuple of arguments) in one program through `_compile`: one compile
    for a parametrization's shapes (each case still its own kernel call) instead of one per shape."""
    return _call(lambda cs: [fn(*case, **kwargs) for case in cs], [tuple(case) for case in cases])


def test_kernels_build_on_this_machine():
    # CI machines have g++ and at least AVX2: the kernels must build there and be used, not silently fall back.
    assert native.enabled()
    assert native.build().exists()
    assert RUNNABLE[0] == "generic" and RUNNABLE[-1] in ("avx2", "avx512", "avx512_bf16", "amx", "neon", "neon_bf16")
    assert native.isa() == (os.environ.get(native.ISA_ENV_VAR) or RUNNABLE[-1])  # the best, unless forced


@pytest.mark.parametrize("path", [p for p in native.ARCH_ISAS.get(native.machine(), {}) if p != "generic"])
def test_path_runs_on_this_cpu(path):
    """One line per path of this architecture: those this CPU cannot run are named here (and only here) as a skip
    with the CPU feature they need; the kernel tests run once per path it can."""
    if path not in RUNNABLE:
        pytest.skip(f"the {path} path needs {NEEDS[path]}, which this CPU lacks")
    with native.use_isa(path):
        x = jnp.arange(3 * 64, dtype=jnp.float32).reshape(3, 64) / 64
        np.testing.assert_allclose(np.asarray(_call(native.matmul, x, jnp.ones((64, 32), jnp.float32))),
                                   np.asarray(x) @ np.ones((64, 32)), rtol=1e-6)


def test_forcing_a_path_this_cpu_cannot_run_is_a_clear_error(monkeypatch):
    missing = [p for p in native.ARCH_ISAS[native.machine()] if p not in RUNNABLE]
    monkeypatch.setenv(native.ISA_ENV_VAR, missing[0] if missing else "neon" if native.machine() == "x86_64" else "avx2")
    with pytest.raises(RuntimeError, match="this CPU cannot run it; it runs generic"):
        native.enabled()
    monkeypatch.setenv(native.ISA_ENV_VAR, "sse9")
    with pytest.raises(ValueError, match="expected one of generic, avx2"):
        native.isa()
    monkeypatch.setenv(native.ISA_ENV_VAR, "auto")
    assert native.isa() == RUNNABLE[-1]


@pytest.mark.parametrize("k,n", [(64, 48), (96, 200), (33, 130), (256, 1000)])
def test_matmul_f32_matches_numpy(isa, k, n):
    ms = [1, 3, 7, 8, 13, 16, 17, 33]  # rows across every tile height and past it, one program for all
    cases = []
    for m in ms:
        rng = np.random.default_rng(m * 1000 + k + n)
        cases.append((rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)))
    outs = _call_each(native.matmul, [(jnp.asarray(x), jnp.asarray(w)) for x, w in cases])
    for m, (x, w), out in zip(ms, cases, outs):
        np.testing.assert_allclose(np.asarray(out), x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4, err_msg=f"m={m}")


@pytest.mark.parametrize("k,n", [(64, 48), (33, 130), (256, 1000)])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_matmul_bf16_matches_f32_accumulation(isa, k, n, out_dtype):
    ms = [1, 2, 5, 7, 8, 12, 16, 20]
    cases = []
    for m in ms:
        rng = np.random.default_rng(m * 1000 + k + n)
        cases.append((jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16),
                      jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)))
    for m, (x, w), out in zip(ms, cases, _call_each(native.matmul, cases, out_dtype=out_dtype)):
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)  # bf16 products are exact in f32
        assert out.dtype == out_dtype and out.shape == (m, n)
        if out_dtype == jnp.float32:
            np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-4, err_msg=f"m={m}")
        else:  # one rounding to bf16 of the f32 sum
            np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2 ** -8, atol=1e-2, err_msg=f"m={m}")


def test_matmul_takes_leading_dims_and_zero_rows(isa):
    x = jnp.arange(2 * 3 * 64, dtype=jnp.float32).reshape(2, 3, 64) / 100
    w = jnp.ones((64, 32), jnp.float32)
    np.testing.assert_allclose(np.asarray(_call(native.matmul, x, w)), np.asarray(x) @ np.ones((64, 32)),
                               rtol=1e-6)
    assert _call(native.matmul, jnp.zeros((0, 64), jnp.float32), w).shape == (0, 32)


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
    assert native.can_pack(jnp.ones((2, 64, 64), jnp.float32))  # a stack (MoE experts), packed slot by slot
    assert not native.can_pack(jnp.ones((2, 2, 64, 64), jnp.float32)) and not native.can_pack(jnp.ones((0, 64, 64)))
    assert native.is_packed_experts(native.pack_weights([jnp.ones((2, 64, 64), jnp.bfloat16)])[0])
    assert not native.is_packed(jnp.ones((64, 64), jnp.float32))


@pytest.mark.parametrize("k,n", [(64, 32), (33, 192), (300, 96)])
def test_packed_matmul_f32_matches_numpy(isa, k, n):
    ms = [1, 4, 6, 7, 13, 14, 16, 29, 40, 230]
    cases = []
    for m in ms:
        rng = np.random.default_rng(m * 1000 + k + n)
        cases.append((rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)))
    outs = _call_each(native.matmul_packed, [(jnp.asarray(x), native.pack_weight(jnp.asarray(w))) for x, w in cases])
    for m, (x, w), out in zip(ms, cases, outs):
        np.testing.assert_allclose(np.asarray(out), x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4, err_msg=f"m={m}")


@pytest.mark.parametrize("k,n", [(64, 64), (33, 192), (70, 128), (256, 320)])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_packed_matmul_bf16_matches_f32_accumulation(isa, k, n, out_dtype):
    # rows of 40 take the AMX tiles or, where bf16 is widened to f32, the panel widened once (matmul.h)
    ms = [1, 3, 6, 8, 16, 17, 40]
    cases = []
    for m in ms:
        rng = np.random.default_rng(m * 1000 + k + n)
        cases.append((jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16),
                      jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)))
    outs = _call_each(native.matmul_packed, [(x, native.pack_weight(w)) for x, w in cases], out_dtype=out_dtype)
    for m, (x, w), out in zip(ms, cases, outs):
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        assert out.dtype == out_dtype and out.shape == (m, n)
        if out_dtype == jnp.float32:
            np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-4, err_msg=f"m={m}")
        else:
            np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2 ** -8, atol=1e-2, err_msg=f"m={m}")


def test_packed_matmul_takes_leading_dims_and_zero_rows(isa):
    x = jnp.arange(2 * 3 * 64, dtype=jnp.float32).reshape(2, 3, 64) / 100
    p = native.pack_weight(jnp.ones((64, 128), jnp.float32))
    np.testing.assert_allclose(np.asarray(_call(native.matmul_packed, x, p)), np.asarray(x) @ np.ones((64, 128)),
                               rtol=1e-6)
    assert _call(native.matmul_packed, jnp.zeros((0, 64), jnp.float32), p).shape == (0, 128)


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
    native.library._load.cache_clear()  # first load while switched off: a direct call still works, and the switch
    assert _custom_calls(native.matmul, jnp.ones((2, 64), jnp.float32), w32) == {"meshserve_cpu_matmul"}
    monkeypatch.delenv(native.ENV_VAR)  # flipped back turns the model's path on again
    assert _custom_calls(matmul, jnp.ones((16, 64), jnp.float32), w32) == {"meshserve_cpu_matmul"}


# The engine on the path it picks, and on the lowest one the automatic choice would take (AVX2 on an AVX-512 machine).
ENGINE_PATHS = sorted({RUNNABLE[-1], next((p for p in RUNNABLE if p in ("avx2", "neon")), RUNNABLE[-1])},
                      key=RUNNABLE.index) if RUNNABLE else []


@pytest.mark.parametrize("path", ENGINE_PATHS)
def test_native_and_xla_kernels_give_the_same_generations(tmp_path, monkeypatch, path):
    """The engine's step runs both native kernels, and its greedy generations equal those with XLA's kernels
    and HF's (untied LM head, so the logits matmul is native too)."""
    monkeypatch.setenv(native.ISA_ENV_VAR, path)
    from serving.core.llm import LLM
    from serving.core.sampling_params import SamplingParams
    from tests.support import hf_models

    hf = hf_models.save_hf_model("qwen3", str(tmp_path / "qwen3"))
    prompts = [hf_models.random_prompt(n, hf.config.vocab_size, seed=n) for n in (5, 2, 37)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    traced = []
    for name in ("matmul", "matmul_packed", "ragged_paged_attention"):
        fn = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _fn=fn, _name=name, **k: (traced.append(_name), _fn(*a, **k))[1])

    def run():
        # No warm-up: only the programs these requests run are compiled (and traced with the kernels they call).
        llm = LLM(str(tmp_path / "qwen3"), warmup=False, max_num_seqs=4, num_pages=64, max_num_batched_tokens=64)
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
    from serving.core.config import EngineConfig
    from serving.core.engine import Engine
    from tests.support import hf_models

    hf_models.save_hf_model("qwen3", str(tmp_path / "qwen3"))
    model = load_model(str(tmp_path / "qwen3"))
    shape = model.layers[0].self_attn.q_proj[...].shape
    engine = Engine(EngineConfig(model=str(tmp_path / "qwen3"), num_pages=16, max_num_seqs=2,
                                 max_num_batched_tokens=32), model=model)
    assert engine.runner.packed_weights > 0
    assert model.layers[0].self_attn.q_proj[...].shape == shape  # the engine packed a clone
    packed = [x for x in jax.tree_util.tree_leaves(engine.runner.state) if native.is_packed(x)]
    assert len(packed) == engine.runner.packed_weights
    # q|k|v and gate|up fused (one kernel call each), o/down/LM head alone: 2 layers x 4 + 1
    layer = nnx.merge(engine.runner.graphdef, engine.runner.state).layers[0]
    assert layer.self_attn.q_proj is None and native.is_packed(layer.self_attn.qkv_proj[...])
    assert layer.mlp.gate_proj is None and native.is_packed(layer.mlp.gate_up_proj[...])
    assert engine.runner.packed_weights == 2 * 4 + 1
    assert sum(x.size for x in packed) == sum(
        x.size for x in jax.tree_util.tree_leaves(nnx.state(model)) if x.ndim == 2 and x is not model.embed_tokens[...]
    ) + sum(x.size for layer in model.layers for x in (layer.self_attn.q_proj[...], layer.self_attn.k_proj[...],
                                                       layer.self_attn.v_proj[...], layer.self_attn.o_proj[...]))


# ---------------------------------------------------------------------------------------------------------
# Greedy LM head by screening (native.greedy_head): the argmax of the exact logits from an int8 screen.

def _head(layout: str, w_kn: jax.Array) -> jax.Array:
    return {"packed": native.pack_weight, "kn": lambda w: w, "nk": lambda w: w.T}[layout](w_kn)


def _screened(x, w_kn, layout, num_rows):
    return _screened_each([x], w_kn, layout, num_rows)[0]


def _screened_each(xs, w_kn, layout, num_rows):
    """(tokens, candidates) of the screened head for each x, in one program."""
    q, bounds = native.greedy_head_screen(np.asarray(w_kn.astype(jnp.float32)).T)
    operands = (jnp.asarray(q), jnp.asarray(bounds), _head(layout, w_kn), jnp.array([num_rows]))
    outs = _call_each(native.greedy_head, [(x, *operands) for x in xs], layout=layout)
    return [(np.asarray(tokens), np.asarray(cands)) for tokens, cands in outs]


def _exact_logits(x, w_kn) -> np.ndarray:
    return np.asarray(x.astype(jnp.float32), np.float64) @ np.asarray(w_kn.astype(jnp.float32), np.float64)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layout", ["packed", "kn", "nk"])
@pytest.mark.parametrize("k,n", [(64, 256), (100, 640), (768, 4096)])
def test_greedy_head_is_the_argmax_of_the_exact_logits(isa, dtype, layout, k, n):
    rng = np.random.default_rng(k + n)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, dtype)
    xs = [jnp.asarray(rng.standard_normal((4, k)), dtype) for trial in range(3)]
    for x, (tokens, cands) in zip(xs, _screened_each(xs, w, layout, num_rows=3)):  # three trials, one program
        exact = _exact_logits(x, w)
        np.testing.assert_array_equal(tokens[:3], exact[:3].argmax(axis=1))
        assert tokens[3] == 0 and cands[3] == 0  # rows past num_rows are not computed
        # The screen leaves few rows to read at full precision (its point), never none.
        assert (cands[:3] >= 1).all() and cands[:3].max() <= max(8, n // 50), cands
        # The full-precision head's argmax (float32 logits) is the same token, but for a float32 near-tie.
        full = np.asarray(x.astype(jnp.float32) @ w.astype(jnp.float32), np.float64)
        for r in range(3):
            f = int(full[r].argmax())
            assert f == tokens[r] or abs(exact[r, f] - exact[r, tokens[r]]) < 1e-5 * np.abs(exact[r]).max()


def test_greedy_head_screen_bounds_hold():
    """Per vocabulary row j and any x: |x.w_j - s_j x.q_j| <= ||x|| c_j (in float64, before the kernel's own
    float32 rounding, which c_j also covers)."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((300, 96)) * rng.uniform(0.001, 1, (300, 1))).astype(np.float32)  # [N, K]
    w[7] = 0  # an all-zero row: scale 1, q 0, bound 0
    q, bounds = native.greedy_head_screen(w)
    assert q.shape == (300, 128) and q.dtype == np.int8 and (q[:, 96:] == 0).all()
    assert bounds.shape == (2, 300) and bounds[1, 7] == 0
    x = rng.standard_normal((50, 96))
    err = np.abs(x @ w.T.astype(np.float64) - (x @ q[:, :96].T.astype(np.float64)) * bounds[0])
    assert (err <= np.linalg.norm(x, axis=1, keepdims=True) * bounds[1]).all()


def test_greedy_head_finds_the_winner_the_screen_misorders(isa):
    """Two vocabulary rows whose exact logits differ by a hair but whose int8 approximations rank them the
    other way: the full-precision recheck of the candidates gives the exact winner."""
    rng = np.random.default_rng(0)
    k, n, a, b = 128, 256, 17, 200
    x = rng.standard_normal(k).astype(np.float32)
    for attempt in range(200):
        w = (rng.standard_normal((k, n)) * 0.01).astype(np.float32)
        w[:, a] = 0.05 * x / np.linalg.norm(x) + w[:, a] * 0.1  # row a's logit well above the rest
        v = rng.standard_normal(k) * 0.002
        eps = 1e-4 * float(x @ w[:, a])
        v -= (x @ v + eps) / (x @ x) * x  # exact: logit_b = logit_a - eps
        w[:, b] = w[:, a] + v.astype(np.float32)
        exact = x.astype(np.float64) @ w.astype(np.float64)
        q, bounds = native.greedy_head_screen(w.T)
        approx = (q[:, :k].astype(np.float64) @ x.astype(np.float64)) * bounds[0]
        if exact.argmax() == a and approx.argmax() == b and approx[b] - approx[a] > 1e-3 * abs(approx[a]):
            break
    else:
        pytest.fail("no misordered pair constructed")
    tokens, cands = _screened(jnp.asarray(x[None]), jnp.asarray(w), "packed", num_rows=1)
    assert tokens[0] == a and cands[0] >= 2


def test_greedy_head_ties_and_degenerate_rows(isa):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 128)).astype(np.float32)
    w[:, 90] = w[:, 40] = w[:, 70] * 1  # three identical rows
    x = w[:, 70] * 10  # they win, tied: the lowest id
    tokens, cands = _screened(jnp.asarray(np.stack([x, np.zeros(64, np.float32)])), jnp.asarray(w), "kn", 2)
    assert tokens[0] == 40 and cands[0] >= 3
    assert tokens[1] == 0 and cands[1] == 128  # all logits 0: every row ties; the lowest id, as argmax gives


def test_engine_greedy_steps_take_the_screen_with_the_same_tokens(tmp_path, monkeypatch):
    """Greedy steps of up to SCREEN_MAX_ROWS sequences run the screened head (their own programs, compiled at
    start-up) with the tokens of the full head and of HF, untied (packed f32, [K, N] bf16) and tied heads; a step
    with a sampling request runs the full head."""
    import torch

    from pallas_kernels.matmul import SCREEN_MAX_ROWS
    from serving.core.llm import LLM
    from serving.core.sampling_params import SamplingParams
    from tests.support import hf_models

    traced = []
    fn = native.greedy_head
    monkeypatch.setattr(native, "greedy_head", lambda *a, **k: (traced.append(1), fn(*a, **k))[1])
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for family, dtype in (("llama", torch.float32), ("llama", torch.bfloat16), ("qwen2", torch.float32)):
        path = str(tmp_path / f"{family}-{dtype}")
        hf = hf_models.save_hf_model(family, path, dtype=dtype)
        prompts = [hf_models.random_prompt(n, hf.config.vocab_size, seed=n) for n in (5, 23, 9)]
        runs = {}
        for screen in (True, False):
            traced.clear()
            # No warm-up (test_engine.py's test_warmup_compiles_every_program[1] counts the screened programs it
            # compiles): the greedy head is traced only if the greedy steps of these requests take it.
            llm = LLM(path, warmup=False, dtype=str(dtype).removeprefix("torch."), max_num_seqs=4, num_pages=64,
                      max_num_batched_tokens=64, greedy_head_screen=screen)
            eng = llm.engine
            assert eng.runner.screen_greedy is screen
            runs[screen] = [o.token_ids for o in llm.generate(prompts, greedy)]
            assert bool(traced) is screen
            if screen:
                screened = sum(eng.runner.screens(eng.runner.seq_bucket(t)) for t in eng.buckets)
                assert screened > 0 and all(eng.runner.seq_bucket(t) > SCREEN_MAX_ROWS for t in eng.buckets
                                            if not eng.runner.screens(eng.runner.seq_bucket(t)))
                # Mixed with a sampling request the steps run the full head; the greedy requests' tokens hold. (The
                # same step shapes as the greedy run: the full-head programs are those the unscreened engine below
                # then finds in the compilation cache.)
                sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True)
                mixed = llm.generate(prompts, [greedy, sampled, greedy])
                assert [mixed[0].token_ids, mixed[2].token_ids] == [runs[True][0], runs[True][2]]
        assert runs[True] == runs[False], family
        if dtype == torch.float32:
            assert runs[True] == [hf_models.hf_greedy(hf, p, 12) for p in prompts], family
