"""GPT-OSS served end to end: a real `python -m serving.server` process with a small random GPT-OSS (attention sinks,
a 12-token sliding layer on the hybrid KV cache beside a full one, MoE with biases and the clamped SwiGLU) and the
harmony parsers answers a prompt past the window with HF's greedy tokens over gRPC and the `openai` package's
completions, also through the gateway; a chat reply comes back through the harmony reasoning / tool parsers as
content; idle, no page held."""
import openai
import pytest

from models.synthetic import make_test_tokenizer
from serving.api.reasoning import HARMONY_MARKERS
from serving.process import ServerProcess
from serving.wire.client import Client
from tests.support import hf_models
from tests.support.gateway import greedy_through_gateway
from tests.support.server import running, wait_idle

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("gpt_oss_server") / "model")
    model = hf_models.save_hf_model("gpt_oss", d, vocab_size=512)
    make_test_tokenizer(d, vocab_size=512, extra_special_tokens=HARMONY_MARKERS)
    return d, model


def test_gpt_oss_through_the_server(gpt_oss, tmp_path_factory):
    path, hf = gpt_oss
    prompt = hf_models.random_prompt(40, 512, seed=3)
    want = hf_models.hf_greedy(hf, prompt, 16)
    with running(ServerProcess(path, str(tmp_path_factory.mktemp("gpt_oss_run")), "--http_port=0",
                               "--served_model_name=gpt-oss", "--reasoning_parser=harmony",
                               "--tool_call_parser=harmony", "--page_size=4")) as server, \
            Client(server.target, timeout=120) as client:
        info = client.model_info()
        assert (info.reasoning_parser, info.tool_call_parser) == ("harmony", "harmony")
        first = client.complete(prompt, max_tokens=16, temperature=0.0, ignore_eos=True)
        assert first.token_ids == want
        with openai.OpenAI(base_url=f"http://127.0.0.1:{server.info['http_port']}/v1", api_key="unused",
                           max_retries=0, timeout=120) as oai:
            done = oai.completions.create(model="gpt-oss", prompt=prompt, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert done.choices[0].text == first.text
            # a random model writes no harmony header (its markers biased away): the reply is content
            bias = {str(i): -100 for i in range(5, 5 + len(HARMONY_MARKERS))}
            chat = oai.chat.completions.create(model="gpt-oss", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=8, temperature=0, logit_bias=bias,
                                               extra_body={"ignore_eos": True})
        assert greedy_through_gateway(server.target, tmp_path_factory.mktemp("gpt_oss_gw"), "gpt-oss", prompt,
                                      16) == (want, first.text)  # through the gateway (gRPC and HTTP)
        message = chat.choices[0].message
        assert message.content and getattr(message, "reasoning_content", None) is None and not message.tool_calls
        assert chat.usage.completion_tokens == 8
        load = wait_idle(client)
        assert load.invariant_error == "" and load.kv_pages_free == load.kv_pages_total and load.kv_cache_usage == 0
