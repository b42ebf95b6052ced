"""Checkpoint loading: sharded safetensors, tied embeddings, bf16 checkpoints, Orbax round trip onto another mesh,
and a named error for each malformed checkpoint."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from serving.core.batch import SeqChunk
from models.config import ModelConfig
from models.safetensors_io import CheckpointError
from models.weights import load_hf_model, load_model, load_orbax_model, save_orbax
from sharding.mesh import make_mesh
from tests.support import hf_models
from tests.support.paged_runner import PagedRunner


def _prompt_logits(model, prompt):
    runner = PagedRunner(model, page_size=8)
    return runner.token_logits([SeqChunk(prompt, 0, runner.alloc(len(prompt)))])


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("llama"))
    hf = hf_models.save_hf_model("llama", d)
    return d, hf


def test_sharded_safetensors_match_single_file(llama_dir, tmp_path):
    d, hf = llama_dir
    sharded = str(tmp_path / "sharded")
    hf.save_pretrained(sharded, max_shard_size="40KB")
    index = json.load(open(os.path.join(sharded, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 3
    prompt = hf_models.random_prompt(20, 160, seed=5)
    a = _prompt_logits(load_hf_model(d), prompt)
    b = _prompt_logits(load_hf_model(sharded), prompt)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(b, hf_models.hf_logits(hf, prompt), atol=1e-4)


def test_tied_embeddings(tmp_path):
    d = str(tmp_path / "qwen2")
    hf = hf_models.save_hf_model("qwen2", d)
    model = load_hf_model(d)
    assert model.config.tie_word_embeddings and not hasattr(model, "lm_head")
    prompt = hf_models.random_prompt(12, 160, seed=6)
    np.testing.assert_allclose(_prompt_logits(model, prompt), hf_models.hf_logits(hf, prompt), atol=1e-4)


def test_bf16_checkpoint_into_f32_and_bf16(tmp_path):
    d = str(tmp_path / "bf16")
    hf = hf_models.save_hf_model("llama", d, dtype=torch.bfloat16)
    assert ModelConfig.from_pretrained(d).dtype == "bfloat16"
    ref = load_file(os.path.join(d, "model.safetensors"))["model.embed_tokens.weight"]
    prompt = hf_models.random_prompt(16, 160, seed=7)
    hf32 = hf.float()
    expected = hf_models.hf_logits(hf32, prompt)
    m32 = load_hf_model(d, dtype=jnp.float32)
    assert m32.embed_tokens[...].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(m32.embed_tokens[...]), ref.astype(np.float32))
    np.testing.assert_allclose(_prompt_logits(m32, prompt), expected, atol=1e-4)
    m16 = load_hf_model(d, dtype=jnp.bfloat16)
    assert m16.embed_tokens[...].dtype == jnp.bfloat16
    got = _prompt_logits(m16, prompt)
    scale = np.max(np.abs(expected))
    err = np.max(np.abs(got - expected))
    print(f"bf16 compute: max |diff| {err:.3e} (logit scale {scale:.2f})")
    assert err < 0.05 * scale


def test_orbax_round_trip_onto_other_mesh(llama_dir, tmp_path):
    d, hf = llama_dir
    mesh2 = make_mesh(tp=2)
    src = load_hf_model(d, mesh=mesh2)
    q = src.layers[0].self_attn.q_proj[...]
    assert q.sharding.spec[1] == "tensor" and len(q.sharding.device_set) == 2
    out = str(tmp_path / "orbax")
    save_orbax(src, out, hf_dir=d)
    mesh4 = make_mesh(dp=2, tp=4)
    restored = load_orbax_model(out, mesh=mesh4)
    rq = restored.layers[0].self_attn.q_proj[...]
    assert rq.sharding.mesh.shape["tensor"] == 4 and rq.sharding.spec[1] == "tensor"
    assert len(rq.sharding.device_set) == 8
    for a, b in zip(jax.tree.leaves(jax.tree.map(np.asarray, nnx_params(src))),
                    jax.tree.leaves(jax.tree.map(np.asarray, nnx_params(restored)))):
        np.testing.assert_array_equal(a, b)
    # And onto one device, where it computes HF's logits.
    single = load_model(out)
    prompt = hf_models.random_prompt(16, 160, seed=8)
    np.testing.assert_allclose(_prompt_logits(single, prompt), hf_models.hf_logits(hf, prompt), atol=1e-4)
    restored_bf16 = load_orbax_model(out, dtype=jnp.bfloat16)
    assert restored_bf16.norm.weight[...].dtype == jnp.bfloat16


def nnx_params(model):
    from flax import nnx
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


# ------------------------------------------------------------------ malformed checkpoints


def _copy_with(src_dir, dst_dir, edit):
    shutil.copytree(src_dir, dst_dir)
    tensors = load_file(os.path.join(dst_dir, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst_dir, "model.safetensors"))
    return dst_dir


def test_orbax_round_trip_keeps_the_rope_scaling(tmp_path):
    """Phi-4-mini's shape (fused weights split at load, longrope's short factors and attention factor, a partial
    rotary dimension, the capped context) through an Orbax checkpoint: the same config, the same logits as HF."""
    d = str(tmp_path / "phi4_mini")
    hf = hf_models.save_hf_model("phi4_mini", d)
    model = load_hf_model(d)
    save_orbax(model, str(tmp_path / "orbax"), hf_dir=d)
    restored = load_model(str(tmp_path / "orbax"))
    assert restored.config == model.config and restored.config.rope.short_factor == (1.0, 1.1, 1.3, 1.8, 2.5, 3.0)
    prompt = hf_models.random_prompt(20, 160, seed=7)
    np.testing.assert_allclose(_prompt_logits(restored, prompt), hf_models.hf_logits(hf, prompt), atol=1e-4)


def test_missing_tensor_is_named(llama_dir, tmp_path):
    d = _copy_with(llama_dir[0], str(tmp_path / "m"), lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*missing"):
        load_hf_model(d)


def test_wrong_shape_is_named(llama_dir, tmp_path):
    def edit(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1]
    d = _copy_with(llama_dir[0], str(tmp_path / "m"), edit)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*shape"):
        load_hf_model(d)


def test_uncastable_dtype_is_named(llama_dir, tmp_path):
    def edit(t):
        t["model.norm.weight"] = t["model.norm.weight"].astype(np.int32)
    d = _copy_with(llama_dir[0], str(tmp_path / "m"), edit)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*dtype"):
        load_hf_model(d)


def test_unexpected_tensor_is_named(llama_dir, tmp_path):
    def edit(t):
        t["model.layers.0.mlp.up_proj.bias"] = np.zeros(96, np.float32)
    d = _copy_with(llama_dir[0], str(tmp_path / "m"), edit)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.bias"):
        load_hf_model(d)


def test_truncated_file_and_missing_shard(llama_dir, tmp_path):
    d = str(tmp_path / "trunc")
    shutil.copytree(llama_dir[0], d)
    path = os.path.join(d, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1000)
    with pytest.raises(CheckpointError, match="truncated"):
        load_hf_model(d)
    sharded = str(tmp_path / "sharded")
    llama_dir[1].save_pretrained(sharded, max_shard_size="40KB")
    victim = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))[1]
    os.remove(os.path.join(sharded, victim))
    with pytest.raises(CheckpointError, match=victim):
        load_hf_model(sharded)
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_hf_model(d)


def test_fused_expert_layout(tmp_path):
    """transformers >= 5 keeps Mixtral experts fused in memory; a checkpoint saved from that state dict loads."""
    from safetensors.torch import save_file as save_torch
    hf = hf_models.build_hf_model("mixtral", seed=3)
    d = str(tmp_path / "fused")
    hf.config.save_pretrained(d)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in sd)
    save_torch(sd, os.path.join(d, "model.safetensors"))
    prompt = hf_models.random_prompt(16, 160, seed=9)
    np.testing.assert_allclose(_prompt_logits(load_hf_model(d), prompt), hf_models.hf_logits(hf, prompt),
                               atol=1e-4)


def test_orbax_round_trip_of_deepseek_v3(tmp_path):
    """DeepSeek-V3's shape (latent attention with RoPE rows de-interleaved at load, kv_b_proj held in float, MoE with
    the routing correction bias, a dense first layer) through an Orbax checkpoint: the same config, HF's logits
    (the restore must not permute the RoPE rows a second time)."""
    d = str(tmp_path / "deepseek_v3")
    hf = hf_models.save_hf_model("deepseek_v3", d)
    model = load_hf_model(d)
    save_orbax(model, str(tmp_path / "orbax"), hf_dir=d)
    restored = load_model(str(tmp_path / "orbax"))
    assert restored.config == model.config and restored.config.is_mla and restored.config.topk_method == "noaux_tc"
    prompt = hf_models.random_prompt(20, 160, seed=7)
    np.testing.assert_allclose(_prompt_logits(restored, prompt), hf_models.hf_logits(hf, prompt), atol=1e-4)


def test_random_init_keys_are_the_rng_streams_and_building_under_a_trace_never_formats_a_tracer_error(monkeypatch):
    """models.layers.next_key draws the keys `stream()` would (the random weights are unchanged) and advances the
    count alike; building the model abstractly (nnx.eval_shape) no longer updates a stream's count by item
    assignment (`count[...] += 1`), whose check of a tracer's `sharding` formatted an AttributeError walking the
    whole trace, once per parameter (quadratic in the model's depth)."""
    from flax import nnx
    from models.layers import next_key
    from models.weights import abstract_model
    a, b = nnx.Rngs(3), nnx.Rngs(3)
    for _ in range(3):
        np.testing.assert_array_equal(jax.random.key_data(next_key(a.params)), jax.random.key_data(b.params()))
    assert int(a.params.count[...]) == int(b.params.count[...]) == 3
    assigned = []
    setitem = nnx.RngCount.__setitem__

    def counting(self, key, value):
        assigned.append(key)
        return setitem(self, key, value)
    monkeypatch.setattr(nnx.RngCount, "__setitem__", counting)
    nnx.Rngs(0).params()  # the item assignment that is counted
    assert len(assigned) == 1
    model = abstract_model(ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                                       num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                                       max_position_embeddings=64))
    assert len(model.layers) == 3 and len(assigned) == 1, len(assigned)
