"""The gateway in-process in front of a fake instance (a few lines of grpc.aio): the trace context crosses from
client to gateway to instance, and TLS on the gateway's port. No model, no instance process."""
from __future__ import annotations

import asyncio
import subprocess
import time

import grpc
import pytest
import yaml
from opentelemetry.propagate import inject
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from serving.gateway.app import Gateway
from serving.gateway.security import server_credentials
from serving.gateway.service import InferenceServicer
from serving.server.client import generate_request
from serving.server.proto import meshserve_pb2 as pb
from serving.server.proto import meshserve_pb2_grpc as pb_grpc


class FakeInstance(pb_grpc.InferenceServicer):
    def __init__(self):
        self.metadata: list[dict] = []

    async def Generate(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        for i in range(3):
            yield pb.GenerateResponse(request_id=request.request_id, token_ids=[10 + i],
                                      finish_reason=pb.FINISH_REASON_LENGTH if i == 2 else 0)

    async def WatchLoad(self, request, context):
        while True:
            yield pb.LoadReport(instance_id="fake", timestamp=time.time(), serving=True, max_num_seqs=8)
            await asyncio.sleep(0.05)

    async def ModelInfo(self, request, context):
        return pb.ModelInfoResponse(vocab_size=512, max_model_len=512, max_request_bytes=1 << 20)


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
