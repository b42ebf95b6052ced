"""DeepSeek-V2 / V3 (multi-head latent attention, DeepSeek MoE) and Phi-3 with longrope (its prompts past the
original context) served end to end: a real `python -m serving.server` process with a small random checkpoint answers HF's greedy tokens over gRPC, again from the prefix cache (latent pages
reused), as n = 2 samples and under a structured-output regex through the `openai` package, and through the gateway
(gRPC and HTTP); idle, no page held."""
import re

import openai
import pytest

from models.synthetic import make_test_tokenizer
from serving.process import ServerProcess
from serving.wire.client import Client
from tests.support import hf_models
from tests.support.gateway import greedy_through_gateway
from tests.support.server import running, wait_idle

pytestmark = pytest.mark.e2e
VOCAB = 512  # the test tokenizer's (256 bytes, specials and merges)
REQUEST_LINE = r"(GET|PUT) /[a-z]{1,5} HTTP/1\.1"


@pytest.mark.parametrize("family", hf_models.MLA_FAMILIES + ("phi3_longrope",))
def test_deepseek_through_the_server(family, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(family) / "model")
    hf = hf_models.save_hf_model(family, path, vocab_size=VOCAB)
    make_test_tokenizer(path, vocab_size=VOCAB)
    prompt = hf_models.random_prompt(40, VOCAB, seed=5)
    want = hf_models.hf_greedy(hf, prompt, 16)
    with running(ServerProcess(path, str(tmp_path_factory.mktemp(f"{family}_run")), "--http_port=0",
                               f"--served_model_name={family}")) as server, \
            Client(server.target, timeout=120) as client:
        first = client.complete(prompt, max_tokens=16, temperature=0.0, ignore_eos=True)
        again = client.complete(prompt, max_tokens=16, temperature=0.0, ignore_eos=True)
        assert first.token_ids == again.token_ids == want
        assert again.cached_prompt_tokens == 32  # the (latent) pages of the prompt (its last token recomputed)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{server.info['http_port']}/v1", api_key="unused",
                           max_retries=0, timeout=120) as oai:
            pair = oai.completions.create(model=family, prompt=prompt[:30], max_tokens=16, temperature=0, n=2,
                                          extra_body={"ignore_eos": True})
            # structured outputs: the grammar's mask over this model's logits
            line = oai.completions.create(model=family, prompt=prompt[:20], max_tokens=40, temperature=1.0, seed=3,
                                          extra_body={"structured_outputs": {"regex": REQUEST_LINE}})
            assert re.fullmatch(REQUEST_LINE, line.choices[0].text), line.choices[0].text
        texts = [c.text for c in sorted(pair.choices, key=lambda c: c.index)]
        short = client.complete(prompt[:30], max_tokens=16, temperature=0.0, ignore_eos=True)
        assert short.token_ids == hf_models.hf_greedy(hf, prompt[:30], 16) and texts == [short.text] * 2
        # through the gateway (gRPC and HTTP): the instance's answer
        assert greedy_through_gateway(server.target, tmp_path_factory.mktemp(f"{family}_gw"), family, prompt,
                                      16) == (want, first.text)
        load = wait_idle(client)
        assert load.invariant_error == "" and load.kv_pages_free == load.kv_pages_total and load.kv_cache_usage == 0
