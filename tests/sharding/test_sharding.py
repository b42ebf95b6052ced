"""Tensor and expert parallelism on the 8 fake CPU devices: every layout gives the single-device engine's
logits (float32 tolerance) and greedy tokens (tp: seeded sampling and logprobs too); hot-expert replicas lower the
per-device load variance."""
import dataclasses

import numpy as np
import pytest
import transformers as tf

from serving.core.batch import SeqChunk
from serving.core.config import EngineConfig
from serving.core.engine import Engine
from serving.core.request import Request
from serving.core.sampling_params import SamplingParams
from tests.support import hf_models

PROMPTS = [hf_models.random_prompt(n, 160, seed=n) for n in (5, 17, 40, 3, 26)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharding")
    common = {**hf_models.COMMON, "hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 2}
    return {
        # 8 query heads, 2 KV heads: TP 4 and 8 replicate the KV heads.
        "llama": hf_models.save_config(tf.LlamaConfig(**common), root / "llama"),
        # 4 layers, so that 4 pipeline stages hold one layer each.
        "llama4": hf_models.save_config(tf.LlamaConfig(**{**common, "num_hidden_layers": 4}), root / "llama4"),
        "mixtral": hf_models.save_config(tf.MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2),
                                          root / "mixtral"),
        "qwen2_moe": hf_models.save_config(tf.Qwen2MoeConfig(
            **common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
            shared_expert_intermediate_size=64), root / "qwen2_moe"),
        # Phi-4-mini's shape: fused qkv_proj / gate_up_proj split at load, longrope over 3/4 of each head.
        "phi3": hf_models.save_config(tf.Phi3Config(
            **common, original_max_position_embeddings=128, rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.1, 1.3, 1.8, 2.5, 3.0], "long_factor": [2.0] * 6}), root / "phi3"),
        # Gemma 3: local (window 12) and global layers, the local ones on the hybrid KV cache's window pool.
        "gemma3": hf_models.save_config(tf.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=24, sliding_window=12,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"]), root / "gemma3"),
    }


def _engine(path, **kw):
    return Engine(EngineConfig(model=path, page_size=8, num_pages=64, max_num_seqs=8, max_num_batched_tokens=64,
                               min_token_bucket=64,
                               enable_prefix_caching=False, **kw))


def _prompt_logits(engine):
    """The last-token logits of two prompts prefilled together, their pages from the engine's block manager (a
    hybrid KV cache's window pages too)."""
    bm, requests = engine.scheduler.block_manager, []
    for i, p in enumerate(PROMPTS[:2]):
        requests.append(Request(f"p{i}", p, GREEDY, arrival_time=0.0))
        assert bm.allocate(requests[-1], len(p))
    chunks = [SeqChunk(r.token_ids, 0, r.block_table) for r in requests]
    logits, _ = engine.runner.run_forward(engine.runner.step_batch(chunks, 64, 8))
    for r in requests:
        bm.free(r)
    return np.asarray(logits)[:2]


def _greedy(engine, prompts=PROMPTS):
    """Each prompt's greedy tokens, all prompts run together; no KV page left behind."""
    outs = {}
    for i, p in enumerate(prompts):
        engine.add_request(engine.make_request(f"r{i}", p, GREEDY))
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    for e in getattr(engine, "replicas", [engine]):
        e.scheduler.block_manager.check_idle()
    return [outs[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def reference(models):
    ref = {}
    for name, path in models.items():
        eng = _engine(path)
        ref[name] = (_prompt_logits(eng), _greedy(eng))  # the pages _prompt_logits took are free again
    return ref


LAYOUTS = [("llama", dict(tp=2)), ("llama", dict(tp=4)), ("llama", dict(tp=8)),
           ("mixtral", dict(ep=2)), ("mixtral", dict(ep=4)), ("mixtral", dict(ep=8)),
           ("qwen2_moe", dict(ep=2)), ("qwen2_moe", dict(ep=4)), ("qwen2_moe", dict(ep=8)),
           ("mixtral", dict(tp=2, ep=2)), ("qwen2_moe", dict(tp=2, ep=4)), ("phi3", dict(tp=2)),
           ("gemma3", dict(tp=2))]


@pytest.mark.parametrize("name, layout", LAYOUTS, ids=[f"{n}-" + "-".join(f"{k}{v}" for k, v in l.items())
                                                       for n, l in LAYOUTS])
def test_layout_matches_single_device(models, reference, name, layout):
    engine = _engine(models[name], **layout)
    if "tp" in layout:
        q = engine.runner.state["layers"][0]["self_attn"]["q_proj"].get_value()
        assert q.sharding.spec[1] == "tensor" and len(q.sharding.device_set) == layout["tp"] * layout.get("ep", 1)
        kv_spec = engine.runner.kv_caches[0].sharding.spec
        assert (kv_spec[2] == "tensor") == (2 % layout["tp"] == 0)  # 2 KV heads: split only at tp=2
    if "ep" in layout:
        w = engine.runner.state["layers"][0]["mlp"]["gate_proj"].get_value()
        assert w.sharding.spec[0] == "expert"
        assert w.addressable_shards[0].data.shape[0] == 8 // layout["ep"]
    logits_ref, tokens_ref = reference[name]
    np.testing.assert_allclose(_prompt_logits(engine), logits_ref, atol=1e-4, rtol=1e-4)
    assert _greedy(_engine(models[name], **layout)) == tokens_ref


SAMPLED = [SamplingParams(temperature=1.0, seed=1, logprobs=5), SamplingParams(temperature=0.8, top_k=10, seed=2),
           SamplingParams(temperature=1.0, top_p=0.8, seed=3, logprobs=2),
           SamplingParams(temperature=1.2, min_p=0.1, seed=4),
           SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3,
                          seed=5, logprobs=3)]


def _sampled(engine):
    outs = {}
    for i, (p, params) in enumerate(zip(PROMPTS, SAMPLED)):
        params = dataclasses.replace(params, max_tokens=10, ignore_eos=True)
        engine.add_request(engine.make_request(f"s{i}", p, params))
    while engine.has_unfinished():
        for o in engine.step():
            tokens, logprobs = outs.setdefault(o.request_id, ([], []))
            tokens.extend(o.new_token_ids)
            logprobs.extend((lp.token_id, lp.logprob, lp.top) for lp in o.logprobs or ())
    return [outs[f"s{i}"] for i in range(len(SAMPLED))]


@pytest.fixture(scope="module")
def sampled_reference(models):
    return _sampled(_engine(models["llama"]))


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_sampling_matches_single_device(models, sampled_reference, tp):
    """Seeded temperature / top-k / top-p / min-p / penalty sampling and logprobs on the vocabulary-sharded
    logits (per-shard candidates merged, no gather): the single-device tokens, logprobs within tolerance."""
    reference = sampled_reference
    got = _sampled(_engine(models["llama"], tp=tp))
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, reference):
        assert tokens == ref_tokens
        assert [(t, [i for i, _ in top]) for t, _, top in logprobs] == \
            [(t, [i for i, _ in top]) for t, _, top in ref_logprobs]
        np.testing.assert_allclose([lp for _, lp, _ in logprobs], [lp for _, lp, _ in ref_logprobs], atol=1e-4)
        np.testing.assert_allclose([[v for _, v in top] for _, _, top in logprobs],
                                   [[v for _, v in top] for _, _, top in ref_logprobs], atol=1e-4)
    assert sum(len(lp) for _, lp in got) == 3 * 10


def test_hot_expert_replicas_lower_device_load_variance(models, reference):
    """A workload of repeated tokens routes most pairs to a few experts; rebalancing into 4 spare slots must
    cut the variance of tokens per device, and outputs stay identical."""
    engine = _engine(models["mixtral"], ep=4, spare_expert_slots=4)
    skewed = [[7] * 40, [7] * 30 + [9] * 5, [11] * 35, [7] * 12]

    def run():
        engine.reset_expert_load()
        return _greedy(engine, skewed), engine.expert_device_load()

    tokens_before, load_before = run()
    predicted = engine.rebalance_experts()
    tokens_after, load_after = run()
    assert tokens_after == tokens_before
    var_before = load_before.var(axis=1).mean()
    var_after = load_after.var(axis=1).mean()
    print(f"per-device token variance {var_before:.1f} -> {var_after:.1f} (predicted {predicted})")
    assert load_before.sum() == load_after.sum()
    assert var_after < 0.5 * var_before
    assert _greedy(engine) == reference["mixtral"][1]


@pytest.mark.parametrize("layout", [dict(dp=2), dict(dp=2, tp=2), dict(dp=4, tp=2)])
def test_data_parallel_replicas(models, reference, layout):
    """Independent replicas on the 'data' axis, each with its own sequences, give the single-device outputs."""
    from serving.core.data_parallel import DataParallelEngine
    engine = DataParallelEngine(EngineConfig(model=models["llama"], page_size=8, num_pages=128, max_num_seqs=8,
                                             max_num_batched_tokens=64, min_token_bucket=64,
                                             enable_prefix_caching=False, **layout))
    devices = [set(r.devices) for r in engine.replicas]
    assert len(devices) == layout["dp"] and all(len(d) == layout.get("tp", 1) for d in devices)
    assert not set.intersection(*devices)
    tokens = _greedy(engine)
    assert tokens == reference["llama"][1]
    for r in engine.replicas:
        assert r.step_count > 0  # every replica served some of the requests


@pytest.mark.parametrize("name, layout", [("llama", dict(pp=2)), ("llama4", dict(pp=4)), ("llama4", dict(pp=2, tp=2)),
                                          ("llama", dict(pp=2, micro_batches=4))])
def test_pipeline_parallel(models, reference, name, layout):
    """Stages over 'pipeline' with micro-batches: the single-device logits and greedy tokens."""
    from sharding.pipeline import bubble_fraction
    cfg = EngineConfig(model=models[name], page_size=8, num_pages=64, max_num_seqs=8, max_num_batched_tokens=64,
                       min_token_bucket=64, enable_prefix_caching=False, **layout)
    engine = Engine(cfg)
    pp = layout["pp"]
    m = layout.get("micro_batches", pp)
    assert engine.bubble_fraction == bubble_fraction(pp, m) == (pp - 1) / (m + pp - 1)
    kv = engine.runner.kv_caches[0]
    assert kv.sharding.spec[0] == "pipeline" and kv.addressable_shards[0].data.shape[0] == 1
    w = engine.runner.state["slots"][0]["self_attn"]["q_proj"].get_value()
    assert w.shape[0] == pp and w.sharding.spec[0] == "pipeline"
    if name not in reference:
        eng = _engine(models[name])
        reference[name] = (_prompt_logits(eng), _greedy(_engine(models[name])))
    logits_ref, tokens_ref = reference[name]
    np.testing.assert_allclose(_prompt_logits(engine), logits_ref, atol=1e-4, rtol=1e-4)
    assert _greedy(Engine(cfg)) == tokens_ref


QUANT_LAYOUTS = [("llama", dict(tp=2)), ("llama", dict(tp=4)), ("mixtral", dict(ep=2)), ("llama", dict(pp=2)),
                 ("qwen2_moe", dict(tp=2, ep=2)), ("llama", dict(tp=2, kv_cache_dtype="fp8_e4m3"))]


@pytest.fixture(scope="module")
def quantized_reference():
    """(model, kv_cache_dtype) -> the single-device quantized engine's (logits, greedy tokens), each computed once."""
    return {}


@pytest.mark.parametrize("name, layout", QUANT_LAYOUTS, ids=[f"{n}-" + "-".join(f"{k}{v}" for k, v in l.items())
                                                             for n, l in QUANT_LAYOUTS])
def test_quantized_layout_matches_single_device(models, quantized_reference, name, layout, monkeypatch):
    """int8 weights (scales sharded with them) and an int8 (or fp8) KV cache: every layout gives the single-device
    quantized engine's logits and greedy tokens. The single device's native int8 kernel widens the weights (exact
    products, as XLA's dot on the mesh), not its int8 dot method (activations in two int8 digits): a K/V row that
    differs in the last bits can round to another int8 step."""
    monkeypatch.setenv("MESHSERVE_INT8_KERNEL", "widen")
    layout = dict(layout)
    quant = dict(quantization="int8", kv_cache_dtype=layout.pop("kv_cache_dtype", "int8"))
    key = (name, quant["kv_cache_dtype"])
    if key not in quantized_reference:
        single = _engine(models[name], **quant)
        quantized_reference[key] = _prompt_logits(single), _greedy(single)
    ref_logits, ref_tokens = quantized_reference[key]
    engine = _engine(models[name], **quant, **layout)
    attn = engine.runner.state["slots" if "pp" in layout else "layers"][0]["self_attn"]
    if "tp" in layout:
        q, s = attn["q_proj"].get_value(), attn["q_proj_scale"].get_value()
        assert q.dtype == np.int8 and q.sharding.spec[1] == "tensor" and s.sharding.spec[0] == "tensor"
    kv = engine.runner.kv_caches[0]
    assert kv.kv_cache_dtype == quant["kv_cache_dtype"] and kv.scales.shape == kv.values.shape[:-1]
    if "tp" in layout:
        head_axis = kv.values.ndim - 2
        assert kv.scales.sharding.spec[head_axis] == kv.values.sharding.spec[head_axis]
    if "pp" in layout:
        s = attn["q_proj_scale"].get_value()
        assert attn["q_proj"].get_value().dtype == np.int8 and s.sharding.spec[0] == "pipeline"
    if "ep" in layout:
        s = engine.runner.state["layers"][0]["mlp"]["gate_proj_scale"].get_value()
        assert s.sharding.spec[0] == "expert" and s.addressable_shards[0].data.shape[0] == 8 // layout["ep"]
    np.testing.assert_allclose(_prompt_logits(engine), ref_logits, atol=1e-4, rtol=1e-4)
    assert _greedy(_engine(models[name], **quant, **layout)) == ref_tokens
