"""Gemma 3 served end to end on the hybrid KV cache: a real `python -m serving.server` process with a small random
Gemma 3 (local layers of a 16-token window beside a global one) answers a prompt four windows long with HF's greedy
tokens over gRPC, again from the prefix cache, and as n = 2 samples through the `openai` package; idle, its books
(both page pools) hold no page; the same through the gateway."""
import openai
import pytest
import torch
import transformers as tf

from models.synthetic import make_test_tokenizer
from serving.process import ServerProcess
from serving.wire.client import Client
from tests.support import hf_models
from tests.support.gateway import greedy_through_gateway
from tests.support.server import running, wait_idle

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("gemma3_server") / "model")
    torch.manual_seed(0)
    cfg = tf.Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                              sliding_window=16, layer_types=["sliding_attention", "full_attention",
                                                              "sliding_attention"],
                              initializer_range=0.08, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model = tf.Gemma3ForCausalLM(cfg).eval()
    model.save_pretrained(d)
    make_test_tokenizer(d, vocab_size=512)
    return d, model


def test_gemma3_through_the_server(gemma3, tmp_path_factory):
    path, hf = gemma3
    prompt = hf_models.random_prompt(64, 512, seed=3)
    want = hf_models.hf_greedy(hf, prompt, 24)
    with running(ServerProcess(path, str(tmp_path_factory.mktemp("gemma3_run")), "--http_port=0",
                               "--served_model_name=gemma3")) as server, \
            Client(server.target, timeout=120) as client:
        first = client.complete(prompt, max_tokens=24, temperature=0.0, ignore_eos=True)
        again = client.complete(prompt, max_tokens=24, temperature=0.0, ignore_eos=True)
        assert first.token_ids == again.token_ids == want
        assert again.cached_prompt_tokens == 56  # 7 full pages of 8; the next query's window pages were kept
        with openai.OpenAI(base_url=f"http://127.0.0.1:{server.info['http_port']}/v1", api_key="unused",
                           max_retries=0, timeout=120) as oai:
            pair = oai.completions.create(model="gemma3", prompt=prompt[:60], max_tokens=24, temperature=0, n=2,
                                          extra_body={"ignore_eos": True})
        texts = [c.text for c in sorted(pair.choices, key=lambda c: c.index)]
        short = client.complete(prompt[:60], max_tokens=24, temperature=0.0, ignore_eos=True)
        assert short.token_ids == hf_models.hf_greedy(hf, prompt[:60], 24) and texts == [short.text] * 2
        assert greedy_through_gateway(server.target, tmp_path_factory.mktemp("gemma3_gw"), "gemma3", prompt,
                                      24) == (want, first.text)  # through the gateway (gRPC and HTTP)
        load = wait_idle(client)  # check_idle of both pools, on the server
        assert load.invariant_error == "" and load.kv_pages_free == load.kv_pages_total and load.kv_cache_usage == 0
