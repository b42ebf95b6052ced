"""The KV cache as the model declares it (`models.kv_cache`): each layer's spec, its bytes and layout by the generic
sharding rules, the caches allocated from it, and the seams a hybrid manager will read (groups, page liveness)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.kv_cache import FULL, LATENT, SLIDING_WINDOW, KVCacheSpec, attention_spec, init_kv_caches, \
    kv_cache_groups, latent_spec
from models.transformer import kv_cache_specs
from pallas_kernels.kv_quant import QuantizedKV
from serving import ledger
from sharding.mesh import serving_mesh


def _qwen2(**kw) -> ModelConfig:
    return ModelConfig.from_hf(dict(architectures=["Qwen2ForCausalLM"], hidden_size=64, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                                    vocab_size=128, max_position_embeddings=256, **kw))


def test_bytes_per_token_of_each_kind():
    # 8 KV heads of 128: 4 KiB per token per layer in bf16; quantized: 1 byte per value plus a float32 scale per row
    assert attention_spec(8, 128, dtype=jnp.bfloat16).bytes_per_token == 4096
    assert attention_spec(8, 128, dtype=jnp.bfloat16, kv_cache_dtype="int8").bytes_per_token == \
        attention_spec(8, 128, dtype=jnp.float32, kv_cache_dtype="fp8_e4m3").bytes_per_token == 2 * 8 * (128 + 4)
    # DeepSeek-V3's latent cache: kv_lora_rank 512 + qk_rope_head_dim 64 per token in one row, 61 layers, bf16
    mla = latent_spec(512 + 64, dtype="bfloat16")
    assert (mla.attention, mla.page_row_shape) == (LATENT, (1, 576))
    assert 61 * mla.bytes_per_token == 70_272 and mla.describe() == "latent x (576 x 2 B)"
    window = attention_spec(2, 64, dtype=jnp.float32, sliding_window=24)
    assert window.attention == SLIDING_WINDOW and window.bytes_per_token == 2 * 2 * 64 * 4


def test_invalid_specs_fail_with_the_value_named():
    with pytest.raises(ValueError, match="attention='local'"):
        KVCacheSpec("local", 2, 2, 64, "float32")
    with pytest.raises(ValueError, match="sliding_window=None with attention='sliding_window'"):
        KVCacheSpec(SLIDING_WINDOW, 2, 2, 64, "float32")
    with pytest.raises(ValueError, match="row_dim must be positive, got 0"):
        latent_spec(0, dtype="float32")
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'"):
        attention_spec(2, 64, dtype="float32", kv_cache_dtype="int4")


def test_layout_from_the_generic_rules():
    """Heads split over 'tensor' when the degree divides the head count (not the 2x rows: a head's K and V stay
    together), pages over 'data'; a latent cache's one row is replicated over the heads' devices."""
    kv = attention_spec(2, 64, dtype="bfloat16")
    assert tuple(kv.partition_spec({"tensor": 2}, 8)) == (None, None, "tensor", None)
    assert tuple(kv.partition_spec({"tensor": 4}, 8)) == (None, None, None, None)
    assert tuple(kv.partition_spec({"tensor": 2, "data": 2}, 8)) == ("data", None, "tensor", None)
    assert [kv.device_heads({"tensor": t}) for t in (1, 2, 4)] == [2, 1, 2]
    assert kv.device_bytes_per_token({"tensor": 2}) == kv.bytes_per_token // 2
    mla = latent_spec(576, dtype="bfloat16")
    assert tuple(mla.partition_spec({"tensor": 8}, 8)) == (None, None, None, None)
    assert mla.device_bytes_per_token({"tensor": 8}) == mla.bytes_per_token


def test_model_declares_its_cache_and_caches_are_allocated_from_it():
    cfg = _qwen2(use_sliding_window=True, sliding_window=16, max_window_layers=2)
    specs = kv_cache_specs(cfg, dtype=jnp.bfloat16)
    assert [s.attention for s in specs] == [FULL, FULL, SLIDING_WINDOW, SLIDING_WINDOW]
    assert list(kv_cache_groups(specs).values()) == [(0, 1), (2, 3)]
    caches = init_kv_caches(specs, 6, 8, serving_mesh(tp=2))
    assert [c.shape for c in caches] == [(6, 8, 4, 16)] * 4 and caches[0].dtype.itemsize == 2  # bf16 (uint16 bits)
    assert tuple(caches[0].sharding.spec) == (None, None, "tensor", None)
    assert all(c.nbytes == 6 * 8 * s.bytes_per_token for c, s in zip(caches, specs))
    quantized = init_kv_caches(kv_cache_specs(cfg, dtype=jnp.bfloat16, kv_cache_dtype="int8"), 6, 8)
    assert isinstance(quantized[0], QuantizedKV) and not np.asarray(quantized[0].values).any()
    per_layer = sum(x.nbytes for x in jax.tree.leaves(quantized[0]))
    assert per_layer == 6 * 8 * kv_cache_specs(cfg, dtype="bfloat16", kv_cache_dtype="int8")[0].bytes_per_token
    # The ledger counts from the same declaration: all layers, or a device's share of the heads.
    mm = ledger.ModelMemory(cfg, "bfloat16")
    assert mm.kv_bytes_per_token == sum(s.bytes_per_token for s in specs) == 4 * 2 * 2 * 16 * 2
    assert mm.stage_kv_bytes_per_token(ledger.Layout(tp=2), 0) == mm.kv_bytes_per_token // 2
    assert mm.kv_describe() == "4 layers x 2 x 2 kv heads x (16 x 2 B)"


def test_page_liveness_by_attention_kind():
    """What a hybrid block manager will read: the oldest position a query at `position` or later still reads."""
    window = attention_spec(2, 64, dtype="float32", sliding_window=24)
    assert [window.first_needed_position(p) for p in (0, 23, 24, 100)] == [0, 0, 1, 77]
    assert attention_spec(2, 64, dtype="float32").first_needed_position(100) == 0
    assert latent_spec(576, dtype="float32").first_needed_position(100) == 0
