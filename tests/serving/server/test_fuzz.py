"""Fuzzing both front ends, end to end: one `python -m serving.server --http_port=0` process and one gateway in front of
it get hypothesis-drawn meshserve.v1 GenerateRequests over every field (out-of-range and NaN/inf numbers, huge and empty
values, token ids outside the vocabulary, prompts longer than the context, unknown priorities, deadlines already past),
OpenAI HTTP bodies (wrong types and values, raw NaN/Infinity, invalid UTF-8, huge and cut-short bodies, wrong content
types) and raw bytes on the gRPC, HTTP and metrics ports. Every answer is a result or a status naming a field the
request set wrongly (tests/support/fuzz.py judges which); afterwards both still serve, no page or request is left over
and memory did not grow. Every run draws the same examples (tests/conftest.py); MESHSERVE_EXPLORE=1 explores new ones
(MESHSERVE_FUZZ_SCALE=10 draws ten times as many). Bytes protobuf cannot decode (a string that is not UTF-8, a corrupt
message) are INVALID_ARGUMENT naming the field (serving/wire/decoding.py); messages past the transport's limit are
refused before they are decoded; grammars over the size and nesting bounds are INVALID_ARGUMENT; HTTP bodies past the
cap are 413 before they are read, stop strings past their bounds a 400 / INVALID_ARGUMENT naming `stop`."""
from __future__ import annotations

import http.client
import json
import os
import re
import socket
import time

import grpc
import pytest
from hypothesis import HealthCheck, event, example, given, settings

from models.synthetic import shared_small_llama
from models.tokenizer import Tokenizer
from serving.process import ServerProcess
from serving.wire.client import Client, generate_request
from serving.wire import meshserve_pb2 as pb
from serving.wire import meshserve_pb2_grpc as pb_grpc
from tests.support import fuzz
from tests.support.gateway import GatewayProcess, wait_for
from tests.support.server import running, wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

FRONTS = ("instance", "gateway")


def fuzzing(max_examples: int) -> settings:
    """max_examples times MESHSERVE_FUZZ_SCALE (default 1; raise it to explore longer)."""
    scale = float(os.environ.get("MESHSERVE_FUZZ_SCALE", "1"))
    return settings(max_examples=max(1, int(max_examples * scale)), deadline=None, suppress_health_check=[
        HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])


RSS_GROWTH_LIMIT = 100 << 20
StatusCode = grpc.StatusCode
SERVED = (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


@pytest.fixture(scope="module")
def model_dir():
    return shared_small_llama()


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with running(ServerProcess(model_dir, str(tmp_path_factory.mktemp("fuzz_server")), "--http_port=0",
                               f"--served_model_name={fuzz.MODEL}")) as proc:
        yield proc


@pytest.fixture(scope="module")
def gateway(server, tmp_path_factory):
    config = {"pools": [{"name": "a", "instances": [{"name": "i0", "target": server.target}]}],
              "isolation": {"enabled": False}}  # fuzzed deadlines must not get the one instance quarantined
    gw = GatewayProcess(str(tmp_path_factory.mktemp("fuzz_gateway")), config, "--http_port=0")
    try:
        wait_for(lambda: all(i.report_age_s >= 0 for i in gw.instances().values()), 30, what="a load report")
        yield gw
    finally:
        rc = gw.stop()
        assert rc == 0, f"the gateway exited with {rc}:\n{gw.log()[-4000:]}"


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        kb = next(line for line in f if line.startswith("VmRSS:")).split()[1]
    return int(kb) << 10


class Front:
    """One front end under fuzzing: its process, a gRPC stub, its HTTP and metrics ports, its memory at the start."""

    def __init__(self, name: str, proc):
        self.name, self.proc = name, proc
        self.channel = grpc.insecure_channel(proc.target, options=_CHANNEL_OPTIONS)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.ports = {"grpc": proc.port, "http": proc.info["http_port"], "metrics": proc.metrics_port}
        self.rss_start = 0

    def serves(self) -> None:
        """A normal request over each API gets its answer."""
        responses = list(self.stub.Generate(pb.GenerateRequest(text="Hello", sampling=pb.SamplingParameters(
            max_tokens=3, ignore_eos=True)), timeout=60))
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        status, data = post(self.ports["http"], "/v1/completions",
                               json.dumps({"prompt": "Hello", "max_tokens": 3}).encode())
        assert status == 200 and json.loads(data)["choices"][0]["finish_reason"] in ("stop", "length"), data


def warm_up(front: Front) -> None:
    """Runs the programs and paths the fuzzer will, so what they first allocate is in the starting memory."""
    front.serves()
    for kw in (dict(temperature=0.0, logprobs=20, logit_bias={5: 3.0}, n=3, stop=["x"]),
               dict(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5,
                    frequency_penalty=0.5, seed=1, logprobs=0, n=16)):
        req = generate_request([7] * 500, max_tokens=4, ignore_eos=True, **kw)
        assert list(front.stub.Generate(req, timeout=120))[-1].finish_reason == pb.FINISH_REASON_LENGTH
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                 "stream": True, "n": 2, "logprobs": True, "top_logprobs": 2}),
                       ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2, "echo": True})):
        assert post(front.ports["http"], path, json.dumps(body).encode())[0] == 200


@pytest.fixture(scope="module")
def fronts(server, gateway):
    made = {"instance": Front("instance", server), "gateway": Front("gateway", gateway)}
    for front in made.values():
        warm_up(front)
    for front in made.values():
        front.rss_start = rss_bytes(front.proc.proc.pid)
    yield made
    for front in made.values():
        front.channel.close()


def post(port: int, path: str, raw: bytes, headers: dict | None = None) -> tuple[int, bytes]:
    """(status, body) of a POST of the bytes `raw`."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"} if headers is None
                     else headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


# ---------------------------------------------------------------------------------------------------- meshserve.v1
def call(generate, request, timeout: float) -> tuple[list, StatusCode, str]:
    """(responses, status code, details) of a Generate call."""
    responses = []
    try:
        for r in generate(request, timeout=timeout):
            responses.append(r)
    except grpc.RpcError as e:
        return responses, e.code(), e.details() or ""
    return responses, StatusCode.OK, ""


def check_served(request: pb.GenerateRequest, responses: list) -> None:
    """A served stream: every sample ends with STOP or LENGTH, its tokens in the vocabulary and within max_tokens."""
    sp = request.sampling
    n = sp.n if sp.HasField("n") else 1
    max_tokens = sp.max_tokens if sp.HasField("max_tokens") else fuzz.DEFAULT_MAX_TOKENS
    finished, tokens = {}, {}
    for r in responses:
        assert r.index < n and r.index not in finished, r
        assert all(0 <= t < fuzz.VOCAB for t in r.token_ids), r
        tokens[r.index] = tokens.get(r.index, 0) + len(r.token_ids)
        if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            finished[r.index] = r.finish_reason
    assert sorted(finished) == list(range(n)) and all(f in SERVED for f in finished.values()), finished
    assert all(count <= max_tokens for count in tokens.values()), tokens


def _case(*args, timeout: float = fuzz.LONG, **kw) -> fuzz.GrpcCase:
    return fuzz.GrpcCase(generate_request(*args, **kw), timeout)


@pytest.mark.parametrize("front", FRONTS)
@fuzzing(100)
@given(case=fuzz.generate_requests())
@example(case=_case("hi", temperature=float("nan"), logit_bias={600: float("inf")}))
@example(case=_case([1] * 600, priority=7, request_id="r" * 300))
@example(case=_case("hi", timeout=fuzz.PAST))
# Found by this test: a chat longer than the context was refused naming `chat`, not `chat.messages`.
@example(case=_case(messages=[{"role": "user", "content": fuzz.words(600)}]))
# Issue 35: a schema nested past Python's recursion limit was UNKNOWN (a RecursionError); a grammar of any size was
# compiled on the event loop; a message of any size (up to 64 MiB) was decoded before its size was looked at.
@example(case=_case("hi", structured={"json_schema": fuzz.DEEP_SCHEMA}))
@example(case=_case("hi", structured={"grammar": fuzz.HUGE_GRAMMAR}))
@example(case=_case("z" * (fuzz.MAX_REQUEST_BYTES + fuzz.TRANSPORT_SLACK_BYTES)))
def test_generate_is_served_or_refused_naming_the_field(fronts, tok, front, case):
    responses, code, details = call(fronts[front].stub.Generate, case.request, case.timeout)
    bad = fuzz.generate_faults(case.request, tok)
    event(f"{code.name}: {min(bad)} wrong" if bad else code.name)
    allowed = {StatusCode.INVALID_ARGUMENT if bad else StatusCode.OK, StatusCode.RESOURCE_EXHAUSTED}
    if case.timeout < fuzz.LONG:
        allowed.add(StatusCode.DEADLINE_EXCEEDED)
    assert code in allowed, f"{code.name}: {details!r} (wrong: {sorted(bad)})"
    # Never decoded (unless a deadline of milliseconds passed while the bytes were still being sent).
    if case.request.ByteSize() > fuzz.MAX_REQUEST_BYTES + fuzz.TRANSPORT_SLACK_BYTES and \
            code != StatusCode.DEADLINE_EXCEEDED:
        assert code == StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details, f"{code.name}: {details!r}"
    if code == StatusCode.INVALID_ARGUMENT:
        assert bad, f"a valid request was refused: {details!r}"
        assert fuzz.field_of(details) in bad, f"{details!r} names none of the wrong fields {sorted(bad)}"
    elif code == StatusCode.OK:
        check_served(case.request, responses)


@pytest.mark.parametrize("front", FRONTS)
def test_an_undecodable_request_is_refused_naming_the_field(fronts, front):
    generate = fronts[front].channel.unary_stream("/meshserve.v1.Inference/Generate")  # bytes sent as they are
    cases = [(field, fuzz.request_with_bad_utf8(field, bad)) for field in fuzz.STRING_FIELDS for bad in fuzz.BAD_UTF8]
    cases += [("request", raw) for raw in fuzz.CORRUPT_REQUESTS]
    answers = [(field, raw, *call(generate, raw, 30)[1:]) for field, raw in cases]
    fronts[front].serves()
    wrong = [a for a in answers if a[2] != StatusCode.INVALID_ARGUMENT or fuzz.field_of(a[3]) != a[0]]
    assert not wrong, "\n".join(f"{field}: {raw[:40]!r}: {code.name}: {details}" for field, raw, code, details in wrong)


# ---------------------------------------------------------------------------------------------------- OpenAI HTTP
def events(data: bytes) -> list:
    """The JSON events of a Server-Sent Events body, which must end with [DONE]."""
    lines = [line for line in data.decode().split("\n") if line.startswith("data: ")]
    assert lines and lines[-1] == "data: [DONE]", data[-500:]
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def check_answer(case: fuzz.HttpCase, data: bytes) -> None:
    """A 200's body: every choice finished (stop or length), tokens and texts of the right types."""
    if case.path == "/tokenize":
        body = json.loads(data)
        assert body["count"] == len(body["tokens"]) and all(0 <= t < fuzz.VOCAB for t in body["tokens"]), body
        return
    if case.path == "/detokenize":
        assert isinstance(json.loads(data)["prompt"], str)
        return
    finished = {}
    if case.value("stream"):
        for chunk in events(data):
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                if choice["finish_reason"] is not None:
                    finished[choice["index"]] = choice["finish_reason"]
    else:
        for choice in json.loads(data)["choices"]:
            finished[choice["index"]] = choice["finish_reason"]
    assert sorted(finished) == list(range(fuzz.expected_choices(case))), finished
    assert set(finished.values()) <= {"stop", "length"}, finished


@pytest.mark.parametrize("front", FRONTS)
@fuzzing(100)
@given(case=fuzz.http_requests())
# Found by this test: integers beyond meshserve.v1's widths were a 500 from the gateway (building its GenerateRequest).
@example(case=fuzz.HttpCase.of("/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": 2 ** 63}, {"seed"}))
@example(case=fuzz.HttpCase.of("/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_k": 2 ** 40}, {"top_k"}))
@example(case=fuzz.HttpCase.of("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop_token_ids": [2 ** 70]},
                               {"stop_token_ids"}))
@example(case=fuzz.HttpCase.of("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "max_completion_tokens": 2 ** 40}, {"max_completion_tokens"}))
# Found by this test: chat_template_kwargs naming encode_chat's own arguments were a TypeError (500).
@example(case=fuzz.HttpCase.of("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 2, "chat_template_kwargs": {"field": 1}},
                               {"chat_template_kwargs"}))
# A request's own chat template rendered on the event loop without bound (20000 x 20000 loops held the instance 30 s).
@example(case=fuzz.HttpCase.of("/v1/chat/completions", {
    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chat_template_kwargs": {
        "chat_template": "{% for i in range(3000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}"}},
    {"chat_template_kwargs"}))
@example(case=fuzz.HttpCase.of("/v1/completions", {"prompt": "hi", "temperature": float("nan")}, {"temperature"}))
def test_http_is_served_or_refused_naming_the_parameter(fronts, tok, front, case):
    fuzz.http_faults(case, tok)
    raw, headers = case.encoded()
    status, data = post(fronts[front].ports["http"], case.path, raw, headers)
    event(f"{case.path} {status}")
    assert status in (200, 400, 404, 429), f"{status}: {data[:1000]!r}"
    if status != 200:
        error = json.loads(data)["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), error
        param = fuzz.param_of(error["param"])
    if not case.is_object:
        assert status == 400, f"{status}: {data[:1000]!r}"
        return
    if status in (400, 404):
        assert case.bad or case.maybe, f"a valid request was refused: {error}"
        assert param in case.bad | case.maybe, f"{error} names none of {sorted(case.bad | case.maybe)}"
        assert status == 400 or param == "model", error
    elif status == 200:
        assert not case.bad, f"served, though {sorted(case.bad)} are wrong: {data[:1000]!r}"
        check_answer(case, data)


@pytest.mark.parametrize("front", FRONTS)
def test_a_tokenize_body_over_the_limit_is_refused(fronts, front):
    # Found by fuzzing with huge values: /tokenize tokenized any body on the event loop (16 MiB held it 19 s, and 1 MiB
    # took a server's memory up 200 MiB). The bulk is in an ignored field: the size counts, not what is tokenized.
    raw = json.dumps({"prompt": "hi", "padding": "x" * fuzz.MAX_REQUEST_BYTES}).encode()
    status, data = post(fronts[front].ports["http"], "/tokenize", raw)
    assert status == 400 and json.loads(data)["error"]["param"] == "prompt", (status, data[:300])


# ---------------------------------------------------------------------------------------------------- raw bytes
def exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Sends `data` and half-closes; returns what came back before the server closed (or reset) the connection."""
    out = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            t0 = time.monotonic()
            while chunk := s.recv(65536):
                out += chunk
                assert time.monotonic() - t0 < timeout, "the connection stayed open"
        except socket.timeout:
            raise AssertionError(f"no close within {timeout}s; got {out[:200]!r}") from None
        except OSError:
            pass  # closed (or reset) on us mid-send or mid-read: an answer too
    return out


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("port", ["grpc", "http", "metrics"])
@fuzzing(25)
@given(garbage=fuzz.garbage())
# Issue 35: a body past the HTTP cap (a Content-Length of 100 MiB, 2 MiB chunked) is 413 before it is read.
@example(garbage=fuzz.Garbage(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 104857600\r\n\r\n{"))
@example(garbage=fuzz.Garbage(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n200000\r\n"
                              + b"a" * (2 << 20)))
def test_garbage_bytes_get_an_error_or_a_closed_connection(fronts, front, port, garbage):
    out = exchange(fronts[front].ports[port], garbage.data)
    assert not re.match(rb"HTTP/1\.[01] 5", out), out[:300]


@pytest.mark.parametrize("front", FRONTS)
def test_idle_and_half_sent_connections_do_not_block_others(fronts, front):
    """Connections that never finish a request hold nothing the next client needs."""
    f = fronts[front]
    held = []
    try:
        for port in f.ports.values():
            for partial in (b"", b"GET /met", fuzz.H2_PREFACE, b"POST /v1/completions HTTP/1.1\r\nContent-Length: 9"):
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                s.sendall(partial)
                held.append(s)
        f.serves()
        conn = http.client.HTTPConnection("127.0.0.1", f.ports["metrics"], timeout=30)
        conn.request("GET", "/metrics")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        for s in held:
            s.close()


# ---------------------------------------------------------------------------------------------------- afterwards
def test_both_still_serve_with_nothing_left_over(fronts, server, gateway):
    """Runs last (file order): after the fuzzing, both serve, no page or request is held, memory did not grow."""
    for front in fronts.values():
        assert front.proc.proc.poll() is None, f"{front.name} exited:\n{front.proc.log()[-4000:]}"
        front.serves()
    with Client(server.target, timeout=30) as client:
        load = wait_idle(client, timeout=30)
    assert load.invariant_error == "" and load.num_running == load.num_waiting == 0, load
    assert load.kv_pages_free == load.kv_pages_total, load
    wait_for(lambda: all(i.inflight == 0 for i in gateway.instances().values()), 30, what="no request in flight")
    assert [i.state for i in gateway.instances().values()] == ["healthy"]
    grown = {f.name: (f.rss_start >> 20, rss_bytes(f.proc.proc.pid) >> 20) for f in fronts.values()}
    assert all((end - start) << 20 < RSS_GROWTH_LIMIT for start, end in grown.values()), \
        f"resident memory grew (MiB, start and end): {grown}"
