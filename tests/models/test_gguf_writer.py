"""models.gguf_writer, behind the llama.cpp side-by-side benchmarks (serving/bench/llamacpp.py) and the GGUF loader's
safetensors twins (tests/models/test_gguf.py): a local HF Llama
checkpoint comes back from the GGUF file with the same weights, the metadata llama.cpp reads, and q/k rows
reordered so that llama.cpp's interleaved RoPE gives the attention scores HF's rotate-half RoPE gives; a Qwen3-MoE
checkpoint (per-expert or fused experts) as "qwen3moe" with its rows as stored. llama.cpp itself on the Mixtral and
Qwen3-MoE files (HF's logits and greedy tokens) is checked where it is installed, by the benchmarks that quote it
before they time it (`llamacpp.check_moe_layouts`): llama-cpp-python builds llama.cpp from source, too long for CI."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers as tf

from models import gguf_writer
from serving.bench import llamacpp

HEADS, KV_HEADS, HIDDEN, THETA = 4, 2, 64, 5000.0


def _save(tmp_path, dtype):
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=300, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": THETA},
                         tie_word_embeddings=False)
    model = tf.LlamaForCausalLM(cfg).to(dtype)
    d = tmp_path / "hf"
    model.save_pretrained(d)
    return d, {k: v.float().numpy() if dtype == torch.float32 else v.view(torch.int16).numpy().view(np.uint16)
               for k, v in model.state_dict().items()}


def _rope_half(x, pos):  # HF: rotates (i, i + d/2)
    d = x.shape[-1]
    inv = THETA ** (-np.arange(0, d, 2) / d)
    c, s = np.cos(pos * inv), np.sin(pos * inv)
    a, b = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([a * c - b * s, a * s + b * c], -1)


def _rope_pairs(x, pos):  # llama.cpp's llama architecture: rotates (2i, 2i + 1)
    d = x.shape[-1]
    inv = THETA ** (-np.arange(0, d, 2) / d)
    c, s = np.cos(pos * inv), np.sin(pos * inv)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_holds_the_checkpoint(tmp_path, dtype):
    d, hf = _save(tmp_path, dtype)
    path = gguf_writer.write_gguf(d, tmp_path / "m.gguf")
    r = gguf.GGUFReader(str(path))
    meta = {k: r.fields[k].contents() for k in (
        "general.architecture", "llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
        "llama.attention.head_count", "llama.attention.head_count_kv", "llama.rope.dimension_count",
        "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon", "tokenizer.ggml.model")}
    assert meta == {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": HIDDEN,
                    "llama.feed_forward_length": 96, "llama.attention.head_count": HEADS,
                    "llama.attention.head_count_kv": KV_HEADS, "llama.rope.dimension_count": HIDDEN // HEADS,
                    "llama.rope.freq_base": THETA, "llama.attention.layer_norm_rms_epsilon": pytest.approx(1e-5),
                    "tokenizer.ggml.model": "llama"}
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == 300
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == 3 + 9 * 2
    names = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
             "output_norm.weight": "model.norm.weight"}
    for i in range(2):
        for ours, theirs in (("attn_norm", "input_layernorm"), ("attn_q", "self_attn.q_proj"),
                             ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
                             ("attn_output", "self_attn.o_proj"), ("ffn_norm", "post_attention_layernorm"),
                             ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                             ("ffn_down", "mlp.down_proj")):
            names[f"blk.{i}.{ours}.weight"] = f"model.layers.{i}.{theirs}.weight"
    assert set(tensors) == set(names)
    got = {}
    for name, src in names.items():
        t, want = tensors[name], hf[src]
        if want.ndim == 1 or dtype == torch.float32:  # norms are float32 whatever the checkpoint's dtype
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            ref = want.astype(np.float32) if dtype == torch.float32 else \
                (want.astype(np.uint32) << 16).view(np.float32)
            got[name] = np.asarray(t.data, np.float32).reshape(want.shape)
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.BF16
            got[name] = (np.asarray(t.data).view(np.uint16).reshape(want.shape).astype(np.uint32) << 16).view(
                np.float32)
            ref = (want.astype(np.uint32) << 16).view(np.float32)
        if "attn_q" in name or "attn_k" in name:
            assert not np.array_equal(got[name], ref)  # rows reordered ...
            assert np.array_equal(np.sort(got[name], 0), np.sort(ref, 0))  # ... not changed
        else:
            np.testing.assert_array_equal(got[name], ref)
    # Attention scores: HF's q/k under rotate-half RoPE == the GGUF's q/k under interleaved RoPE.
    hd = HIDDEN // HEADS
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, HIDDEN)).astype(np.float64)
    pos = np.arange(3, 8)[:, None]
    as_f32 = {n: (v.astype(np.uint32) << 16).view(np.float32) if dtype == torch.bfloat16 else v
              for n, v in hf.items()}
    for i in range(2):
        def scores(wq, wk, rope):
            q = rope((x @ wq.T).reshape(5, HEADS, hd), pos[:, None, :])
            k = rope((x @ wk.T).reshape(5, KV_HEADS, hd), pos[:, None, :])
            k = np.repeat(k, HEADS // KV_HEADS, axis=1)
            return np.einsum("qhd,khd->hqk", q, k)
        ref = scores(as_f32[f"model.layers.{i}.self_attn.q_proj.weight"].astype(np.float64),
                     as_f32[f"model.layers.{i}.self_attn.k_proj.weight"].astype(np.float64), _rope_half)
        ours = scores(got[f"blk.{i}.attn_q.weight"].astype(np.float64),
                      got[f"blk.{i}.attn_k.weight"].astype(np.float64), _rope_pairs)
        np.testing.assert_allclose(ours, ref, rtol=1e-10, atol=1e-10)
        # and the plain row order would not do
        wrong = scores(as_f32[f"model.layers.{i}.self_attn.q_proj.weight"].astype(np.float64),
                       as_f32[f"model.layers.{i}.self_attn.k_proj.weight"].astype(np.float64), _rope_pairs)
        assert np.abs(wrong - ref).max() > 1e-3


def test_gguf_refuses_scaled_rope(tmp_path):
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=300, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": THETA})
    tf.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="plain RoPE \\(and Llama 3's\\), not 'linear'"):
        gguf_writer.write_gguf(tmp_path / "hf", tmp_path / "m.gguf")


def _bf16_as_f32(a):
    return (np.asarray(a).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3moe_gguf_holds_the_checkpoint(tmp_path, dtype):
    model = llamacpp.small_moe_model("qwen3_moe", dtype)
    model.save_pretrained(tmp_path / "hf")
    path = gguf_writer.write_gguf(tmp_path / "hf", tmp_path / "m.gguf")
    r = gguf.GGUFReader(str(path))
    meta = {k: r.fields[k].contents() for k in (
        "general.architecture", "qwen3moe.block_count", "qwen3moe.embedding_length", "qwen3moe.expert_count",
        "qwen3moe.expert_used_count", "qwen3moe.expert_feed_forward_length", "qwen3moe.attention.head_count",
        "qwen3moe.attention.head_count_kv", "qwen3moe.attention.key_length", "qwen3moe.attention.value_length",
        "qwen3moe.rope.dimension_count")}
    assert meta == {"general.architecture": "qwen3moe", "qwen3moe.block_count": 2, "qwen3moe.embedding_length": HIDDEN,
                    "qwen3moe.expert_count": 16, "qwen3moe.expert_used_count": 4,
                    "qwen3moe.expert_feed_forward_length": 32, "qwen3moe.attention.head_count": HEADS,
                    "qwen3moe.attention.head_count_kv": KV_HEADS, "qwen3moe.attention.key_length": 32,
                    "qwen3moe.attention.value_length": 32, "qwen3moe.rope.dimension_count": 32}
    hf = {k: v.float().numpy() for k, v in model.state_dict().items()}  # experts fused: gate_up [N, 2I, E]
    names = {"token_embd.weight": hf["model.embed_tokens.weight"], "output.weight": hf["lm_head.weight"],
             "output_norm.weight": hf["model.norm.weight"]}
    for i in range(2):
        p = f"model.layers.{i}."
        gate, up = np.split(hf[p + "mlp.experts.gate_up_proj"], 2, axis=1)
        names.update({f"blk.{i}.{ours}.weight": hf[p + theirs] for ours, theirs in (
            ("attn_norm", "input_layernorm.weight"), ("attn_q", "self_attn.q_proj.weight"),
            ("attn_k", "self_attn.k_proj.weight"), ("attn_v", "self_attn.v_proj.weight"),
            ("attn_output", "self_attn.o_proj.weight"), ("attn_q_norm", "self_attn.q_norm.weight"),
            ("attn_k_norm", "self_attn.k_norm.weight"), ("ffn_norm", "post_attention_layernorm.weight"),
            ("ffn_gate_inp", "mlp.gate.weight"), ("ffn_down_exps", "mlp.experts.down_proj"))})
        names[f"blk.{i}.ffn_gate_exps.weight"], names[f"blk.{i}.ffn_up_exps.weight"] = gate, up
    tensors = {t.name: t for t in r.tensors}
    assert set(tensors) == set(names)
    for name, want in names.items():  # q/k rows as stored: qwen3moe rotates HF's halves (NEOX)
        t = tensors[name]
        if want.ndim > 1 and dtype == torch.bfloat16:
            assert t.tensor_type == gguf.GGMLQuantizationType.BF16
            got = _bf16_as_f32(t.data)
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            got = np.asarray(t.data, np.float32)
        np.testing.assert_array_equal(got.reshape(want.shape), want, err_msg=name)


def test_qwen3moe_gguf_from_fused_experts_is_the_same(tmp_path):
    """transformers 5's in-memory layout (experts fused) written as safetensors gives the same GGUF tensors as
    save_pretrained's per-expert checkpoint."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    model = llamacpp.small_moe_model("qwen3_moe")
    model.save_pretrained(tmp_path / "per_expert")
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((tmp_path / "per_expert" / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(fused / "model.safetensors"))
    with safe_open(str(fused / "model.safetensors"), "np") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    a = gguf.GGUFReader(str(gguf_writer.write_gguf(tmp_path / "per_expert", tmp_path / "a.gguf")))
    b = gguf.GGUFReader(str(gguf_writer.write_gguf(fused, tmp_path / "b.gguf")))
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors):
        np.testing.assert_array_equal(np.asarray(x.data), np.asarray(y.data), err_msg=x.name)


def test_qwen3moe_gguf_refuses_what_llamacpp_would_compute_otherwise(tmp_path):
    torch.manual_seed(0)
    cfg = tf.Qwen3MoeConfig(vocab_size=300, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=HEADS,
                            num_key_value_heads=KV_HEADS, moe_intermediate_size=32, num_experts=4,
                            num_experts_per_tok=2, norm_topk_prob=False)
    tf.Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="norm_topk_prob=False"):
        gguf_writer.write_gguf(tmp_path / "hf", tmp_path / "m.gguf")


def test_gemma3_gguf_refuses_what_llamacpp_would_assume_otherwise(tmp_path):
    """llama.cpp's gemma3 reads no layer pattern, local RoPE base or softmax scale: a Gemma 3 whose own differ (the
    test family's: global every second layer) is refused rather than written to compute otherwise."""
    from tests.support import hf_models
    hf_models.save_hf_model("gemma3", str(tmp_path / "hf"))
    with pytest.raises(ValueError, match="every 6th layer global"):
        gguf_writer.write_gguf(tmp_path / "hf", tmp_path / "m.gguf")
