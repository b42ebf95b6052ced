"""The memory ledger's prefill/decode split advice (serving.pd_split) on the Llama-3-8B preset: the KV a request
moves is its prompt's, exactly; long prompts with short outputs want more prefill instances per decode instance,
short prompts with long outputs fewer; bad inputs are named."""
import pytest

from serving.ledger import Hardware, Layout, ModelMemory, load_config
from serving.pd_split import pd_split


@pytest.fixture(scope="module")
def mm():
    _, cfg = load_config(preset="llama-3-8b")
    return ModelMemory(cfg, "bfloat16")


def test_split_advice_follows_the_mix(mm):
    hw = Hardware()
    long_in = pd_split(mm, Layout(), hw, input_len=8192, output_len=256, decode_batch=64)
    long_out = pd_split(mm, Layout(), hw, input_len=512, output_len=1024, decode_batch=64)
    # 32 layers x 8 KV heads x 128 x (K and V) x 2 bytes per token
    assert long_in.kv_bytes == 8192 * 32 * 8 * 128 * 2 * 2 == 8192 * mm.kv_bytes_per_token
    assert long_in.prefill_s == pytest.approx(2 * mm.num_params * 8192 / (989e12 * 0.5))
    assert long_in.prefill_per_decode > 1 > long_out.prefill_per_decode
    assert long_in.transfer_s == pytest.approx(long_in.kv_bytes / hw.link_bandwidth)
    # tp=2 halves the prefill time per request (twice the devices)
    tp2 = pd_split(mm, Layout(tp=2), hw, input_len=8192, output_len=256, decode_batch=64)
    assert tp2.prefill_s == pytest.approx(long_in.prefill_s / 2)


def test_bad_inputs_are_named(mm):
    with pytest.raises(ValueError, match="input_len must be >= 1, got 0"):
        pd_split(mm, Layout(), Hardware(), input_len=0, output_len=1, decode_batch=1)
    with pytest.raises(ValueError, match="utilisation must be in"):
        pd_split(mm, Layout(), Hardware(), input_len=1, output_len=1, decode_batch=1, utilisation=1.5)
