"""Every program the engine compiles, lowered for GPU and TPU from this CPU host: a Llama-shaped and a MoE model,
one device and over a mesh (tensor / expert parallel, a pipeline), plus the speculative step. The programs come
from the engine's own warm-up list, so a new one cannot be missed; none may carry a CPU-only piece (a native CPU
kernel, uint16 KV storage) or a CPU bucket, and each must hold its platform's attention kernel (and a MoE model's its
grouped expert matmul: megablox on TPU, ragged_dot on GPU)."""
import re

import pytest
import transformers as tf

from serving.core.config import EngineConfig
from serving.core.engine import Engine
from serving.core.platform import cpu_only_pieces, platform_choices
from tests.pallas_kernels.test_moe import megablox_calls
from tests.support import hf_models
from tests.support.hf_models import COMMON

# head_dim 64 (a power of two, as Triton wants; the TPU kernel's lanes), 2 KV heads.
SHAPE = {**COMMON, "vocab_size": 256, "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4,
         "num_key_value_heads": 2}
KERNEL = {"gpu": "ragged_paged_attention_triton", "tpu": "tpu_custom_call"}
LAYOUTS = {  # (model, EngineConfig options)
    "llama": ("llama", {}),
    "llama-tp2": ("llama", {"tp": 2}),
    "llama-f32": ("llama", {"dtype": "float32"}),
    "llama-pp2": ("llama", {"pp": 2}),
    "llama-pp2-tp2": ("llama", {"pp": 2, "tp": 2}),
    "llama-ngram": ("llama", {"speculative_method": "ngram"}),
    "llama-draft": ("llama", {"speculative_method": "draft", "speculative_model": "llama"}),  # itself as the draft
    "mixtral": ("mixtral", {}),
    "mixtral-ep2-tp2": ("mixtral", {"ep": 2, "tp": 2}),
    # quantized weights and KV cache (docs/quantization.md)
    "llama-int8-kv-int8": ("llama", {"quantization": "int8", "kv_cache_dtype": "int8"}),
    "llama-fp8-kv-fp8-tp2": ("llama", {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3", "tp": 2}),
    "mixtral-int8-kv-fp8-ep2": ("mixtral", {"quantization": "int8", "kv_cache_dtype": "fp8_e4m3", "ep": 2}),
    "mixtral-ep2": ("mixtral", {"ep": 2}),
    # multi-head latent attention and DeepSeek MoE (the latent kernels; heads split with the latent cache whole)
    "deepseek": ("deepseek", {}),
    "deepseek-tp2-ep2-kv-fp8": ("deepseek", {"tp": 2, "ep": 2, "kv_cache_dtype": "fp8_e4m3"}),
    # LoRA adapter slots (docs/lora.md): every program also in its LoRA variant, A and B split as their weights
    "llama-lora-tp2": ("llama", {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "tp": 2}),
    # local and global layers, the local ones on the hybrid KV cache's window pool
    "gemma3": ("gemma3", {}),
    # attention sinks (split with the heads), sliding / full layers, experts with biases and the clamped SwiGLU
    "gpt_oss-tp2-ep2": ("gpt_oss", {"tp": 2, "ep": 2}),
    # Phi-3's fused projections and longrope (each token's factor set an input of the step)
    "phi3-longrope": ("phi3", {}),
}
TWO_BUCKETS = ("llama", "llama-f32")  # the 12-token budget (`_engine`): the last bucket rounded up to whole tiles
LATENT_KERNEL = {"gpu": "latent_attention_triton", "tpu": "tpu_custom_call"}
# DeepSeek-V3's shape, small: power-of-two latent (64) and RoPE key (32), as the Triton kernel wants.
DEEPSEEK = {**SHAPE, "num_key_value_heads": None, "kv_lora_rank": 64, "q_lora_rank": 64, "qk_rope_head_dim": 32,
            "qk_nope_head_dim": 32, "v_head_dim": 64, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
            "topk_group": 1, "moe_intermediate_size": 64, "first_k_dense_replace": 1}
KV_VALUES = {"int8": "int8", "fp8_e4m3": "float8_e4m3fn"}  # a quantized cache's values on GPU / TPU
WEIGHT_TYPES = {"int8": "xi8>", "fp8": "xf8E4M3FN>"}  # how the quantized weights enter the lowered programs


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lowering")
    out = {}
    for name, config in (("llama", tf.LlamaConfig(**SHAPE)),
                         ("mixtral", tf.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2)),
                         ("deepseek", tf.DeepseekV3Config(**DEEPSEEK)),
                         ("gemma3", tf.Gemma3TextConfig(**SHAPE, head_dim=64, sliding_window=16,
                                                        layer_types=["sliding_attention", "full_attention"])),
                         ("gpt_oss", tf.GptOssConfig(**SHAPE, head_dim=64, sliding_window=16, num_local_experts=4,
                                                     num_experts_per_tok=2)),
                         ("phi3", tf.Phi3Config(**{**SHAPE, "max_position_embeddings": 64},
                                                original_max_position_embeddings=16, rope_parameters={
                                                    "rope_type": "longrope", "rope_theta": 10000.0,
                                                    "short_factor": [1.0 + i / 32 for i in range(32)],
                                                    "long_factor": [1.0 + i / 4 for i in range(32)]}))):
        out[name] = hf_models.save_config(config, root / name)
    return out


def _engine(model: str, platform: str, **options) -> Engine:
    # a 12-token budget: two GPU buckets (8, and 12 rounded up to whole tiles: 16), one TPU bucket (16)
    options = {"dtype": "bfloat16", "max_num_batched_tokens": 12, **options}
    return Engine(EngineConfig(model=model, platform=platform, page_size=16, num_pages=32, max_num_seqs=8,
                               compilation_cache_dir="", **options))


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_warmup_program_lowers_without_cpu_pieces(models, platform, layout):
    model, options = LAYOUTS[layout]
    if "speculative_model" in options:
        options = {**options, "speculative_model": models[options["speculative_model"]]}
    # two GPU buckets where a layout takes the 12-token budget, one elsewhere (a second bucket is the same program
    # at another height; on TPU bf16 the one bucket is 16 either way)
    budget = 12 if layout in TWO_BUCKETS else 8
    engine = _engine(models[model], platform, max_num_batched_tokens=budget, **options)
    choices = engine.runner.choices
    assert (choices.platform, choices.attention_backend, choices.native_kernels) == (platform, platform, False)
    kv = engine.runner.kv_caches[0]
    if "kv_cache_dtype" in options:  # not XLA:CPU's uint8 bits
        assert (kv.values.dtype.name, kv.scales.dtype.name) == (KV_VALUES[options["kv_cache_dtype"]], "float32")
    else:
        assert kv.dtype.name == engine.config.dtype  # not XLA:CPU's uint16 bits
    assert all(t % choices.min_token_bucket == 0 for t in engine.runner.buckets), engine.runner.buckets
    if layout in TWO_BUCKETS and (platform, engine.config.dtype) != ("tpu", "bfloat16"):
        assert engine.runner.buckets == [8, 16], engine.runner.buckets
    plan = engine.warmup_plan()
    kinds = {p.kind for p in plan}
    assert kinds == ({"forward", "sample", "speculative"} if "speculative_method" in options else {"forward", "sample"})
    lowered = engine.lower_programs()
    assert list(lowered) == [p.name for p in plan]
    for program in plan:
        text = lowered[program.name].as_text()
        assert not cpu_only_pieces(text), (program.name, cpu_only_pieces(text))
        if program.kind != "sample":
            kernel = (LATENT_KERNEL if model == "deepseek" else KERNEL)[platform]
            assert kernel in text, program.name  # the platform's attention kernel, not XLA's
            # the experts' grouped matmuls: megablox gmm on TPU, ragged_dot on GPU
            if model in ("mixtral", "deepseek", "gpt_oss"):
                assert (megablox_calls(text) > 0) == (platform == "tpu"), program.name
                assert ("ragged_dot" in text) == (platform == "gpu"), program.name
            if program.lora:  # the LoRA update as XLA's grouped matmul (no native kernel, no one-hot over slots)
                assert "ragged_dot" in text, program.name
            if model == "gemma3":  # the local layer's cache: the window pool's 8 x 3 + 1 pages, not the table's 32
                assert engine.runner.window_pages == {16: 25}, engine.runner.window_pages
                dtype = {"bfloat16": "bf16", "float32": "f32"}[engine.config.dtype]
                assert f"tensor<25x16x4x64x{dtype}>" in text and f"tensor<32x16x4x64x{dtype}>" in text, program.name
            if model == "phi3":  # longrope: each token's factor set (RaggedBatch.rope_long) is an input
                assert re.search(rf"tensor<{program.tokens}xi1>", text), program.name
            if "quantization" in options:  # the weights stay 8-bit in the program's inputs
                assert WEIGHT_TYPES[options["quantization"]] in text, program.name
            # the step's token rows are the bucket's (whole tiles), not a CPU height
            assert re.search(rf"tensor<{program.tokens}xi32>", text), program.name
    with pytest.raises(RuntimeError, match="can be lowered"):
        engine.warmup()  # these programs are not this host's


def test_a_head_dim_the_gpu_kernel_cannot_take_fails_at_load(tmp_path):
    path = hf_models.save_config(tf.LlamaConfig(**{**SHAPE, "hidden_size": 320, "num_attention_heads": 4}), tmp_path)
    with pytest.raises(ValueError, match="power-of-two head_dim >= 16, got 80"):
        _engine(path, "gpu")
    assert _engine(path, "tpu").lower_programs()  # the Mosaic kernel takes it (as far as lowering from CPU shows)


def test_the_check_catches_cpu_only_pieces(models):
    """The same lowering for this CPU: its programs do carry the CPU-only pieces the test above rules out."""
    engine = _engine(models["llama"], "cpu", max_num_batched_tokens=8)  # few CPU buckets (>= max_num_seqs)
    # the forward steps (the pieces' home; the sampling programs hold neither piece)
    text = "\n".join(engine.runner.lower(engine.runner.trace_program(p)).as_text()
                     for p in engine.warmup_plan() if p.kind == "forward")
    found = cpu_only_pieces(text)
    assert "uint16 arrays (XLA:CPU's KV storage)" in found
    if engine.runner.choices.native_kernels:
        assert any(piece.startswith("native CPU kernel") for piece in found)


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_platform_choices(platform, dtype, monkeypatch, tmp_path):
    monkeypatch.delenv("MESHSERVE_COMPILATION_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    c = platform_choices(platform, dtype=dtype, max_num_batched_tokens=100)
    assert c.platform == platform and c.donate_kv_cache
    assert c.compilation_cache_dir == str(tmp_path / ".cache" / "meshserve" / "xla" / platform)
    assert platform_choices(platform, compilation_cache_dir="").compilation_cache_dir is None
    if platform == "cpu":
        from pallas_kernels import native
        on = native.enabled()
        assert c.attention_backend == ("native" if on else "cpu")
        assert c.native_kernels is on and c.greedy_head_screen is on
        assert c.kv_storage_dtype == ("float32" if dtype == "float32" else "uint16")
        assert c.min_token_bucket == (1 if dtype == "float32" or on else 8)
        assert c.token_buckets[-1] == 100  # the budget itself on CPU
        assert not platform_choices("cpu", num_devices=2).native_kernels  # one device only
        assert not platform_choices("cpu", greedy_head_screen=False).greedy_head_screen
    else:
        assert c.attention_backend == platform and not c.native_kernels and not c.greedy_head_screen
        assert c.kv_storage_dtype == dtype
        tile = 16 if platform == "tpu" and dtype == "bfloat16" else 8
        assert c.min_token_bucket == tile
        assert all(t % tile == 0 for t in c.token_buckets) and c.token_buckets[-1] >= 100
    assert platform_choices({"gpu": "cuda"}.get(platform, platform), dtype=dtype) == platform_choices(platform,
                                                                                                      dtype=dtype)
    with pytest.raises(ValueError, match="unknown platform"):
        platform_choices("metal")
