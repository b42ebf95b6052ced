"""The gateway in-process in front of a fake instance (a few lines of grpc.aio): the trace context crosses from
client to gateway to instance, TLS on the gateway's port, and the HTTP API of a gateway without a tokenizer (what it
forwards, how it answers). No model, no instance process."""
from __future__ import annotations

import asyncio
import subprocess
import time

import json
import urllib.error
import urllib.request

import grpc
import pytest
import yaml
from opentelemetry.propagate import inject
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from serving.gateway.app import Gateway
from serving.gateway.security import server_credentials
from serving.gateway.service import InferenceServicer
from serving.wire.client import generate_request
from serving.wire import meshserve_pb2 as pb
from serving.wire import meshserve_pb2_grpc as pb_grpc


class FakeInstance(pb_grpc.InferenceServicer):
    """Three tokens (10, 11, 12; text "t0" "t1" "t2") per sample, the usage an instance sends, logprobs if asked."""

    def __init__(self):
        self.metadata: list[dict] = []
        self.requests: list[pb.GenerateRequest] = []

    async def Generate(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        self.requests.append(request)
        n = request.sampling.n if request.sampling.HasField("n") else 1
        for i in range(3):
            for j in range(n):
                r = pb.GenerateResponse(request_id=request.request_id, token_ids=[10 + i], text=f"t{i}", index=j,
                                        finish_reason=pb.FINISH_REASON_LENGTH if i == 2 else 0)
                if request.sampling.HasField("logprobs"):
                    r.logprobs.add(token_id=10 + i, logprob=-0.5, top=[pb.TopLogprob(token_id=10 + i, logprob=-0.5)])
                if i == 0:
                    r.usage.prompt_tokens = 5
                if i == 2:
                    r.usage.MergeFrom(pb.Usage(prompt_tokens=5, completion_tokens=3, cached_prompt_tokens=2))
                yield r

    async def WatchLoad(self, request, context):
        while True:
            yield pb.LoadReport(instance_id="fake", timestamp=time.time(), serving=True, max_num_seqs=8)
            await asyncio.sleep(0.05)

    async def ModelInfo(self, request, context):
        return pb.ModelInfoResponse(vocab_size=512, max_model_len=512, max_request_bytes=1 << 20,
                                    served_model_name="fake-model", has_tokenizer=False)


async def _fake_instance():
    fake = FakeInstance()
    server = grpc.aio.server()
    pb_grpc.add_InferenceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return fake, server, port


async def _gateway(tmp_path, instance_port, credentials=None, **kw):
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump({"pools": [{"name": "a", "instances": [
        {"name": "fake", "target": f"127.0.0.1:{instance_port}"}]}]}))
    gw = Gateway(str(path), str(tmp_path / "jobs.sqlite"), **kw)
    await gw.start()
    server = grpc.aio.server()
    pb_grpc.add_InferenceServicer_to_server(InferenceServicer(gw), server)
    port = (server.add_secure_port("127.0.0.1:0", credentials) if credentials else
            server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    return gw, server, port


def test_one_trace_spans_client_gateway_and_instance(tmp_path):
    exporter = InMemorySpanExporter()

    async def main():
        fake, fake_server, fake_port = await _fake_instance()
        gw, server, port = await _gateway(tmp_path, fake_port, span_exporter=exporter)
        client_tracer = TracerProvider().get_tracer("test")
        try:
            with client_tracer.start_as_current_span("client") as client_span:
                carrier: dict[str, str] = {}
                inject(carrier)
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                    got = [r async for r in pb_grpc.InferenceStub(ch).Generate(
                        generate_request([5, 6], max_tokens=3), metadata=list(carrier.items()), timeout=10)]
            assert [t for r in got for t in r.token_ids] == [10, 11, 12]
        finally:
            await server.stop(0)
            await gw.stop()
            await fake_server.stop(0)
        return client_span, fake.metadata

    client_span, seen = asyncio.run(main())
    trace_id = client_span.get_span_context().trace_id
    [gw_span] = [s for s in exporter.get_finished_spans() if s.name == "gateway.generate"]
    assert gw_span.context.trace_id == trace_id and gw_span.parent.span_id == client_span.get_span_context().span_id
    assert [e.name for e in gw_span.events] == ["routed"]
    # The instance got the gateway span as its parent: its own spans join the same trace.
    traceparent = seen[0]["traceparent"]
    assert traceparent.split("-")[1] == f"{trace_id:032x}"
    assert traceparent.split("-")[2] == f"{gw_span.context.span_id:016x}"


def test_tls_on_the_gateway_port(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)

    async def main():
        fake, fake_server, fake_port = await _fake_instance()
        gw, server, port = await _gateway(tmp_path, fake_port, credentials=server_credentials(str(cert), str(key)))
        try:
            creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
            async with grpc.aio.secure_channel(f"localhost:{port}", creds) as ch:
                got = [r async for r in pb_grpc.InferenceStub(ch).Generate(generate_request([5], max_tokens=3),
                                                                           timeout=10)]
            assert len(got) == 3
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:  # plaintext is refused
                with pytest.raises(grpc.RpcError) as e:
                    [r async for r in pb_grpc.InferenceStub(ch).Generate(generate_request([5]), timeout=3)]
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(0)
            await gw.stop()
            await fake_server.stop(0)
    asyncio.run(main())


def _post(port: int, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_http_api_without_a_tokenizer_forwards_text_and_chats(tmp_path):
    """No tokenizer at the gateway: text prompts and chats go to the instance as meshserve.v1 text and chat (it
    renders them); what needs one (tools, echoing token ids, /tokenize) is a 400 saying how to give it one."""
    from serving.gateway.http import GatewayHTTP

    async def main():
        fake, fake_server, fake_port = await _fake_instance()
        gw, server, _ = await _gateway(tmp_path, fake_port)
        api = GatewayHTTP(gw)
        port = await api.start("127.0.0.1", 0)
        try:
            deadline = time.monotonic() + 10
            while not gw.model_name and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert gw.model_name == "fake-model" and gw.tokenizer is None
            def post(path, body):  # off the loop: the gateway serves on it
                return asyncio.to_thread(_post, port, path, body)
            chat = await post("/v1/chat/completions", {
                "model": "fake-model", "max_tokens": 3, "logprobs": True, "top_logprobs": 1,
                "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [
                    {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
            text = await post("/v1/completions", {"prompt": "hello", "max_tokens": 3, "n": 2,
                                                  "add_special_tokens": False})
            stream = await post("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True,
                                                    "stream_options": {"include_usage": True}})
            refused = [await post("/v1/chat/completions", {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f"}}]}),
                await post("/v1/completions", {"prompt": [5, 6], "echo": True}),
                await post("/tokenize", {"prompt": "x"})]
        finally:
            await api.stop()
            await server.stop(0)
            await gw.stop()
            await fake_server.stop(0)
        return fake.requests, chat, text, stream, refused

    requests, chat, text, stream, refused = asyncio.run(main())
    assert [r.WhichOneof("prompt") for r in requests] == ["chat", "text", "text"]
    assert [(m.role, m.content) for m in requests[0].chat.messages] == [("system", "s"), ("user", "a\nb")]
    assert requests[1].text == "hello" and requests[1].add_special_tokens is False and requests[1].sampling.n == 2
    status, raw = chat
    body = json.loads(raw)
    assert status == 200 and body["model"] == "fake-model"
    assert body["choices"][0]["message"]["content"] == "t0t1t2" and body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["logprobs"]["content"][0]["token"] == "token_id:10"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    completions = json.loads(text[1])
    assert [c["text"] for c in completions["choices"]] == ["t0t1t2", "t0t1t2"]
    assert completions["usage"]["completion_tokens"] == 6
    events = stream[1].split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and '"usage":{"prompt_tokens":5' in events[-3]
    assert [status for status, _ in refused] == [400, 400, 400]
    errors = [json.loads(raw)["error"] for _, raw in refused]
    assert [e["param"] for e in errors] == ["tools", "echo", "prompt"]
    assert all("tokenizer" in e["message"] for e in errors)
