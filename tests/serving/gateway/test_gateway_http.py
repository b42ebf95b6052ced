"""The gateway's OpenAI HTTP API end to end: a real `python -m serving.gateway --http_port=0` in front of two real
instance processes (each with its own HTTP API, the reference), driven by the real `openai` package (sync and async,
streaming and not) and a plain HTTP client: the same answers as an instance, API keys (401), tenants' rate limits
(429 with Retry-After), unknown model (404), bad fields (400 naming the parameter), 200 concurrent streams with none
lost, and a client that leaves mid-stream freeing every page on the instance."""
from __future__ import annotations

import asyncio
import http.client
import json
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from models.synthetic import shared_small_llama
from models.tokenizer import Tokenizer
from serving.wire.client import Client
from tests.support.gateway import GatewayProcess, InstanceProcess, wait_for
from tests.support.server import wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MODEL = "tiny-llama"
KEYS = {"tenants": [{"name": "alice", "api_keys": ["key-alice"]},
                    {"name": "bob", "api_keys": ["key-bob"], "rate_limit": {"requests_per_s": 0.2, "burst": 2}}],
        "admin_keys": ["key-admin"]}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, how are you today?"}]
LONG = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir():
    return shared_small_llama()


@pytest.fixture(scope="module")
def instances(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("http_instances")
    flags = ("--http_port=0", f"--served_model_name={MODEL}", "--max_num_seqs=16", "--max_waiting_requests=256")
    procs = [InstanceProcess(model_dir, str(root / "i0"), *flags)]
    try:
        procs[0].wait_ready()  # the second loads its programs from the compilation cache the first filled
        procs.append(InstanceProcess(model_dir, str(root / "i1"), *flags))
        procs[1].wait_ready()
        yield procs
    finally:
        for p in procs:
            p.terminate()


@pytest.fixture(scope="module")
def gateway(instances, tmp_path_factory):
    config = {"pools": [{"name": "a", "instances": [{"name": f"i{k}", "target": p.target}
                                                    for k, p in enumerate(instances)]}],
              "routing": {"policy": "load_aware"}, "isolation": {"enabled": False}, **KEYS}
    gw = GatewayProcess(str(tmp_path_factory.mktemp("http_gw")), config, "--http_port=0")
    try:
        wait_for(lambda: all(i.report_age_s >= 0 for i in gw.instances("key-admin").values()), 30,
                 what="load reports")
        yield gw
    finally:
        if gw.proc.poll() is None:
            gw.stop()


@pytest.fixture(scope="module")
def gw_base(gateway):
    return f"http://127.0.0.1:{gateway.info['http_port']}"


@pytest.fixture(scope="module")
def gw(gw_base):
    with openai.OpenAI(base_url=f"{gw_base}/v1", api_key="key-alice", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def inst(instances):
    base = f"http://127.0.0.1:{instances[0].info['http_port']}/v1"
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def post(base: str, path: str, body: dict, key: str | None = "key-alice") -> tuple[int, dict, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(base + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read() or b"null"), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def _same(a, b) -> bool:
    """Equal, floats (logprobs) to within 1e-4: two instances' batches (and a prompt served from the prefix cache or
    not) differ in shape, so their float sums differ in the last bits, which can move a rounded last digit."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-4
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _content(response) -> list:
    """A response's choices without its id and timestamps."""
    return [c.model_dump() for c in response.choices]


def test_same_answers_as_an_instance(gw, inst):
    # Greedy chat with logprobs, seeded n=3 completions, a logit bias, a stop string, an echo: identical bodies
    # (choices and usage) through the gateway and straight from an instance.
    cases = [
        ("chat", dict(messages=CHAT, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)),
        ("completions", dict(prompt="def fib(n):", max_tokens=10, n=3, seed=7, temperature=1.0, extra_body=LONG)),
        ("completions", dict(prompt=[5, 6, 7, 8], max_tokens=6, temperature=0, logit_bias={"42": 100},
                             logprobs=2)),
        ("chat", dict(messages=CHAT, max_tokens=30, temperature=0, stop=["e"], extra_body=LONG)),
        ("completions", dict(prompt=["one two", "three"], max_tokens=5, temperature=0, echo=True)),
    ]
    for kind, kw in cases:
        answers = []
        for client in (gw, inst):
            api = client.chat.completions if kind == "chat" else client.completions
            r = api.create(model=MODEL, **kw)
            answers.append((_content(r), r.usage.prompt_tokens, r.usage.completion_tokens))
        assert _same(answers[0], answers[1]), (kw, answers)
    r = gw.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0, logit_bias={"42": 100})
    assert r.choices[0].text == Tokenizer.from_pretrained(shared_small_llama()).decode([42] * 6)
    samples = gw.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=10, n=3, seed=7,
                                    temperature=1.0, extra_body=LONG)
    texts = [c.text for c in samples.choices]
    assert len(set(texts)) == 3 and [c.index for c in samples.choices] == [0, 1, 2]


def test_streaming_equals_the_whole_answer_and_usage_counts_cached_tokens(gw):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=16, temperature=0, extra_body=LONG)
    whole = gw.chat.completions.create(**kw)
    chunks = list(gw.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 16
    # The same prompt again: its full pages come from the prefix cache of the instance affinity sent it to.
    long_prompt = [3 + (i * 11) % 400 for i in range(100)]
    gw.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2, temperature=0)
    again = gw.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens == 100 and again.usage.prompt_tokens_details.cached_tokens >= 64


def test_async_client_streams(gw_base):
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{gw_base}/v1", api_key="key-alice", max_retries=0,
                                      timeout=120) as ac:
            stream = await ac.completions.create(model=MODEL, prompt="import os", max_tokens=8, temperature=0,
                                                 stream=True, extra_body=LONG)
            return [c async for c in stream]
    chunks = asyncio.run(main())
    assert chunks[-1].choices[0].finish_reason == "length" and sum(bool(c.choices[0].text) for c in chunks) >= 1


def test_error_bodies(gw_base, gw):
    # 401: no key, an unknown key.
    for key in (None, "nope"):
        status, body, _ = post(gw_base, "/v1/completions", {"model": MODEL, "prompt": "x"}, key=key)
        assert status == 401 and body["error"]["type"] == "authentication_error", body
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{gw_base}/v1", api_key="nope", max_retries=0).models.list()
    # 404: an unknown model.
    with pytest.raises(openai.NotFoundError) as e:
        gw.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and MODEL in e.value.body["message"]
    # 400: the parameter named, as an instance names it.
    for body, param in (({"prompt": "x", "temperature": -1}, "temperature"),
                        ({"prompt": [5, 99999]}, "prompt"),
                        ({"prompt": "x", "max_tokens": 10 ** 6}, "max_tokens"),
                        ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias")):
        status, out, _ = post(gw_base, "/v1/completions", {"model": MODEL, **body})
        assert status == 400 and out["error"]["param"] == param, (body, out)
    status, out, _ = post(gw_base, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 5000})
    assert status == 400 and out["error"]["code"] == "context_length_exceeded", out
    assert "512" in out["error"]["message"], out
    # 429: bob's burst of 2, then Retry-After.
    for _ in range(2):
        assert post(gw_base, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}, key="key-bob")[0] \
            == 200
    status, out, headers = post(gw_base, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1},
                                key="key-bob")
    assert status == 429 and "rate limit" in out["error"]["message"] and int(headers["Retry-After"]) >= 1, out
    # Still serving, models and health answer.
    assert [m.id for m in gw.models.list().data] == [MODEL]
    assert urllib.request.urlopen(f"{gw_base}/health", timeout=10).status == 200


def test_sse_framing_at_the_byte_level(gw_base):
    conn = http.client.HTTPConnection("127.0.0.1", int(gw_base.rsplit(":", 1)[1]), timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True}}),
        {"Content-Type": "application/json", "Authorization": "Bearer key-alice"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    raw = resp.read()
    conn.close()
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    payloads = [json.loads(e[len(b"data: "):]) for e in events[:-2]]
    assert all(e.startswith(b"data: ") for e in events[:-1])
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant" and payloads[-1]["usage"]["completion_tokens"] == 6


def _counts(gateway) -> dict:
    """The gateway's Prometheus counters: requests routed to each instance, requests ended OK."""
    text = urllib.request.urlopen(gateway.metrics_url, timeout=10).read().decode()
    out = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if s.name == "meshserve:gateway_routed_requests_total":
                out[s.labels["instance"]] = s.value
            elif s.name == "meshserve:gateway_requests_total" and s.labels["code"] == "OK":
                out["OK"] = s.value
    return out


def test_200_concurrent_streams_none_lost(gw_base, gateway):
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{gw_base}/v1", api_key="key-alice", max_retries=0,
                                      timeout=300) as ac:
            async def one(i):
                stream = await ac.completions.create(model=MODEL, prompt=[3 + i % 300, 4, 5, 6 + i % 7],
                                                     max_tokens=8, temperature=0, stream=True, extra_body=LONG,
                                                     stream_options={"include_usage": True})
                text, usage, finish = "", None, None
                async for c in stream:
                    if c.choices:
                        text += c.choices[0].text
                        finish = c.choices[0].finish_reason or finish
                    if c.usage is not None:
                        usage = c.usage
                return text, finish, usage.completion_tokens
            return await asyncio.gather(*(one(i) for i in range(200)), return_exceptions=True)
    before = _counts(gateway)
    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert all(finish == "length" and tokens == 8 for _, finish, tokens in results)
    after = _counts(gateway)
    assert after["OK"] - before.get("OK", 0) == 200
    routed = {i: after[i] - before.get(i, 0) for i in ("i0", "i1")}
    assert sum(routed.values()) == 200 and min(routed.values()) > 0, routed  # no retries; both instances served


def test_cancel_mid_stream_frees_every_page(gw, instances):
    stream = gw.completions.create(model=MODEL, prompt="def main():", max_tokens=400, n=2, temperature=1.0,
                                   stream=True, extra_body=LONG)
    chunks = iter(stream)
    got = [next(chunks) for _ in range(3)]
    assert got
    clients = [Client(p.target, timeout=30) for p in instances]
    try:
        assert sum(c.get_load().num_running for c in clients) == 2
        t0 = time.monotonic()
        stream.close()
        for c in clients:
            load = wait_idle(c)
            assert load.num_running == 0 and load.kv_pages_free == load.kv_pages_total and load.invariant_error == ""
        assert time.monotonic() - t0 < 10
    finally:
        for c in clients:
            c.close()
