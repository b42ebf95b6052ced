"""Pipeline stages of any count on the 8 fake CPU devices: the layer split (`stage_layers`), uneven stages whose
padding slots are no-ops, micro-batch counts that do not divide the step; greedy tokens identical to HF transformers
and to pp=1, and the memory ledger's per-stage slots equal to what the runner allocates on each device."""
import jax
import numpy as np
import pytest
import transformers as tf

from serving.core.config import EngineConfig
from serving.core.engine import Engine
from serving.core.sampling_params import SamplingParams
from serving.ledger import Layout, ModelMemory
from sharding import pipeline
from tests.support import hf_models

# 471 tokens in all: the first step of the default settings is the 512 bucket, which 3 micro-batches do not divide.
PROMPTS = [hf_models.random_prompt(n, 160, seed=n) for n in (5, 17, 40, 3, 26, 380)]
STEPS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)


@pytest.mark.parametrize("num_layers, num_stages, sizes", [
    (61, 2, [31, 30]), (80, 3, [27, 27, 26]), (5, 3, [2, 2, 1]), (4, 3, [2, 1, 1]), (5, 2, [3, 2]),
    (8, 4, [2, 2, 2, 2]), (3, 3, [1, 1, 1]), (7, 1, [7])])
def test_stage_layers_as_even_as_possible(num_layers, num_stages, sizes):
    stages = pipeline.stage_layers(num_layers, num_stages)
    assert [len(s) for s in stages] == sizes
    assert [i for s in stages for i in s] == list(range(num_layers))  # contiguous, in order, each layer once
    assert pipeline.stage_slots(stages) == sizes[0]
    active = pipeline.active_slots(stages)
    assert active.shape == (num_stages, sizes[0]) and active.sum(axis=1).tolist() == sizes


@pytest.mark.parametrize("num_layers, num_stages", [(2, 3), (4, 0)])
def test_stage_layers_rejects_more_stages_than_layers(num_layers, num_stages):
    with pytest.raises(ValueError, match=f"pipeline parallelism {num_stages} needs 1 .. {num_layers} stages"):
        pipeline.stage_layers(num_layers, num_stages)


@pytest.fixture(scope="module")
def llama5(tmp_path_factory):
    """A 5-layer Llama (2 + 2 + 1 on 3 stages, 3 + 2 on 2) and its HF greedy tokens, which pp=1 gives too."""
    path = hf_models.save_config(tf.LlamaConfig(**{**hf_models.COMMON, "num_hidden_layers": 5}),
                                 tmp_path_factory.mktemp("pipeline") / "llama5")
    hf = tf.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    expected = [hf_models.hf_greedy(hf, p, STEPS) for p in PROMPTS]
    assert _greedy(Engine(EngineConfig(model=path))) == expected
    return path, expected


def _greedy(engine, prompts=PROMPTS):
    outs = {}
    for i, p in enumerate(prompts):
        engine.add_request(engine.make_request(f"r{i}", p, GREEDY))
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    engine.scheduler.block_manager.check_idle()
    return [outs[f"r{i}"] for i in range(len(prompts))]


def _poison_padding_slots(runner) -> None:
    """NaN in every padding slot's float weights (zeros alone would make the layer an identity that writes zero
    K/V): the tokens stay exact only if a padding slot's output and K/V are really dropped."""
    active = runner.slot_plan.active

    def poison(j, a):
        host = np.array(a)
        if np.issubdtype(host.dtype, np.floating):
            host[~active[:, j]] = np.nan
        return jax.device_put(host, a.sharding)

    slots = [jax.tree.map(lambda a, j=j: poison(j, a), slot) for j, slot in enumerate(runner.state["slots"])]
    runner.state = dict(runner.state, slots=slots)


def _bytes_per_stage(arrays) -> dict:
    """{device: (stage, bytes)} of stage-stacked arrays ([pp, ...] sharded over 'pipeline')."""
    out = {}
    for a in arrays:
        for shard in a.addressable_shards:
            stage = shard.index[0].start or 0
            prev = out.get(shard.device, (stage, 0))
            assert prev[0] == stage
            out[shard.device] = (stage, prev[1] + shard.data.nbytes)
    return out


# pp=3 with every default (buckets, micro-batches, pages); the small settings of tests/sharding/test_sharding.py
# with 3 micro-batches in a 64-token bucket, and pp x tp.
SMALL = dict(page_size=8, num_pages=160, max_num_seqs=8, max_num_batched_tokens=64, min_token_bucket=64,
             enable_prefix_caching=False)
LAYOUTS = {"pp3-defaults": dict(pp=3), "pp2-m3": dict(SMALL, pp=2, micro_batches=3),
           "pp3-tp2": dict(SMALL, pp=3, tp=2)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_uneven_stages_match_hf_and_pp1(llama5, layout):
    path, expected = llama5
    options = LAYOUTS[layout]
    engine = Engine(EngineConfig(model=path, **options))
    runner, pp = engine.runner, options["pp"]
    assert [len(s) for s in runner.stages] == {2: [3, 2], 3: [2, 2, 1]}[pp]
    if layout == "pp3-defaults":
        assert runner.num_micro == 3 and 512 in runner.buckets  # a bucket the micro-batches do not divide
    _poison_padding_slots(runner)
    assert _greedy(engine) == expected  # = pp=1's (the fixture checks)

    # Padding slots (slot 2 of stage 1 on pp=2, slot 1 of stage 2 on pp=3) wrote no KV (NaN K/V if they had).
    active = runner.slot_plan.active
    assert (active == pipeline.active_slots(runner.stages)).all()  # one kind of layer: the longest stage's slots
    for j, kv in enumerate(runner.kv_caches):
        for shard in kv.addressable_shards:
            stage = shard.index[0].start or 0
            assert bool(np.any(np.asarray(shard.data))) == active[stage, j], (stage, j)

    # The ledger's per-device bytes of every stage (real layers plus padding slots) are what the runner allocated.
    layout_ = Layout(pp=pp, tp=options.get("tp", 1))
    mm = ModelMemory(runner.model_config, "float32")
    assert [mm.stage_padding_layers(layout_, s) for s in range(pp)] == [0] * (pp - 1) + [1]
    weights = _bytes_per_stage(jax.tree.leaves(runner.state["slots"]))
    kv = _bytes_per_stage(runner.kv_caches)
    assert len(weights) == len(kv) == pp * options.get("tp", 1)
    for device, (stage, nbytes) in weights.items():
        assert nbytes == mm.stage_layer_weight_bytes(layout_, stage), device
        assert kv[device] == (stage, runner.num_pages * runner.config.page_size
                              * mm.stage_kv_bytes_per_token(layout_, stage)), device


@pytest.mark.parametrize("platform, kernel", [("gpu", "ragged_paged_attention_triton"), ("tpu", "tpu_custom_call")])
def test_uneven_pp3_forward_lowers_for_accelerators(llama5, platform, kernel):
    """pp=3 with its default micro-batches on an accelerator's buckets (8 and 16 rows, neither divisible by 3): every
    forward of the warm-up plan lowers from this host with the platform's attention kernel, the token rows the
    bucket's (the micro-batch padding stays inside the program)."""
    from serving.core.platform import cpu_only_pieces
    engine = Engine(EngineConfig(model=llama5[0], platform=platform, dtype="bfloat16", pp=3, page_size=16,
                                 num_pages=32, max_num_seqs=8, max_num_batched_tokens=16, compilation_cache_dir=""))
    forwards = [p for p in engine.warmup_plan() if p.kind == "forward"]
    assert [p.tokens for p in forwards] == engine.runner.buckets == {"gpu": [8, 16], "tpu": [16]}[platform]
    assert all(t % 3 for t in engine.runner.buckets)
    for program in forwards:
        text = engine.runner.lower(engine.runner.trace_program(program)).as_text()
        assert kernel in text and not cpu_only_pieces(text), program.name
        assert f"tensor<{program.tokens}xi32>" in text, program.name


@pytest.mark.parametrize("kinds, stages, slots, padding", [
    # DeepSeek-V3: 3 dense layers, then 58 MoE, on 2 stages (31 + 30): 3 dense + 30 MoE slots
    ("D" * 3 + "M" * 58, 2, "D" * 3 + "M" * 30, [2, 3]),
    ("D" + "M" * 3, 2, "DMM", [1, 1]),
    ("M" * 5, 3, "MM", [0, 0, 1]),  # one kind: the longest stage's slots, the short stage padding its last
    ("DMDMDM", 2, "DMDM", [1, 1]),  # every other layer MoE (moe_layer_freq 2): 3 + 3 -> DMD + MDM
])
def test_slots_of_layers_of_several_kinds(kinds, stages, slots, padding):
    plan = pipeline.plan_slots(pipeline.stage_layers(len(kinds), stages), list(kinds))
    assert "".join(kinds[plan.slot_layer(j)] for j in range(plan.num_slots)) == slots
    assert [plan.padding(s) for s in range(stages)] == padding
    for s, layers in enumerate(pipeline.stage_layers(len(kinds), stages)):
        row = plan.slot_layers[s]
        assert [i for i in row if i is not None] == list(layers)  # every layer once, in order
        assert all(i is None or kinds[i] == slots[j] for j, i in enumerate(row))  # on a slot of its kind


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """DeepSeek-V3's shape with 4 layers (a dense one, then MoE: slots D, M, M on 2 stages) and a 3-layer Mixtral, each
    with its HF greedy tokens, which pp=1 gives too."""
    root = tmp_path_factory.mktemp("pipeline_moe")
    deepseek = hf_models.family_configs()["deepseek_v3"]()
    deepseek.num_hidden_layers = 4
    gpt_oss = hf_models.family_configs()["gpt_oss"]()  # sliding and full layers: slots of each kind, all pages
    gpt_oss.num_hidden_layers, gpt_oss.layer_types = 4, ["sliding_attention", "full_attention"] * 2
    configs = {"deepseek_v3": deepseek,
               "mixtral": tf.MixtralConfig(**{**hf_models.COMMON, "num_hidden_layers": 3}, num_local_experts=4,
                                           num_experts_per_tok=2),
               "gpt_oss": gpt_oss}
    out = {}
    for name, config in configs.items():
        path = hf_models.save_config(config, root / name)
        hf = tf.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        expected = [hf_models.hf_greedy(hf, p, STEPS) for p in PROMPTS[:4]]
        assert _greedy(Engine(EngineConfig(model=path, **SMALL)), PROMPTS[:4]) == expected
        out[name] = (path, expected)
    return out


@pytest.mark.parametrize("name, layout", [("deepseek_v3", dict(pp=2)), ("mixtral", dict(pp=3, ep=2)),
                                          ("deepseek_v3", dict(pp=2, tp=2, ep=2)), ("gpt_oss", dict(pp=2, ep=2))])
def test_moe_models_take_pipeline_parallelism(moe_models, name, layout):
    """pp x ep (x tp) for MoE models: HF's greedy tokens (= pp=1's); layers of two kinds (DeepSeek's dense first
    layer) on slots of their kind, padding slots exact no-ops (NaN weights dropped, no KV written); the expert load
    still counted; the ledger's per-device bytes what the runner allocated."""
    path, expected = moe_models[name]
    engine = Engine(EngineConfig(model=path, **SMALL, **layout))
    runner = engine.runner
    assert runner.slot_plan.num_slots == {"deepseek_v3": 3, "mixtral": 1, "gpt_oss": 2}[name]
    _poison_padding_slots(runner)
    assert _greedy(engine, PROMPTS[:4]) == expected
    load = runner.expert_load()
    assert load.shape[0] == len(runner.moe_layer_indices()) and load.sum() > 0
    assert (load.sum(axis=1) == load.sum(axis=1)[0]).all()  # every MoE layer saw every token's top-k
    active = runner.slot_plan.active
    for j, kv in enumerate(runner.kv_caches):
        for shard in kv.addressable_shards:
            stage = shard.index[0].start or 0
            assert bool(np.any(np.asarray(shard.data))) == active[stage, j], (stage, j)
    layout_ = Layout(pp=layout["pp"], tp=layout.get("tp", 1), ep=layout.get("ep", 1))
    mm = ModelMemory(runner.model_config, "float32")
    weights = _bytes_per_stage(jax.tree.leaves(runner.state["slots"]))
    for device, (stage, nbytes) in weights.items():
        routing = sum(np.asarray(a).nbytes // layout["pp"] for a in jax.tree.leaves(runner.state["slots"])
                      if a.dtype == np.int32)  # the expert maps: routing state, not weights
        assert nbytes - routing == mm.stage_layer_weight_bytes(layout_, stage), device
    with pytest.raises(ValueError, match="rebalance_experts is not implemented under pipeline parallelism"):
        runner.rebalance_experts()


def test_sliding_window_and_global_layers_take_pipeline_parallelism(tmp_path):
    """Gemma 3's sliding-window and global layers (their own RoPE each) under pp: slots of each kind, every layer's
    cache holding all pages (the hybrid cache is off under pp), the sliding layers reading their window from them:
    HF's greedy tokens."""
    path = str(tmp_path / "gemma3")
    hf = hf_models.save_hf_model("gemma3", path)
    engine = Engine(EngineConfig(model=path, **SMALL, pp=2))
    assert not engine.runner.window_pages and engine.runner.slot_plan.num_slots == 2  # [S F] [S]: an S and an F slot
    assert _greedy(engine, PROMPTS[:4]) == [hf_models.hf_greedy(hf, p, STEPS) for p in PROMPTS[:4]]
