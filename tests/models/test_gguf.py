"""models.gguf and the GGUF paths of models.weights / models.tokenizer / models.convert on files written with gguf's
own writer: the header as gguf.GGUFReader reads it; every tensor type dequantized as gguf.quants does; random
Llama / Qwen / Mixtral / Qwen-MoE models whose GGUF loads to the parameters and logits of their safetensors twin;
split files, directories, and the errors that name what is wrong."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import gguf
import ml_dtypes
import numpy as np
import pytest
import transformers as tf
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from models import gguf as mgguf
from models.config import UnsupportedModelError
from models.gguf_writer import write_gguf
from models.tokenizer import Tokenizer
from models.weights import load_model, model_format, read_config
from serving.core.batch import SeqChunk
from tests.support import hf_models
from tests.support.paged_runner import PagedRunner

# Byte offsets of each block's float16 scale fields (random bytes there could be inf / NaN)
SCALE_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
                "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "MXFP4": ()}


def _random_tensor(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """A tensor's stored form: floats, or random blocks of `kind` with sane float16 scales."""
    if kind in ("F32", "F16"):
        return rng.standard_normal((rows, cols)).astype(np.float32 if kind == "F32" else np.float16)
    if kind == "BF16":
        return rng.standard_normal((rows, cols)).astype(ml_dtypes.bfloat16).view(np.uint16)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if kind == "MXFP4":  # one E8M0 scale byte a block: powers of two near 1
        blocks[..., 0] = rng.integers(118, 130, (rows, cols // block))
    for at in SCALE_FIELDS[kind]:
        scale = (rng.standard_normal((rows, cols // block)) * 0.01).astype(np.float16)
        blocks[..., at:at + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return blocks.reshape(rows, -1)


@pytest.fixture(scope="module")
def typed_file(tmp_path_factory):
    """One tensor of every readable type, [3, 512] (two K-quant blocks per row), from gguf's writer."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("types") / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("test.note", "tensors of every type")
    w.add_array("test.numbers", [1.5, -2.0, 3.25])
    for kind in mgguf.TENSOR_TYPES:
        data = _random_tensor(kind.name, 3, 512, rng)
        if kind.name in ("F32", "F16"):
            w.add_tensor(kind.name, data)
        else:
            w.add_tensor(kind.name, data, raw_shape=(3, 512) if kind.name == "BF16" else None, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_covers_the_issue_types():
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"} <= {t.name for t in
                                                                                       mgguf.TENSOR_TYPES}


def test_header_is_what_gguf_reader_reads(typed_file):
    ours = mgguf.GGUFModel.open(str(typed_file))
    ref = gguf.GGUFReader(str(typed_file))
    fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == fields and ours.metadata["test.numbers"] == [1.5, -2.0, 3.25]
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.shape == tuple(int(d) for d in reversed(t.shape)) and mine.ggml_type == t.tensor_type
        np.testing.assert_array_equal(mine.file.raw(mine).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))


@pytest.mark.parametrize("kind", [t.name for t in mgguf.TENSOR_TYPES])
def test_dequantized_as_gguf_reference(typed_file, kind):
    """Every type the loader reads: gguf.quants' dequantisation of the tensor GGUFReader finds, exactly; in
    bfloat16 that value rounded (float types come back as stored: the loader casts them shard by shard)."""
    ref_tensor = next(t for t in gguf.GGUFReader(str(typed_file)).tensors if t.name == kind)
    ref = gguf.quants.dequantize(np.asarray(ref_tensor.data), ref_tensor.tensor_type).reshape(3, 512)
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0
    model = mgguf.GGUFModel.open(str(typed_file))
    np.testing.assert_array_equal(np.asarray(model.tensor(kind, np.float32), np.float32), ref)
    np.testing.assert_array_equal(model.tensor(kind, ml_dtypes.bfloat16).astype(ml_dtypes.bfloat16).astype(np.float32),
                                  ref.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_unreadable_type_is_named(tmp_path):
    path = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.IQ2_XXS]
    w.add_tensor("token_embd.weight", np.zeros((2, size), np.uint8), raw_dtype=GGMLQuantizationType.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model = mgguf.GGUFModel.open(str(path))
    with pytest.raises(mgguf.GGUFError, match=r"'token_embd.weight' is IQ2_XXS; readable types: F32, F16, BF16"):
        model.tensor("token_embd.weight")


def test_truncated_and_foreign_files_are_named(typed_file, tmp_path):
    data = typed_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:200])
    with pytest.raises(mgguf.GGUFError, match="cut.gguf: truncated or corrupt header"):
        mgguf.GGUFModel.open(str(cut))
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:-100])
    model = mgguf.GGUFModel.open(str(short))
    last = mgguf.TENSOR_TYPES[-1].name  # the file's last tensor
    with pytest.raises(mgguf.GGUFError, match=f"'{last}' .* runs past the end of the file"):
        model.tensor(last)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(mgguf.GGUFError, match=r"not a GGUF file \(starts with b'PK"):
        mgguf.GGUFModel.open(str(other))


# ------------------------------------------------------------------------------------------------- safetensors twins
TWINS = ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma3", "phi3", "deepseek_v2", "deepseek_v3",
         "gpt_oss")
# Gemma 3 as llama.cpp's gemma3 holds it (what it hard-codes rather than reads): the sixth layer global, the local
# layers' RoPE base 10000, query_pre_attn_scalar = head_dim; the global layers keep their own base and linear scaling
OVERRIDES = {"gemma3": dict(
    num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"], query_pre_attn_scalar=16,
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "gpt_oss": dict(swiglu_limit=7.0)}  # llama.cpp's gpt-oss clamps at 7 (the test family at 0.5)


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """family -> (HF directory, its GGUF file), float32 weights."""
    root = tmp_path_factory.mktemp("twins")
    out = {}
    for family in TWINS:
        d = hf_models.cached_dir(str(root), family, **OVERRIDES.get(family, {}))
        out[family] = (d, write_gguf(d, root / f"{family}.gguf"))
    return out


def _params(model) -> dict:
    from flax import nnx
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("family", TWINS)
def test_gguf_loads_to_its_safetensors_twin(twins, family):
    """Every parameter equal (q/k rows back from llama.cpp's order, experts out of their stacks, Llama 3's RoPE
    factors recognised, Phi-3's fused qkv / gate_up), so the logits are identical. Gemma 3's norms are stored as
    1 + w: w comes back within float32 rounding of 1, and the 1 + w the model scales by is the twin's exactly."""
    hf_dir, path = twins[family]
    assert model_format(str(path)) == "gguf" and model_format(hf_dir) == "hf"
    cfg, want_cfg = read_config(str(path)), read_config(hf_dir)
    assert cfg.family == want_cfg.family and cfg.rope == want_cfg.rope and cfg.moe_layers == want_cfg.moe_layers
    # all else equal: windows, Gemma 3's local RoPE / softmax scale / soft-cap (the GGUF rounds eps to float32)
    assert cfg == dataclasses.replace(want_cfg, max_position_embeddings=cfg.max_position_embeddings,
                                      rms_norm_eps=cfg.rms_norm_eps, pad_token_id=cfg.pad_token_id)
    ours, twin = load_model(str(path)), load_model(hf_dir)
    got, want = _params(ours), _params(twin)
    assert got.keys() == want.keys()
    for name in want:
        if cfg.rms_norm_unit_offset and "norm" in str(name):
            np.testing.assert_array_equal(np.float32(1) + got[name], np.float32(1) + want[name], err_msg=str(name))
            np.testing.assert_allclose(got[name], want[name], rtol=0, atol=2.0 ** -24, err_msg=str(name))
        else:
            np.testing.assert_array_equal(got[name], want[name], err_msg=str(name))
    prompt = hf_models.random_prompt(12, cfg.vocab_size, seed=3)
    logits = [PagedRunner(m).token_logits([SeqChunk(prompt, 0, list(range(2)))]) for m in (ours, twin)]
    np.testing.assert_array_equal(logits[0], logits[1])


def test_ledger_reads_gguf(twins):
    from serving import ledger
    name, cfg = ledger.load_config(model=str(twins["qwen2_moe"][1]))
    assert name == "qwen2_moe" and cfg.family == "qwen2_moe" and cfg.shared_expert_intermediate_size == 80
    assert cfg.moe_layers == (True, False) and not cfg.norm_topk_prob  # mlp_only_layers=[1]; Qwen2-MoE's default


def test_llama_q_rows_really_are_reordered_in_the_file(twins):
    """The twin test is not vacuous: the file's attn_q rows differ from HF's, and undoing the order recovers them."""
    hf_dir, path = twins["llama"]
    model = mgguf.GGUFModel.open(str(path))
    stored = model.tensor("blk.0.attn_q.weight")
    hf = tf.AutoModelForCausalLM.from_pretrained(hf_dir).state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert not np.array_equal(stored, hf)
    np.testing.assert_array_equal(mgguf.unpermute_rope_rows(stored, 4), hf)


def test_deepseek_kv_b_really_is_split_in_the_file(twins):
    """MLA's kv_b_proj is in the file as llama.cpp's converter writes it: k_b [H, R, Dn] (transposed) and v_b
    [H, Dv, R], no attn_kv_b; the twin test's equal kv_b_proj is their recombination."""
    _, path = twins["deepseek_v2"]
    model = mgguf.GGUFModel.open(str(path))
    assert "blk.0.attn_kv_b.weight" not in model.tensors
    assert model.tensors["blk.0.attn_k_b.weight"].shape == (4, 32, 16)
    assert model.tensors["blk.0.attn_v_b.weight"].shape == (4, 24, 32)
    assert model.metadata["deepseek2.attention.head_count_kv"] == 1


def test_split_files_and_directories(twins, tmp_path):
    hf_dir, _ = twins["mixtral"]
    first = write_gguf(hf_dir, tmp_path / "split" / "mixtral.gguf", split_max_tensors=10)
    parts = sorted(p.name for p in (tmp_path / "split").iterdir())
    assert first.name == "mixtral-00001-of-00003.gguf" and len(parts) == 3
    for entry in (first, tmp_path / "split" / parts[1], tmp_path / "split"):  # any part, or the directory
        assert mgguf.gguf_files(str(entry)) == [str(tmp_path / "split" / p) for p in parts]
    got, want = _params(load_model(str(tmp_path / "split"))), _params(load_model(hf_dir))
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=str(name))
    (tmp_path / "split" / parts[2]).unlink()
    with pytest.raises(mgguf.GGUFError, match=f"missing: .*{parts[2]}"):
        mgguf.gguf_files(str(first))


def test_directory_with_two_models_is_refused(twins, tmp_path):
    for family in ("llama", "qwen2"):
        write_gguf(twins[family][0], tmp_path / f"{family}.gguf")
    with pytest.raises(mgguf.GGUFError, match="holds 2 GGUF models .*llama.gguf, qwen2.gguf"):
        load_model(str(tmp_path))


def _tiny_file(path, arch: str, extra: dict[str, np.ndarray], meta: dict[str, float] | None = None):
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in (meta or {}).items():
        w.add_float32(f"{arch}.{k}", v)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_feed_forward_length(16)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    for name, value in extra.items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_unsupported_architecture_fails_naming_it(tmp_path):
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'gemma2' is not served .*llama, qwen2"
                                                    ".*gemma3, phi3"):
        load_model(_tiny_file(tmp_path / "gemma.gguf", "gemma2", {}))


@pytest.mark.parametrize("arch, extra, meta, error", [
    ("phi3", {"rope_factors_long.weight": np.ones(2, np.float32)}, {}, "Phi-3 LongRoPE .*rope_factors_long"),
    ("gemma3", {}, {"attn_logit_softcapping": 50.0, "attention.sliding_window": 4}, "gemma3.attn_logit_softcapping"),
])
def test_unsupported_variant_fails_naming_it(tmp_path, arch, extra, meta, error):
    with pytest.raises(UnsupportedModelError, match=error):
        load_model(_tiny_file(tmp_path / f"{arch}.gguf", arch, extra, meta))


def test_stray_tensor_is_named(tmp_path):
    path = _tiny_file(tmp_path / "extra.gguf", "qwen3", {"blk.0.attn_qkv.weight": np.zeros((24, 8), np.float32)})
    with pytest.raises(mgguf.GGUFError, match="'blk.0.attn_qkv.weight' has no place in a qwen3 model"):
        load_model(path)


def test_int8_after_dequantization(twins):
    """--quantization=int8 on a GGUF: the safetensors twin's int8 parameters, scales included."""
    hf_dir, path = twins["qwen2_moe"]
    got = _params(load_model(str(path), quantization="int8"))
    want = _params(load_model(hf_dir, quantization="int8"))
    assert any(v.dtype == np.int8 for v in got.values())
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=str(name))


@pytest.mark.e2e
def test_convert_gguf_to_orbax(twins, tmp_path):
    """models.convert reads a GGUF: the Orbax checkpoint restores the same parameters, and its tokenizer (written
    from the GGUF's metadata) encodes and renders as the GGUF's."""
    _, path = twins["llama"]
    out = tmp_path / "orbax"
    subprocess.run([sys.executable, "-m", "models.convert", f"--model={path}", f"--out={out}"], check=True,
                   capture_output=True)
    assert model_format(str(out)) == "orbax" and read_config(str(out)) == read_config(str(path))
    got, want = _params(load_model(str(out))), _params(load_model(str(path)))
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=str(name))
    a, b = Tokenizer.from_pretrained(str(out)), Tokenizer.from_pretrained(str(path))
    text = "Hello <s> there"
    assert a.encode(text) == b.encode(text) and a.eos_token_ids == b.eos_token_ids
    assert a.bos_token_id == b.bos_token_id == 1
