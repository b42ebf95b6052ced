"""The model with a quantized KV cache (`kv_cache_specs(kv_cache_dtype=)`): the caches it builds and their shardings,
tensor parallelism over the 8 fake CPU devices equal to one device (KV heads split, and replicated with each shard
slicing its heads), and the shipped tiny model: its teacher-forced logits over int8 / fp8 caches against its float32
cache's, and the granularity measurement on its real q / K / V."""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models.attention
from models.tokenizer import Tokenizer
from models.kv_cache import attention_spec, init_kv_caches
from models.weights import load_hf_model
from pallas_kernels import kv_quant
from pallas_kernels.cases import kv_granularity_errors, make_case
from pallas_kernels.kv_quant import QuantizedKV
from pallas_kernels.metadata import AttentionMetadata
from serving.core.batch import SeqChunk
from serving.process import REPO_ROOT
from sharding.mesh import mesh_context, serving_mesh
from tests.support.paged_runner import PagedRunner

FORMATS = ("int8", "fp8_e4m3")
TINY = os.path.join(REPO_ROOT, "models", "tiny", "target")


@pytest.fixture(scope="module")
def tiny():
    model = load_hf_model(TINY)
    with open(os.path.join(TINY, "heldout.txt"), encoding="utf-8", newline="") as f:
        ids = Tokenizer.from_pretrained(TINY).encode(f.read())[:192]
    return model, ids


@pytest.fixture(scope="module")
def float_cache_run(tiny):
    """The tiny model's held-out prefill over its float32 cache, in one jitted program: the logits at every token,
    and the q / K / V each layer computes (captured as the program's outputs)."""
    model, ids = tiny
    runner = PagedRunner(model, page_size=16, num_pages=16, max_pages=16)
    captured = []
    paged_attention = models.attention.paged_attention

    def capture(q, k, v, *args, **kw):
        captured.append((q[:len(ids)], k[:len(ids)], v[:len(ids)]))
        return paged_attention(q, k, v, *args, **kw)

    @jax.jit
    def run(state, kv, batch):
        captured.clear()
        m = nnx.merge(runner.graphdef, state)
        hidden, _ = m(batch, kv)
        return m.compute_logits(hidden), list(captured)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(models.attention, "paged_attention", capture)
        batch = runner._arrays([SeqChunk(ids, 0, runner.alloc(len(ids)))], None, None)
        logits, qkv = run(runner.state, runner.kv, batch)
    return np.asarray(logits)[:len(ids)], [tuple(np.asarray(a) for a in layer) for layer in qkv]


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_init_kv_caches_builds_quantized_caches_sharded_like_the_pages(tiny, kv_cache_dtype):
    model = tiny[0]
    cfg = model.config  # 2 KV heads of 64
    specs = model.kv_cache_specs(dtype=jnp.bfloat16, kv_cache_dtype=kv_cache_dtype)
    caches = init_kv_caches(specs, 12, 16, serving_mesh(tp=2))
    assert len(caches) == cfg.num_layers and all(isinstance(c, QuantizedKV) for c in caches)
    kv = caches[0]
    assert kv.values.shape == (12, 16, 4, 64) and kv.scales.shape == (12, 16, 4)
    assert kv.values.dtype == (jnp.int8 if kv_cache_dtype == "int8" else jnp.uint8)  # fp8 bits on cpu
    assert kv.scales.dtype == jnp.float32 and kv.kv_cache_dtype == kv_cache_dtype
    assert tuple(kv.values.sharding.spec) == (None, None, "tensor", None)
    assert tuple(kv.scales.sharding.spec) == (None, None, "tensor")
    assert not np.asarray(kv.values).any() and not np.asarray(kv.scales).any()
    assert isinstance(init_kv_caches(model.kv_cache_specs(dtype=jnp.bfloat16), 12, 16)[0], jax.Array)  # "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'"):
        model.kv_cache_specs(dtype=jnp.bfloat16, kv_cache_dtype="int4")


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("tp", [2, 4])  # 2 KV heads: split over 2 devices, replicated over 4 (each slicing its own)
def test_tensor_parallel_paged_attention_on_a_quantized_cache_matches_one_device(tp, kv_cache_dtype):
    case = make_case(np.random.default_rng(tp), [(1, 33), (12, 12), (5, 37), (1, 8)], num_q_heads=8, num_kv_heads=2,
                     head_dim=64, page_size=8, kv_cache_dtype=kv_cache_dtype)
    q, kv, *_ = case.attention_args()
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal((q.shape[0], 2, 64)), jnp.float32) for _ in range(2))
    md = AttentionMetadata(*(jnp.asarray(case.arrays[f]) for f in
                             ("slot_mapping", "kv_lens", "page_indices", "cu_q_lens", "num_seqs")))
    attend = functools.partial(models.attention.paged_attention, sm_scale=0.125, sliding_window=None)
    out_1, kv_1 = jax.jit(attend)(jnp.asarray(q), k, v, kv, md)

    mesh = serving_mesh(tp=tp)
    sharding = attention_spec(2, 64, dtype=jnp.float32, kv_cache_dtype=kv_cache_dtype).sharding(mesh, kv.shape[0])
    kv_tp = QuantizedKV(jax.device_put(kv.values, sharding),
                        jax.device_put(kv.scales, kv_quant.scales_sharding(sharding)))
    with mesh_context(mesh):
        out_tp, kv_tp = jax.jit(functools.partial(attend))(jnp.asarray(q), k, v, kv_tp, md)
    for part in (kv_tp.values, kv_tp.scales):  # heads split at tp=2, replicated at 4
        assert ("tensor" in tuple(part.sharding.spec)) == (tp == 2) and len(part.sharding.device_set) == tp
    np.testing.assert_array_equal(np.asarray(kv_tp.values).view(np.uint8), np.asarray(kv_1.values).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(kv_tp.scales), np.asarray(kv_1.scales))
    np.testing.assert_allclose(np.asarray(out_tp), np.asarray(out_1), atol=1e-6, rtol=1e-6)
    assert np.abs(np.asarray(out_1)).max() > 0.1  # real outputs, not zeros


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_tiny_model_logits_over_a_quantized_cache(tiny, float_cache_run, kv_cache_dtype):
    """192 tokens of held-out text in one prefill (each layer writes its K/V quantised, then reads them back):
    logits within a few percent of the float32 cache's, the same next token almost everywhere."""
    model, ids = tiny
    runner = PagedRunner(model, page_size=16, num_pages=16, max_pages=16, kv_cache_dtype=kv_cache_dtype)
    want, got = float_cache_run[0], runner.token_logits([SeqChunk(ids, 0, runner.alloc(len(ids)))])
    error = np.linalg.norm(got - want) / np.linalg.norm(want)
    agree = np.mean(got.argmax(-1) == want.argmax(-1))
    print(f"tiny model, {kv_cache_dtype} cache: relative logit error {error:.2e}, next token agrees {agree:.1%}")
    assert error < {"int8": 0.005, "fp8_e4m3": 0.02}[kv_cache_dtype] and agree >= 0.95


def test_granularity_on_the_tiny_models_real_keys_and_values(tiny, float_cache_run):
    """The attention-output error of each granularity (`cases.kv_granularity_errors`) on the q / K / V each of the
    tiny model's layers computes over held-out text (captured from the float32 cache's prefill), averaged over the
    layers."""
    model, ids = tiny
    captured = float_cache_run[1]
    assert len(captured) == model.config.num_layers and captured[0][1].shape[0] == len(ids)
    errors = [kv_granularity_errors(q.reshape(len(ids), k.shape[1], -1, q.shape[-1]), k, v) for q, k, v in captured]
    mean = {name: float(np.mean([e[name] for e in errors])) for name in errors[0]}
    print("tiny model q/K/V", {name: f"{e:.2e}" for name, e in mean.items()})  # docs/attention.md (pytest -s)
    assert mean["int8, per token and head (kv_quant)"] < 0.8 * mean["int8, per tensor (absmax)"]
    assert mean["fp8_e4m3, per token and head (kv_quant)"] <= mean["fp8_e4m3, per tensor (absmax)"]
