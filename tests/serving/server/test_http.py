"""The OpenAI-compatible HTTP API of an instance server end to end: a real `python -m serving.server --http_port=0`
process on 127.0.0.1 with a small Llama, driven by the real `openai` package (sync and async, streaming and not) and
by a plain HTTP client for the SSE bytes and the error bodies; the gRPC API keeps working on the same process."""
import asyncio
import http.client
import json
import re
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from models.synthetic import shared_small_llama
from models.tokenizer import Tokenizer
from serving.process import ServerProcess
from serving.wire.client import Client, ClientError
from tests.support.server import running, wait_idle

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, how are you today?"}]
LONG = {"ignore_eos": True}  # meshserve's extra field: no early EOS


@pytest.fixture(scope="module")
def model_dir():
    return shared_small_llama()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # Four sequences at once and three waiting at most (an n=3 request fits): test_queue_full_is_429 fills both.
    with running(ServerProcess(model_dir, str(tmp_path_factory.mktemp("http_run")), "--http_port=0",
                               f"--served_model_name={MODEL}", "--max_num_seqs=4", "--max_waiting_requests=3",
                               "--retry_after_s=2")) as proc:
        yield proc


@pytest.fixture(scope="module")
def base(server):
    return f"http://127.0.0.1:{server.info['http_port']}"


@pytest.fixture(scope="module")
def oai(base):
    with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(server):
    with Client(server.target, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_pretrained(model_dir)


def post(base: str, path: str, body: dict) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a POST with urllib."""
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read() or b"null"), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def get(base: str, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(base + path, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_models_health_tokenize_detokenize(oai, base, tok):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    assert get(base, "/health")[0] == 200
    status, body, _ = post(base, "/tokenize", {"prompt": "Hello, world!", "return_token_strs": True})
    assert status == 200 and body["tokens"] == tok.encode("Hello, world!") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512 and body["token_strs"] == [tok.id_to_token(t) for t in body["tokens"]]
    status, body, _ = post(base, "/tokenize", {"messages": CHAT})
    assert status == 200 and body["tokens"] == tok.encode_chat(CHAT, add_generation_prompt=True)
    status, body, _ = post(base, "/detokenize", {"tokens": tok.encode("Hello, world!", add_special_tokens=False)})
    assert status == 200 and body == {"prompt": "Hello, world!"}
    status, body, _ = post(base, "/detokenize", {"tokens": [1, 512]})
    assert status == 400 and body["error"]["param"] == "tokens" and "512" in body["error"]["message"]


def test_chat_and_completions_equal_the_grpc_api(oai, base, grpc_client):
    """Greedy text over HTTP (sync and async, streamed and not) is what meshserve.v1 gives on the same process."""
    grpc_chat = grpc_client.complete(messages=CHAT, max_tokens=12, temperature=0.0, ignore_eos=True)
    chat = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, extra_body=LONG)
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-") and chat.model == MODEL
    c = chat.choices[0]
    assert (c.index, c.message.role, c.message.content, c.finish_reason) == (0, "assistant", grpc_chat.text, "length")
    assert chat.usage.completion_tokens == 12 and chat.usage.prompt_tokens == grpc_chat.prompt_tokens
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 12
    chunks = list(oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True,
                                              extra_body=LONG))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == grpc_chat.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])

    prompt = "The quick brown fox"
    grpc_text = grpc_client.complete(prompt, max_tokens=10, temperature=0.0, ignore_eos=True).text
    comp = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, extra_body=LONG)
    assert comp.object == "text_completion" and comp.choices[0].text == grpc_text
    echo = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, echo=True, extra_body=LONG)
    assert echo.choices[0].text == prompt + grpc_text

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120) as ac:
            whole = await ac.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                                extra_body=LONG)
            stream = await ac.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=LONG)
            pieces = [ch async for ch in stream]
            batch, single = await asyncio.gather(*[ac.completions.create(
                model=MODEL, prompt=p, max_tokens=4, temperature=0, extra_body=LONG) for p in ([prompt, "Hi"], "Hi")])
            return whole, pieces, batch, single
    whole, pieces, batch, single = asyncio.run(main())
    assert whole.choices[0].text == grpc_text
    assert "".join(p.choices[0].text for p in pieces if p.choices) == grpc_text
    assert pieces[-1].choices == [] and pieces[-1].usage.completion_tokens == 10
    assert all(p.usage is None for p in pieces[:-1])
    assert [c.index for c in batch.choices] == [0, 1] and batch.usage.completion_tokens == 8
    assert batch.choices[1].text == single.choices[0].text


def test_n_samples_with_a_seed_are_different_and_reproducible(oai):
    def three(**kw):
        out = oai.completions.create(model=MODEL, prompt="def main():", n=3, seed=7, temperature=1.0, max_tokens=12,
                                     logprobs=0, extra_body=LONG, **kw)
        if kw.get("stream"):
            tokens = {0: [], 1: [], 2: []}
            for ch in out:
                for c in ch.choices:
                    tokens[c.index] += c.logprobs.tokens if c.logprobs else []
            return [tokens[i] for i in range(3)]
        assert [c.index for c in out.choices] == [0, 1, 2] and out.usage.completion_tokens == 36
        return [c.logprobs.tokens for c in out.choices]
    first = three()
    assert all(len(t) == 12 for t in first)
    assert len({tuple(t) for t in first}) == 3, first  # three different samples
    assert three() == first  # the same seed: the same three
    assert three(stream=True) == first
    chat = oai.chat.completions.create(model=MODEL, messages=CHAT, n=3, seed=7, temperature=1.0, max_tokens=8,
                                       extra_body=LONG)
    again = oai.chat.completions.create(model=MODEL, messages=CHAT, n=3, seed=7, temperature=1.0, max_tokens=8,
                                        extra_body=LONG)
    assert [c.message.content for c in chat.choices] == [c.message.content for c in again.choices]
    assert [c.index for c in chat.choices] == [0, 1, 2]


def test_logprobs_in_openai_layouts(oai):
    chat = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body=LONG)
    content = chat.choices[0].logprobs.content
    assert len(content) == 6
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0 and e.bytes
        assert e.top_logprobs[0].token == e.token and abs(e.top_logprobs[0].logprob - e.logprob) < 1e-5  # greedy
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    # The tokens' bytes make the text (a token's own `token` string may hold half a character).
    assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace") == chat.choices[0].message.content
    plain = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    comp = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=2,
                                  extra_body=LONG)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(t in top and 1 <= len(top) <= 3 for t, top in zip(lp.tokens, lp.top_logprobs))


def test_logit_bias_forces_a_token(oai, tok):
    forced = tok.encode(" hello", add_special_tokens=False)[-1]
    for sampling in (dict(temperature=0), dict(temperature=1.0, seed=3)):
        out = oai.completions.create(model=MODEL, prompt="x = 1", max_tokens=5, logit_bias={str(forced): 100},
                                     extra_body=LONG, **sampling)
        assert out.choices[0].text == tok.decode([forced] * 5)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                                   "maxItems": 2}},
          "required": ["name", "age", "pets"], "additionalProperties": False}


def test_structured_outputs_through_openai_and_grpc(server, oai, base, grpc_client):
    import jsonschema
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=120, temperature=1.0, n=3,
                                    response_format=fmt)
    for c in r.choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), PERSON)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=120, temperature=1.0, seed=5, stream=True, response_format=fmt))
    jsonschema.validate(json.loads(streamed), PERSON)
    r = oai.completions.create(model=MODEL, prompt="Request line:", max_tokens=40, temperature=1.0,
                               extra_body={"structured_outputs": {"regex": r"(GET|PUT) /[a-z]{1,5} HTTP/1\.1"}})
    assert re.fullmatch(r"(GET|PUT) /[a-z]{1,5} HTTP/1\.1", r.choices[0].text), r.choices[0].text
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=1.0,
                                    extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert r.choices[0].message.content in ("left", "right")
    # meshserve.v1: the same grammar; a greedy constrained answer never takes the free argmax.
    out = grpc_client.complete(CHAT[1]["content"], max_tokens=120, temperature=0.0,
                                    structured={"json_schema": json.dumps(PERSON)})
    jsonschema.validate(json.loads(out.text), PERSON)
    # A grammar that does not compile: 400 naming it (HTTP), INVALID_ARGUMENT (gRPC); nothing queued.
    status, body, _ = post(base, "/v1/chat/completions", {
        "model": MODEL, "messages": CHAT, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}})
    assert status == 400 and body["error"]["param"].startswith("response_format"), body
    assert "does not compile" in body["error"]["message"]
    status, body, _ = post(base, "/v1/completions", {"model": MODEL, "prompt": "x",
                                                     "structured_outputs": {"regex": "a((", "choice": ["a"]}})
    assert status == 400 and body["error"]["param"] == "structured_outputs", body
    with pytest.raises(ClientError) as e:
        grpc_client.complete("x", structured={"regex": "a(("})
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "sampling.structured.regex" in e.value.details
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    counters = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert counters["meshserve:structured_requests_total"] >= 5
    assert counters["meshserve:grammar_compiles_total"] >= 3 and counters["meshserve:grammar_mask_steps_total"] > 0
    assert counters["meshserve:grammar_compile_seconds_total"] > 0
    assert counters["meshserve:grammar_mask_seconds_total"] > 0


def test_stop_strings(oai):
    full = oai.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=24, temperature=0,
                                  extra_body=LONG).choices[0].text
    i = next(i for i in range(1, len(full) - 2) if full[i:i + 2].strip() and "\ufffd" not in full[i:i + 2])
    stop = full[i:i + 2]
    for make in (lambda **kw: oai.completions.create(model=MODEL, prompt="The quick brown fox", **kw),):
        got = make(max_tokens=24, temperature=0, stop=[stop, "never-in-the-text"], extra_body=LONG).choices[0]
        assert got.finish_reason == "stop" and got.text == full[:full.find(stop)]
        streamed = list(make(max_tokens=24, temperature=0, stop=stop, stream=True, extra_body=LONG))
        assert "".join(c.choices[0].text for c in streamed) == got.text
        assert streamed[-1].choices[0].finish_reason == "stop"


def test_usage_counts_cached_prompt_tokens(oai):
    preamble = "A long shared preamble about serving systems, " * 4
    messages = [{"role": "user", "content": preamble + "then one question."}]
    first = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    second = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens > 40
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached % 8 == 0  # whole pages of 8 tokens


def test_error_bodies(oai, base):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    assert "temperature" in e.value.body["message"]
    status, body, _ = post(base, "/v1/completions", {"model": MODEL, "prompt": [5] * 600, "max_tokens": 4})
    assert status == 400 and set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "prompt"
    assert "600" in err["message"] and "512" in err["message"] and err["code"] == "context_length_exceeded"
    status, body, _ = post(base, "/v1/chat/completions", {"model": MODEL, "messages": CHAT,
                                                         "max_completion_tokens": 600})
    assert status == 400 and body["error"]["param"] == "max_completion_tokens" and "512" in body["error"]["message"]
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    for body, param in [({"prompt": "hi", "n": "3"}, "n"), ({"prompt": "hi", "top_p": 0}, "top_p"),
                        ({"prompt": "hi", "n": 17}, "n"), ({"prompt": "hi", "logit_bias": {"5": 150}}, "logit_bias[5]"),
                        ({"prompt": "hi", "logit_bias": {"512": 1}}, "logit_bias"),
                        ({"prompt": [5, "x"]}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": ""}, "prompt"),
                        ({"prompt": "hi", "priority": 7}, "priority"), ({"prompt": "hi", "stream_options": {}},
                                                                         "stream_options")]:
        status, got, _ = post(base, "/v1/completions", body)
        assert status == 400 and got["error"]["param"] == param, (body, got)
    for body, param in [({"messages": [{"role": "robot", "content": "beep"}]}, "messages[0].role"),
                        ({"messages": []}, "messages"), ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
                        ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                         "messages[0].content[0].type")]:
        status, got, _ = post(base, "/v1/chat/completions", body)
        assert status == 400 and got["error"]["param"] == param, (body, got)
    # Unknown fields are ignored, list-of-parts content is text.
    status, got, _ = post(base, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 2,
        "no_such_field": {"x": 1}, "user": "u1", "priority": 1})
    assert status == 200 and got["usage"]["completion_tokens"] <= 2
    assert get(base, "/v1/nowhere")[0] == 404


def test_sse_framing_at_the_byte_level(server, base):
    conn = http.client.HTTPConnection("127.0.0.1", server.info["http_port"], timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": MODEL, "messages": CHAT, "max_tokens": 5, "temperature": 0, "n": 2, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    raw = resp.read()
    conn.close()
    assert raw.endswith(b"\n\ndata: [DONE]\n\n") and b"\r" not in raw
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    events = events[:-2]
    assert all(e.startswith(b"data: {") and b"\n" not in e for e in events)
    chunks = [json.loads(e[len(b"data: "):]) for e in events]
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert {c["choices"][0]["index"] for c in chunks[:2]} == {0, 1}
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 10
    for index in (0, 1):
        mine = [c for c in chunks[:-1] if c["choices"][0]["index"] == index]
        assert mine[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in mine[:-1])
    assert all(c["usage"] is None and c["object"] == "chat.completion.chunk" for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1


def aborted(server) -> float:
    """meshserve:request_success_total{finished_reason="abort"}: requests that ended without their last token."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "meshserve:request_success_total" and s.labels.get("finished_reason") == "abort")


def test_cancel_mid_stream_frees_every_page(server, oai, base, grpc_client):
    before = aborted(server)
    stream = oai.completions.create(model=MODEL, prompt="def main():", max_tokens=500, n=3, temperature=1.0,
                                    stream=True, extra_body=LONG)
    chunks = iter(stream)
    got = [next(chunks) for _ in range(3)]
    assert got and grpc_client.get_load().num_running == 3
    t0 = time.monotonic()
    stream.close()  # the client goes away mid-stream
    load = wait_idle(grpc_client)
    assert load.num_running == 0 and load.num_waiting == 0 and time.monotonic() - t0 < 10
    assert load.invariant_error == "" and load.kv_pages_free == load.kv_pages_total
    # The same over a raw socket closed mid-body, and a non-streamed request whose client leaves.
    for stream_it in (True, False):
        conn = http.client.HTTPConnection("127.0.0.1", int(base.rsplit(":", 1)[1]), timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({
            "prompt": "x", "max_tokens": 500, "ignore_eos": True, "stream": stream_it}),
            {"Content-Type": "application/json"})
        if stream_it:
            resp = conn.getresponse()
            resp.read1(64)
        else:
            deadline = time.monotonic() + 30
            while grpc_client.get_load().num_running == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
        conn.sock.close()
        conn.close()
        load = wait_idle(grpc_client)
        assert load.num_running == 0 and load.kv_pages_free == load.kv_pages_total and load.invariant_error == ""
    assert aborted(server) - before == 3  # each request counted once, as aborted (not run to its end)


def test_queue_full_is_429_with_retry_after(base, grpc_client):
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120) as ac:
            async def hold(i):
                stream = await ac.completions.create(model=MODEL, prompt=[5 + i] * 8, max_tokens=400, stream=True,
                                                     extra_body=LONG)
                async for _ in stream:
                    pass

            async def until(running, waiting):
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    load = await asyncio.to_thread(grpc_client.get_load)
                    if (load.num_running, load.num_waiting) == (running, waiting):
                        return
                    assert not any(h.done() for h in holders), [h.exception() for h in holders if h.done()]
                    await asyncio.sleep(0.02)
                raise AssertionError(f"never {running} running and {waiting} waiting")
            holders = []
            try:
                for i in range(7):  # one at a time (the queue holds 3): 4 run, then 3 wait and the queue is full
                    holders.append(asyncio.ensure_future(hold(i)))
                    await until(min(i + 1, 4), max(0, i - 3))
                status, body, headers = await asyncio.to_thread(post, base, "/v1/completions", {"prompt": "hi"})
                with pytest.raises(openai.RateLimitError) as e:
                    await ac.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
                return status, body, headers, e.value
            finally:
                for h in holders:
                    h.cancel()
                await asyncio.gather(*holders, return_exceptions=True)
    status, body, headers, err = asyncio.run(main())
    assert status == 429 and headers.get("retry-after", headers.get("Retry-After")) == "2", (status, body, headers)
    assert body["error"]["type"] == "rate_limit_error" and "retry in 2s" in body["error"]["message"]
    assert err.status_code == 429
    load = wait_idle(grpc_client, timeout=30)
    assert load.num_running == 0 and load.kv_pages_free == load.kv_pages_total and load.invariant_error == ""


def test_draining_is_503(oai, base, grpc_client):
    assert grpc_client.drain().draining
    try:
        status, body = get(base, "/health")
        assert status == 503 and "draining" in json.loads(body)["error"]["message"]
        with pytest.raises(openai.InternalServerError) as e:
            oai.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert e.value.status_code == 503 and "draining" in e.value.body["message"]
    finally:
        assert not grpc_client.drain(resume=True).draining
    assert get(base, "/health")[0] == 200
    assert oai.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
