"""GPT-OSS against HF transformers' GptOssForCausalLM, torch CPU, float32: prompt logits whole and in 5-token chunks
beside another sequence, 32 greedy steps of three staggered sequences through the paged cache, a prompt past the
sliding window, TP=2 x EP=2 on the fake devices through the engine's hybrid KV cache (its window pool's pages
asserted); sinks and the SwiGLU clamp shown to matter; the config's fields and refusals."""
import numpy as np
import pytest

from models.config import ModelConfig, UnsupportedModelError
from models.weights import load_hf_model
from serving.core.batch import SeqChunk
from serving.core.config import EngineConfig
from serving.core.engine import Engine
from serving.core.hybrid_block_manager import HybridBlockManager
from serving.core.sampling_params import SamplingParams
from tests.support import hf_models
from tests.support.paged_runner import PagedRunner

PROMPT_LEN, DECODE_STEPS, WINDOW = 40, 32, 12  # the test config's window (tests/support/hf_models.py "gpt_oss")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("gpt_oss") / "gpt_oss")
    hf = hf_models.save_hf_model("gpt_oss", d)
    return d, hf


def _prompt():
    return hf_models.random_prompt(PROMPT_LEN, 160, seed=1)


def test_prompt_logits_match_hf(gpt_oss):
    path, hf = gpt_oss
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.sliding_windows == (WINDOW, None) and cfg.rope.rope_type == "yarn"  # the prompt runs past both
    prompt = _prompt()
    ref = hf_models.hf_logits(hf, prompt)
    model = load_hf_model(path)
    assert float(np.min(np.abs(np.asarray(model.layers[0].self_attn.sinks[...])))) > 0
    runner = PagedRunner(model, page_size=8)
    err, err_chunked = runner.prefill_errors(prompt, ref)
    print(f"PARITY gpt_oss: max |logit diff| full prefill {err:.2e}, chunked {err_chunked:.2e}")
    assert err < 1e-4 and err_chunked < 1e-4
    # the sinks matter: a sink of -1e30 adds nothing to the denominator (as no sink), and the logits move off HF's
    sinks = runner.state["layers"][0]["self_attn"]["sinks"]
    sinks.set_value(sinks.get_value() * 0 - 1e30)
    without = runner.token_logits([SeqChunk(prompt, 0, runner.alloc(PROMPT_LEN))])
    assert np.max(np.abs(without - ref)) > 1e-3


def test_clamped_swiglu_matches_hf():
    """The experts' gated unit against HF's GptOssExperts._apply_gate on values either side of the limit (the parity
    test's limit 0.5 sits inside its gate and up values' range); the unclamped SwiGLU differs."""
    import jax.numpy as jnp
    import torch
    import transformers as tf
    from pallas_kernels.moe import glu
    cfg = hf_models.family_configs()["gpt_oss"]()
    experts = tf.models.gpt_oss.modeling_gpt_oss.GptOssExperts(cfg)
    gate_up = torch.linspace(-3, 3, 2 * 97).reshape(1, -1)[:, torch.randperm(2 * 97, generator=torch.Generator()
                                                                                  .manual_seed(0))]
    want = experts._apply_gate(gate_up).numpy()
    g, u = jnp.asarray(gate_up[:, ::2].numpy()), jnp.asarray(gate_up[:, 1::2].numpy())
    np.testing.assert_allclose(np.asarray(glu(g, u, (cfg.swiglu_alpha, cfg.swiglu_limit))), want, atol=1e-6)
    assert np.max(np.abs(np.asarray(glu(g, u, (cfg.swiglu_alpha, 1e9))) - want)) > 0.1


def _engine(path, **options):
    options = {"page_size": 4, "num_pages": 64, "max_num_seqs": 4, "max_num_batched_tokens": 16,
               "max_prefill_chunk": 8, "min_token_bucket": 16, "compilation_cache_dir": "", **options}
    return Engine(EngineConfig(model=path, **options))


def _run(engine, prompts, steps, held):
    """Greedy tokens of each prompt, prompt i added at step i (staggered: prefill chunks beside decodes)."""
    outs, step = {}, 0
    while step < len(prompts) or engine.has_unfinished():
        if step < len(prompts):
            engine.add_request(engine.make_request(f"r{step}", prompts[step], SamplingParams(
                temperature=0.0, max_tokens=steps, ignore_eos=True)))
        step += 1
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        engine.scheduler.check_invariants()
        held.append(engine.scheduler.block_manager.pages_held())
    engine.scheduler.block_manager.check_idle()
    return [outs[f"r{i}"] for i in range(len(prompts))]


def test_greedy_through_the_engine_tp2_ep2(gpt_oss):
    """Three staggered prompts, two past the window, 32 greedy steps through the engine at TP=2 x EP=2 on the fake
    devices (8-token prefill chunks beside decodes, the sliding layer on the hybrid KV cache's window pool): HF
    generate's tokens (as TP=1's prompt logits are HF's within 1e-4 above), the window pool holding only each
    sequence's window as it slides."""
    path, hf = gpt_oss
    prompts = [hf_models.random_prompt(n, 160, seed=s) for n, s in ((PROMPT_LEN, 2), (33, 3), (7, 4))]
    engine = _engine(path, tp=2, ep=2)
    bm = engine.scheduler.block_manager
    assert isinstance(bm, HybridBlockManager) and [p.window for p in bm.pools] == [WINDOW]
    sinks = engine.runner.state["layers"][0]["self_attn"]["sinks"].get_value()
    assert sinks.sharding.spec[0] == "tensor"
    gate = engine.runner.state["layers"][0]["mlp"]["gate_bias"].get_value()
    assert gate.addressable_shards[0].data.shape == (2, 32)  # 4 experts over ep=2, 64 columns over tp=2
    held = []
    assert _run(engine, prompts, DECODE_STEPS, held) == [hf_models.hf_greedy(hf, p, DECODE_STEPS) for p in prompts]
    primary, window = zip(*held)
    # the table holds the sequences whole (18 + 17 + 10 pages of 4 at most); the window pool at most each
    # sequence's window (ceil(11 / 4) + 1 = 4 pages) plus an 8-token chunk's 2
    assert max(primary) >= 40 and max(window) <= 3 * 6 and 2 * window[-2] < primary[-2]


def _config(**over):
    base = hf_models.family_configs()["gpt_oss"]().to_dict()
    base["architectures"] = ["GptOssForCausalLM"]
    return {**base, **over}


def test_config_reads_gpt_oss_fields():
    cfg = ModelConfig.from_hf(_config())
    assert (cfg.family, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == ("gpt_oss", 4, 2, 64)
    assert cfg.attention_sinks and cfg.router_bias and cfg.expert_bias and cfg.qkv_bias and cfg.o_bias
    assert (cfg.swiglu_alpha, cfg.swiglu_limit, cfg.norm_topk_prob) == (1.702, 0.5, True)
    assert all(cfg.moe_layers)
    with pytest.raises(UnsupportedModelError, match="swiglu_limit=0.0"):
        ModelConfig.from_hf(_config(swiglu_limit=0.0))


def _random_mxfp4(rng, *shape):
    """Random MXFP4 blocks [..., N, G, 16] and scales [..., N, G] (scales 2^-4 .. 2^3)."""
    blocks = rng.integers(0, 256, size=shape + (16,), dtype=np.uint8)
    return blocks, rng.integers(127 - 4, 127 + 4, size=shape, dtype=np.uint8)


def test_mxfp4_dequantizes_as_transformers():
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from models.mxfp4 import dequantize_mxfp4
    blocks, scales = _random_mxfp4(np.random.default_rng(0), 3, 10, 4)  # 3 experts, N 10, K 4 x 32
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    got = dequantize_mxfp4(blocks, scales)
    assert got.shape == (3, 128, 10)
    np.testing.assert_array_equal(got, want.numpy())
    with pytest.raises(ValueError, match="do not fit scales"):
        dequantize_mxfp4(blocks, scales[..., :3])


def test_mxfp4_checkpoint_loads_as_its_dequantized_experts(gpt_oss, tmp_path):
    """The test model's experts as MXFP4 blocks + scales (config quant_method mxfp4) load to the same parameters as
    a float checkpoint holding transformers' dequantization of them."""
    import json
    import shutil
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    path, _ = gpt_oss
    tensors = load_file(f"{path}/model.safetensors")
    rng = np.random.default_rng(1)
    packed, dense = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, n = tensors[name].shape
        blocks, scales = _random_mxfp4(rng, e, n, k // 32)
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        dense[name] = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                 dtype=torch.float32).numpy()
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    dirs = {}
    for kind, tensors_of_kind, extra in (("mxfp4", packed, {"quantization_config": {"quant_method": "mxfp4"}}),
                                         ("float", dense, {})):
        d = tmp_path / kind
        d.mkdir()
        save_file(tensors_of_kind, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps({**config, **extra}))
        dirs[kind] = str(d)
    assert ModelConfig.from_pretrained(dirs["mxfp4"]).mxfp4_experts
    a, b = load_hf_model(dirs["mxfp4"]), load_hf_model(dirs["float"])
    for name in ("gate_proj", "up_proj", "down_proj"):
        got, want = (np.asarray(getattr(m.layers[1].mlp, name)[...]) for m in (a, b))
        assert np.abs(want).max() > 1
        np.testing.assert_array_equal(got, want)
    shutil.rmtree(tmp_path)
    with pytest.raises(UnsupportedModelError, match="'mxfp4' for llama"):
        ModelConfig.from_hf({**hf_models.family_configs()["llama"]().to_dict(), "architectures": ["LlamaForCausalLM"],
                             "quantization_config": {"quant_method": "mxfp4"}})
