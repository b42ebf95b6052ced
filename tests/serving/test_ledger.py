"""Memory ledger: the source's figures exactly; predicted per-device weight and KV bytes against sharded arrays
really allocated on the 8 fake CPU devices, for every layout the sharding tests use."""
import dataclasses
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from models.config import ModelConfig
from models.kv_cache import init_kv_caches
from models.transformer import kv_cache_specs
from models.weights import abstract_model
from serving import ledger
from serving.ledger import GB, GiB, KiB, Hardware, Layout, ModelMemory, Workload
from sharding.mesh import make_mesh
from sharding.rules import DEFAULT_RULES, MESH_AXES, shard_shape


def test_source_example_kv_figures():
    _, cfg = ledger.load_config("source-example")
    mm = ModelMemory(cfg, "float16")
    assert mm.kv_bytes_per_token == 2 * 32 * 4096 * 2 == 512 * KiB
    work = Workload(concurrency=1000, avg_seq_len=2048, page_size=16)
    per_request = work.pages_per_request * work.page_size * mm.kv_bytes_per_token
    assert per_request == GiB  # "~1 GB per 2048-token request"
    assert 1000 * per_request / 10**12 == pytest.approx(1.07, abs=0.01)  # "1000 concurrent -> ~1 TB"


def test_source_worked_example_exact():
    ex = ledger.WorkedExample()
    assert ex.weights == 140 * GB  # 70B fp16
    assert ex.concurrency * ex.kv_per_request_as_written == 256 * GB
    assert ex.total_as_written == 456 * GB  # 140 + 256 + 60
    assert ex.cards(ex.total_as_written) == 6  # six 80 GB cards
    assert ex.cards(ex.total_exact) == 6  # still six with 1 GiB (not 1 GB) per request: 474.9 GB
    text = ledger.render_worked_example()
    for figure in ("512 KiB", "1 GiB", "140.00 GB", "= 456 GB", "6 cards of 80 GB"):
        assert figure in text


def test_llama3_70b_preset_matches_the_hf_checkpoint():
    _, cfg = ledger.load_config("llama-3-70b")
    mm = ModelMemory(cfg, "bfloat16")
    assert mm.num_params == 70_553_706_496  # the published parameter count
    assert mm.kv_bytes_per_token == 320 * KiB
    hw = Hardware(device_memory=80 * GB, num_devices=8)
    fit, no_fit = ledger.plan_layouts(mm, Workload(256, 2048), hw)
    assert fit[0].layout == Layout(tp=8)  # TP inside the host is fastest when it fits
    assert Layout(dp=8) in {p.layout for p in no_fit}  # 141 GB of weights on one card
    steps = [p.cost.step for p in fit]
    assert steps == sorted(steps)
    pp8 = next(p for p in fit if p.layout == Layout(pp=8))
    assert pp8.cost.bubble_fraction == pytest.approx(7 / 15)  # (pp-1)/(m+pp-1), m = pp


def _mixed_moe_config(**kw):
    hf = dict(architectures=["Qwen2MoeForCausalLM"], hidden_size=64, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=32, vocab_size=256,
              num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=48, mlp_only_layers=[1],
              max_position_embeddings=128, tie_word_embeddings=True)
    return ModelConfig.from_hf({**hf, **kw})


def test_parameter_count_equals_full_abstract_model():
    for cfg in (_mixed_moe_config(), _mixed_moe_config(tie_word_embeddings=False), MOE, DENSE):
        mm = ModelMemory(cfg, "bfloat16")
        state = nnx.state(abstract_model(cfg, jnp.bfloat16), nnx.Param)
        full = sum(math.prod(v.shape) for _, v in nnx.to_flat_state(state))
        assert mm.num_params == full
        assert mm.weight_bytes == 2 * full


DENSE = ModelConfig.from_hf(dict(
    architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, intermediate_size=128, vocab_size=256, max_position_embeddings=128))
DENSE_MHA = ModelConfig.from_hf(dict(
    architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=8, intermediate_size=128, vocab_size=256, max_position_embeddings=128,
    tie_word_embeddings=True))
MOE = ModelConfig.from_hf(dict(
    architectures=["MixtralForCausalLM"], hidden_size=64, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, intermediate_size=64, vocab_size=256, num_local_experts=8, num_experts_per_tok=2,
    max_position_embeddings=128))

# The layouts the sharding tests use: tp 2/4/8, pp 2/3/4 (3: an uneven split, padding slots), ep 2/4/8, tp x pp,
# tp x ep, dp x tp; DENSE has 2 KV heads, so tp 4 and 8 replicate its KV cache and k/v weights.
LAYOUTS = [
    (DENSE, Layout(tp=2)), (DENSE, Layout(tp=4)), (DENSE, Layout(tp=8)), (DENSE_MHA, Layout(tp=8)),
    (DENSE, Layout(pp=2)), (DENSE, Layout(pp=4)), (DENSE_MHA, Layout(pp=2)), (DENSE, Layout(pp=2, tp=2)),
    (DENSE, Layout(pp=2, tp=4)), (DENSE, Layout(dp=2, tp=2)), (DENSE, Layout(dp=2, tp=4)),
    (DENSE, Layout(pp=3)), (DENSE, Layout(pp=3, tp=2)), (DENSE_MHA, Layout(pp=3)),  # 4 layers: 2 + 1 + 1
    (MOE, Layout(ep=2)), (MOE, Layout(ep=4)), (MOE, Layout(ep=8)), (MOE, Layout(tp=2, ep=2)),
    (MOE, Layout(tp=2, ep=4)), (MOE, Layout(tp=4, ep=2)), (MOE, Layout(pp=2, ep=2)), (MOE, Layout(dp=2, tp=2, ep=2)),
]


def _stage_mesh(mesh: Mesh, stage: int) -> Mesh:
    """The devices of one pipeline stage, as a mesh whose 'pipeline' axis has size 1."""
    return Mesh(mesh.devices[:, stage:stage + 1], MESH_AXES)


def _allocate(shapes_and_specs, mesh: Mesh, dtype):
    """The arrays placed on the mesh's devices with their shardings (a shard's shape is the sharding's, however the
    array was made: host zeros put there, no XLA program compiled per layout and stage)."""
    shardings = tuple(NamedSharding(mesh, spec) for _, spec in shapes_and_specs)
    return jax.device_put(tuple(np.zeros(shape, dtype) for shape, _ in shapes_and_specs), shardings)


def _bytes_on(arrays, device) -> int:
    return sum(s.data.nbytes for a in arrays for s in a.addressable_shards if s.device == device)


@pytest.mark.parametrize("cfg,layout", LAYOUTS, ids=[f"{c.family}-{c.num_kv_heads}kv-{l}".replace(" ", ",")
                                                      for c, l in LAYOUTS])
def test_ledger_matches_allocated_arrays(cfg, layout):
    mm = ModelMemory(cfg, "bfloat16")
    work = Workload(concurrency=8, avg_seq_len=40, page_size=16)  # 3 pages per request
    hw = Hardware(device_memory=GB)
    mesh = make_mesh(layout.dp, layout.pp, layout.tp, layout.ep)
    state = nnx.state(abstract_model(cfg, jnp.bfloat16), nnx.Param)
    flat = list(nnx.to_flat_state(state))
    stages = mm.stage_layers(layout)
    pages_per_replica = work.requests_per_replica(layout) * work.pages_per_request
    slots = mm.stage_slots(layout)
    for s, layers in enumerate(stages):
        smesh = _stage_mesh(mesh, s)
        padding = [stages[0][j] for j in range(len(layers), slots)]  # a padding slot is shaped as its slot's layers
        wanted = []
        for path, var in flat:
            if path[0] == "layers":
                copies = (int(path[1]) in layers) + padding.count(int(path[1]))
            else:  # embedding, final norm, LM head: the pipeline runner keeps them on every stage (pipeline_runner.py)
                copies = 1
            axes = var.get_metadata()["axes"]
            wanted += [(tuple(var.shape), DEFAULT_RULES.partition_spec(axes, var.shape, smesh))] * copies
        weights = _allocate(wanted, smesh, jnp.bfloat16)
        # as the runners allocate it: each slot's spec (the model's declaration), its shape and rules' layout
        num_pages = pages_per_replica * layout.dp
        kv = _allocate([(spec.shape(num_pages, work.page_size), spec.partition_spec(dict(smesh.shape), num_pages))
                        for spec in kv_cache_specs(cfg, dtype="bfloat16")[:slots]],  # a buffer per slot, padding too
                       smesh, jnp.bfloat16)
        predicted = ledger.device_ledger(mm, work, layout, hw) if layout.pp == 1 else None
        w_pred = mm.stage_weight_bytes(layout, s)
        kv_pred = (work.requests_per_replica(layout) * work.pages_per_request * work.page_size
                   * mm.stage_kv_bytes_per_token(layout, s))
        if predicted is not None:
            assert (predicted.weights, predicted.kv_cache) == (w_pred, kv_pred)
        for device in smesh.devices.flat:
            w_real, kv_real = _bytes_on(weights, device), _bytes_on(kv, device)
            assert w_pred == pytest.approx(w_real, rel=0.02), (s, device)
            assert kv_pred == pytest.approx(kv_real, rel=0.02), (s, device)
            assert (w_pred, kv_pred) == (w_real, kv_real)  # in fact exact
        del weights, kv


def test_kv_heads_fewer_than_tp_replicate_the_cache():
    kv = ModelMemory(DENSE, "bfloat16").kv_specs[0]  # 2 KV heads
    assert kv.device_heads(Layout(tp=2).axis_sizes) == 1
    assert kv.device_heads(Layout(tp=4).axis_sizes) == 2  # 2 KV heads cannot be split 4 ways
    # checked on the heads, not the 4 rows (K and V of each): 4 rows over 4 devices would split a head's K from its V
    spec = kv.partition_spec({"tensor": 4}, num_pages=10)
    assert shard_shape(spec, kv.shape(10, 16), {"tensor": 4}) == (10, 16, 4, 8)


def test_plan_kv_pages_fills_the_budget():
    mm = ModelMemory(DENSE, "bfloat16")
    layout = Layout(dp=2, tp=2)
    free, total = 50 * 2**20, 64 * 2**20
    pages = ledger.plan_kv_pages(DENSE, dtype="bfloat16", page_size=16, free_bytes=free, total_bytes=total,
                                 mesh_shape=layout.axis_sizes, weights_loaded=False, max_batched_tokens=256,
                                 max_seqs=16)
    assert pages % 2 == 0
    hw = Hardware(device_memory=total)
    fixed = (int(0.05 * total) + mm.stage_weight_bytes(layout, 0)
             + ledger.peak_activation_bytes(mm, layout, 256, 16, hw) + ledger.comm_buffer_bytes(mm, layout, 256, hw))
    per_page = 16 * mm.stage_kv_bytes_per_token(layout, 0)
    per_device = pages // 2
    assert fixed + per_device * per_page <= free < fixed + (per_device + 1) * per_page
    loaded = ledger.plan_kv_pages(DENSE, dtype="bfloat16", page_size=16, free_bytes=free, total_bytes=total,
                                  mesh_shape=layout.axis_sizes, weights_loaded=True, max_batched_tokens=256,
                                  max_seqs=16)
    assert loaded > pages
    with pytest.raises(ValueError, match="no KV page fits"):
        ledger.plan_kv_pages(DENSE, dtype="bfloat16", page_size=16, free_bytes=10_000, mesh_shape={},
                             weights_loaded=True)
    text = ledger.ledger_summary(DENSE, dtype="bfloat16", page_size=16, num_pages=pages, mesh_shape=layout.axis_sizes,
                                 max_batched_tokens=256, max_seqs=16, device_total_bytes=total)
    assert f"{pages // 2} pages x 16 tokens per replica" in text and "GiB" in text


def test_device_memory_falls_back_on_cpu():
    mem = ledger.device_memory()
    assert mem.free > 0 and mem.total >= mem.free and "no memory stats" in mem.source
    assert ledger.device_memory(fallback_bytes=80 * GB).free == 80 * GB
    assert ledger.Layout.of(make_mesh(tp=2, ep=2)) == Layout(tp=2, ep=2)


@pytest.mark.e2e
def test_cli_prints_ledger_and_layouts():
    out = subprocess.run([sys.executable, "-m", "serving.ledger", "--preset=source-example", "--num_devices=8"],
                         capture_output=True, text=True, timeout=300, env=_env())
    assert out.returncode == 0, out.stderr
    for text in ("512 KiB/token", "1.000 GiB/request", "Layouts that fit on 8 devices", "bubble fraction"):
        assert text in out.stdout
    worked = subprocess.run([sys.executable, "-m", "serving.ledger", "--preset=source-70b"],
                            capture_output=True, text=True, timeout=300, env=_env())
    assert worked.returncode == 0 and "= 456 GB" in worked.stdout, worked.stderr
    bad = subprocess.run([sys.executable, "-m", "serving.ledger", "--preset=nope"],
                         capture_output=True, text=True, timeout=300, env=_env())
    assert bad.returncode != 0 and "unknown preset 'nope'" in bad.stderr


def _env():
    import os
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}


def test_load_config_from_an_hf_directory(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps(ledger.PRESETS["llama-3-8b"][1]))
    name, cfg = ledger.load_config(model=str(tmp_path))
    assert cfg == ledger.load_config("llama-3-8b")[1] and name == tmp_path.name
    assert ModelMemory(cfg, "bfloat16").num_params == 8_030_261_248  # Llama-3-8B's published count
    with pytest.raises(ValueError, match="exactly one"):
        ledger.load_config()


def test_size_parsing_is_explicit_about_units():
    assert ledger.parse_size("80GB") == 80 * 10**9
    assert ledger.parse_size("80GiB") == 80 * 2**30
    with pytest.raises(ValueError, match="80GB"):
        ledger.parse_size("eighty")
    np.testing.assert_equal(ledger.itemsize("float8_e4m3fn"), 1)


def test_uneven_pipeline_stages_count_their_padding_slots():
    """4 layers on 3 stages: 2 + 1 + 1 real layers, 2 slots on every device (the runner's stacked slots), so the
    short stages pay for one padding slot of weights and KV; 80 layers on 3 stages: 27 + 27 + 26."""
    mm = ModelMemory(DENSE, "bfloat16")
    layout = Layout(pp=3)
    assert [list(r) for r in mm.stage_layers(layout)] == [[0, 1], [2], [3]]
    assert mm.stage_slots(layout) == 2
    assert [mm.stage_padding_layers(layout, s) for s in range(3)] == [0, 1, 1]
    one_layer = mm.stage_layer_weight_bytes(Layout(pp=4), 0)
    assert [mm.stage_layer_weight_bytes(layout, s) for s in range(3)] == [2 * one_layer] * 3
    assert [mm.stage_kv_bytes_per_token(layout, s) for s in range(3)] == [2 * 2 * 2 * DENSE.head_dim * 2] * 3
    _, cfg = ledger.load_config("llama-3-70b")
    big = ModelMemory(cfg, "bfloat16")
    assert [len(r) for r in big.stage_layers(layout)] == [27, 27, 26]
    text = ledger.ledger_summary(cfg, dtype="bfloat16", page_size=16, num_pages=100, mesh_shape={"pipeline": 3})
    assert "pipeline stages of 27+27+26 layers, 27 slots each (padding slots on stages [2]" in text
    even = ledger.ledger_summary(cfg, dtype="bfloat16", page_size=16, num_pages=100, mesh_shape={"pipeline": 4})
    assert "20+20+20+20 layers, 20 slots each\n" in even
    with pytest.raises(ValueError, match="needs 1 .. 4 stages"):
        mm.stage_layers(Layout(pp=5))


def test_hybrid_kv_cache_counts_a_window_layer_at_its_window():
    """Gemma 3 27B: 10 full layers hold every token, 52 local ones (window 1024) about 1024 + 15 (their pages); per
    device at tp=8 an eighth (16 KV heads); the engine's sizing and its allocated arrays agree with the arithmetic."""
    _, cfg = ledger.load_config("gemma-3-27b")
    row = 2 * 16 * 128 * 2  # K and V of 16 heads of 128, bf16: one layer, one token
    hybrid, plain = ModelMemory(cfg, "bfloat16"), ModelMemory(cfg, "bfloat16", hybrid=False)
    assert hybrid.windows == (1024,) and plain.windows == ()
    assert (hybrid.pool_kv_bytes_per_token(None), hybrid.pool_kv_bytes_per_token(1024)) == (10 * row, 52 * row)
    assert hybrid.window_tokens(1024, 32768, 16) == 1040 and hybrid.window_tokens(1024, 100, 16) == 112
    assert hybrid.stage_kv_bytes_per_request(Layout(), 0, 32768, 16) == (10 * 32768 + 52 * 1040) * row
    assert hybrid.stage_kv_bytes_per_request(Layout(tp=8), 0, 32768, 16) == (10 * 32768 + 52 * 1040) * row // 8
    assert plain.stage_kv_bytes_per_request(Layout(tp=8), 0, 32768, 16) == 62 * 32768 * row // 8
    # the engine's sizing from a byte budget: the table's pages, beside each a window pool capped at its sequences'
    small = ModelConfig.from_hf({
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "sliding_window": 64})
    budget, seqs, step = 2 * 2**20, 4, 64
    pages = ledger.kv_cache_pages(small, dtype="float32", page_size=16, kv_cache_bytes=budget, max_seqs=seqs,
                                  max_batched_tokens=step)
    windows = ledger.window_pages((64,), pages, 16, seqs, step)
    assert windows == {64: 4 * (4 + 2) + 4} and pages > windows[64]
    caches = init_kv_caches(kv_cache_specs(small, dtype="float32"), pages, 16, window_pages=windows)
    allocated = sum(x.nbytes for x in jax.tree.leaves(caches))
    one_page = 16 * 2 * 2 * 16 * 4  # one page of one layer
    assert allocated <= budget < allocated + one_page  # filled: one more table page would not fit
    assert [x.shape[0] for x in caches] == [windows[64]] * 5 + [pages]
    assert ledger.kv_cache_pages(small, dtype="float32", page_size=16, kv_cache_bytes=budget, max_seqs=seqs,
                                 max_batched_tokens=step, hybrid=False) == budget // (6 * one_page)
    text = ledger.ledger_summary(small, dtype="float32", page_size=16, num_pages=pages, mesh_shape={},
                                 window_pages=windows)
    assert f"{pages} pages x 16 tokens" in text and f"window pools 64 tokens: {windows[64]} pages" in text



def test_latent_kv_cache_is_one_row_per_token_replicated_over_tensor():
    """DeepSeek-V3: each layer caches kv_lora_rank 512 + qk_rope_head_dim 64 values per token (bf16: 1152 B), 61
    layers; tensor parallelism splits the heads but every device holds the whole latent row; pipeline stages split
    the layers (each stage the pipeline runner's slots)."""
    _, cfg = ledger.load_config("deepseek-v3")
    mm = ModelMemory(cfg, "bfloat16")
    assert mm.kv_bytes_per_token == 61 * (512 + 64) * 2 == 70272
    assert mm.stage_kv_bytes_per_token(Layout(tp=8), 0) == mm.stage_kv_bytes_per_token(Layout(tp=4, ep=2), 0) == 70272
    # pp=2: 31 + 30 layers on 3 dense + 30 MoE slots; each stage allocates every slot's cache, padding ones too
    assert mm.stage_kv_bytes_per_token(Layout(pp=2, tp=4), 0) == 33 * 1152
    assert mm.stage_kv_bytes_per_token(Layout(pp=2), 1) == 33 * 1152
    fp8 = ModelMemory(cfg, "bfloat16", "float8_e4m3fn")
    assert fp8.kv_bytes_per_token == 61 * (576 + 4)  # fp8 values and a float32 scale per row
    gqa = ModelMemory(dataclasses.replace(cfg, kv_lora_rank=0, q_lora_rank=0, num_kv_heads=8, head_dim=128), "bfloat16")
    assert gqa.kv_bytes_per_token == 61 * 2 * 8 * 128 * 2  # the same model with GQA 8 x 128 caches 3.6x more


def test_gpt_oss_120b_kv_bytes():
    """GPT-OSS 120B: 18 full layers hold every token, 18 sliding ones (window 128) 128 + 16 (their pages); 8 KV heads
    of 64 split over tp=8 (one per device); its MXFP4 experts counted as the bf16 they are dequantised to."""
    _, cfg = ledger.load_config("gpt-oss-120b")
    assert cfg.family == "gpt_oss" and cfg.mxfp4_experts and cfg.sliding_windows == (128, None) * 18
    row = 2 * 8 * 64 * 2  # K and V of 8 heads of 64, bf16: one layer, one token
    mm = ModelMemory(cfg, "bfloat16")
    assert mm.windows == (128,) and mm.kv_bytes_per_token == 36 * row
    assert (mm.pool_kv_bytes_per_token(None), mm.pool_kv_bytes_per_token(128)) == (18 * row, 18 * row)
    assert mm.stage_kv_bytes_per_request(Layout(tp=8), 0, 32768, 16) == (18 * 32768 + 18 * 144) * row // 8
    assert 116e9 < mm.num_params < 118e9
