"""DeepSeek (multi-head latent attention, DeepSeek MoE) over the 8 fake CPU devices: tensor parallelism over the heads
(every device holding the whole latent cache and its heads' W_UK / W_UV) and expert parallelism give the
single-device engine's prompt logits (float32 tolerance) and greedy tokens; what each device holds, as the memory
ledger counts it."""
import numpy as np
import pytest

from serving.core.batch import SeqChunk
from serving.core.config import EngineConfig
from serving.core.engine import Engine
from serving.core.sampling_params import SamplingParams
from serving.ledger import Layout, ModelMemory
from tests.support import hf_models

PROMPTS = [hf_models.random_prompt(n, 160, seed=n) for n in (5, 17, 40, 3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """V3's shape with 8 heads (TP 2 and 4 split them) and 8 experts (EP 2 and 4 split them)."""
    config = hf_models.family_configs()["deepseek_v3"]()
    config.num_attention_heads = 8
    return hf_models.save_config(config, tmp_path_factory.mktemp("mla") / "deepseek_v3")


def _engine(path, **kw):
    return Engine(EngineConfig(model=path, page_size=8, num_pages=64, max_num_seqs=8, max_num_batched_tokens=64,
                               min_token_bucket=64, enable_prefix_caching=False, **kw))


def _prompt_logits(engine):
    chunks = [SeqChunk(p, 0, list(range(i * 6, i * 6 + 6))) for i, p in enumerate(PROMPTS[1:3])]
    logits, _ = engine.runner.run_forward(engine.runner.step_batch(chunks, 64, 8))
    return np.asarray(logits)[:2]


def _greedy(engine):
    outs = {}
    for i, p in enumerate(PROMPTS):
        engine.add_request(engine.make_request(f"r{i}", p, GREEDY))
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    engine.scheduler.block_manager.check_idle()
    return [outs[f"r{i}"] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def reference(model):
    engine = _engine(model)
    return _prompt_logits(engine), _greedy(engine)


LAYOUTS = [dict(tp=2), dict(ep=2), dict(tp=4, ep=2)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "-".join(f"{k}{v}" for k, v in l.items()))
def test_layout_matches_single_device(model, reference, layout):
    engine = _engine(model, **layout)
    runner, tp = engine.runner, layout.get("tp", 1)
    attn = runner.state["layers"][1]["self_attn"]
    if tp > 1:
        # Each device: its heads of q_b_proj, kv_b_proj (W_UK, W_UV) and o_proj; all of kv_a_proj_with_mqa.
        for name, axis in (("q_b_proj", 1), ("kv_b_proj", 1), ("o_proj", 0)):
            w = attn[name].get_value()
            assert w.sharding.spec[axis] == "tensor" and w.addressable_shards[0].data.shape[axis] == 8 // tp, name
        assert attn["kv_a_proj_with_mqa"].get_value().addressable_shards[0].data.shape == (64, 48)
    # The whole latent cache on every device: [pages, page_size, 1, 48], replicated.
    cache = runner.kv_caches[0]
    assert cache.shape == (64, 8, 1, 48)
    assert {s.data.shape for s in cache.addressable_shards} == {cache.shape}
    assert len(cache.addressable_shards) == tp * layout.get("ep", 1)
    if "ep" in layout:
        w = runner.state["layers"][1]["mlp"]["gate_proj"].get_value()
        assert w.sharding.spec[0] == "expert" and w.addressable_shards[0].data.shape[0] == 8 // layout["ep"]
    # The ledger counts the latent cache whole on each device.
    mm = ModelMemory(runner.model_config, "float32")
    per_device = mm.stage_kv_bytes_per_token(Layout(tp=tp, ep=layout.get("ep", 1)), 0)
    assert per_device == mm.kv_bytes_per_token == 2 * 48 * 4
    logits_ref, tokens_ref = reference
    np.testing.assert_allclose(_prompt_logits(engine), logits_ref, atol=1e-4, rtol=1e-4)
    assert _greedy(engine) == tokens_ref  # (requests write their pages before reading them)
