"""Traces of requests (in-process server, in-memory exporter): the `generate` span continues the caller's trace
and holds `queue`, one `prefill_chunk` per chunk and `decode` with a timed event per token (its id only with
trace_content). Also: a step that fails inside the engine fails only its requests, with INTERNAL, and the server keeps
serving; spans exported over TLS to a real OTLP collector that only speaks TLS."""
import asyncio
import threading
import time

import grpc
import pytest
from opentelemetry.propagate import inject
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode, set_span_in_context

from serving.core.config import EngineConfig
from serving.core.engine import Engine
from serving.server.app import InstanceServer, ServerConfig
from serving.wire.client import Client, ClientError
from models.synthetic import shared_small_llama
from serving.telemetry.tracing import make_tracer_provider


@pytest.fixture(scope="module")
def traced():
    exporter = InMemorySpanExporter()
    engine = Engine(EngineConfig(model=shared_small_llama(), page_size=8, num_pages=256, max_num_seqs=8,
                                 max_num_batched_tokens=32, min_token_bucket=32, max_prefill_chunk=16))
    server = InstanceServer(engine, ServerConfig(port=0, metrics_port=-1, warmup=False), span_exporter=exporter)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(120)
    client = Client(f"127.0.0.1:{server.port}", timeout=120)
    server.test_loop = loop
    try:
        yield server, exporter, client
    finally:
        client.close()
        asyncio.run_coroutine_threadsafe(server.stop(grace_s=5), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def wait_for_spans(exporter, n_roots, timeout=10.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        spans = exporter.get_finished_spans()
        if sum(s.name == "generate" for s in spans) >= n_roots:
            return spans
        time.sleep(0.02)
    raise AssertionError(f"no {n_roots} generate spans: {[s.name for s in exporter.get_finished_spans()]}")


def test_request_spans_with_parents_chunks_and_token_events(traced):
    server, exporter, client = traced
    exporter.clear()
    caller_exporter = InMemorySpanExporter()
    caller = TracerProvider()
    caller.add_span_processor(SimpleSpanProcessor(caller_exporter))
    with caller.get_tracer("test").start_as_current_span("caller") as caller_span:
        carrier = {}
        inject(carrier, context=set_span_in_context(caller_span))
        out = client.complete(list(range(3, 43)), max_tokens=5, ignore_eos=True, temperature=0.0,
                              request_id="traced-1", tenant="acme", metadata=tuple(carrier.items()))
    assert out.completion_tokens == 5
    spans = wait_for_spans(exporter, 1)
    root = next(s for s in spans if s.name == "generate")
    assert root.parent is not None and root.parent.span_id == caller_span.get_span_context().span_id
    assert root.context.trace_id == caller_span.get_span_context().trace_id
    assert root.attributes["meshserve.request_id"] == "traced-1" and root.attributes["meshserve.tenant"] == "acme"
    assert root.attributes["meshserve.finish_reason"] == "length"
    children = [s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id]
    names = [s.name for s in sorted(children, key=lambda s: s.start_time)]
    assert names == ["queue", "prefill_chunk", "prefill_chunk", "prefill_chunk", "decode"], names
    chunks = [s for s in children if s.name == "prefill_chunk"]
    assert [(c.attributes["meshserve.chunk_start"], c.attributes["meshserve.chunk_tokens"])
            for c in sorted(chunks, key=lambda s: s.start_time)] == [(0, 16), (16, 16), (32, 8)]
    decode = next(s for s in children if s.name == "decode")
    events = decode.events
    assert [e.name for e in events] == ["token"] * 5
    assert [e.attributes["meshserve.token_index"] for e in events] == list(range(5))
    assert not any("meshserve.token_id" in e.attributes for e in events)  # no content without trace_content
    stamps = [e.timestamp for e in events]
    assert stamps == sorted(stamps) and decode.start_time <= stamps[0] and stamps[-1] <= decode.end_time
    queue = next(s for s in children if s.name == "queue")
    assert root.start_time <= queue.start_time <= queue.end_time <= min(c.start_time for c in chunks) + 1_000_000
    assert all(root.start_time <= s.start_time and s.end_time <= root.end_time for s in children)


def test_token_ids_are_traced_only_with_trace_content(traced):
    server, exporter, client = traced
    exporter.clear()
    server.tracer.trace_content = True
    try:
        out = client.complete(list(range(3, 43)), max_tokens=3, ignore_eos=True, temperature=0.0,
                              request_id="content-1")
    finally:
        server.tracer.trace_content = False
    decode = next(s for s in wait_for_spans(exporter, 1) if s.name == "decode")
    assert [e.attributes["meshserve.token_id"] for e in decode.events] == out.token_ids


def test_a_failing_step_fails_its_requests_with_internal_and_the_server_keeps_serving(traced, caplog):
    server, exporter, client = traced
    engine = server.engine
    real = engine.runner._forward_fn
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected device failure")
        return real(*args, **kwargs)

    engine.runner._forward_fn = failing
    exporter.clear()
    try:
        with pytest.raises(ClientError) as e:
            client.complete([5, 6, 7, 8], max_tokens=4, request_id="doomed")
        # The client reads that its request failed and where to look, never the exception's text (docs/security.md)
        assert e.value.code == grpc.StatusCode.INTERNAL and "doomed" in e.value.details, e.value.details
        assert "injected device failure" not in e.value.details and "injected device failure" in caplog.text
    finally:
        engine.runner._forward_fn = real
    assert client.complete([5, 6, 7, 8], max_tokens=4, ignore_eos=True).completion_tokens == 4
    load = client.get_load(check_invariants=True)
    assert load.invariant_error == "" and load.kv_pages_free == load.kv_pages_total
    spans = wait_for_spans(exporter, 2)
    doomed = next(s for s in spans if s.name == "generate" and s.attributes["meshserve.request_id"] == "doomed")
    assert doomed.status.status_code is StatusCode.ERROR and doomed.attributes["meshserve.finish_reason"] == "error"


def test_spans_go_over_tls_to_a_collector_given_its_ca(tmp_path):
    """A real OTLP/gRPC collector on 127.0.0.1 that serves only TLS: with its CA the span arrives."""
    import subprocess
    from concurrent import futures
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", "key.pem", "-out", "cert.pem"],
                   cwd=tmp_path, check=True, capture_output=True)
    received = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            received.extend(s.name for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans)
            return trace_service_pb2.ExportTraceServiceResponse()
    collector = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), collector)
    credentials = grpc.ssl_server_credentials([((tmp_path / "key.pem").read_bytes(),
                                                (tmp_path / "cert.pem").read_bytes())])
    port = collector.add_secure_port("127.0.0.1:0", credentials)
    collector.start()
    try:
        provider = make_tracer_provider("svc", otlp_endpoint=f"127.0.0.1:{port}",
                                        otlp_ca_file=str(tmp_path / "cert.pem"))
        provider.get_tracer("test").start_span("over-tls").end()
        assert provider.force_flush(10_000)
        provider.shutdown()
    finally:
        collector.stop(0)
    assert received == ["over-tls"]


def test_otlp_exporter_is_configured_from_an_endpoint():
    provider = make_tracer_provider("svc", otlp_endpoint="127.0.0.1:4317")
    assert provider is not None and provider.resource.attributes["service.name"] == "svc"
    provider.shutdown()
    assert make_tracer_provider("svc") is None


def test_shutdown_after_the_grace_period_ends_requests_with_unavailable(traced):
    """Runs last in this module: it stops the server."""
    server, _, client = traced
    server.engine.config.debug_step_delay_s = 0.01  # ~5 s for the request below: longer than the grace period
    started, errors, got = threading.Event(), [], []

    def stream():
        try:
            for r in client.generate([5] * 8, max_tokens=480, ignore_eos=True):
                got.extend(r.token_ids)
                started.set()
        except ClientError as e:
            errors.append(e)
            started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    asyncio.run_coroutine_threadsafe(server.stop(grace_s=0.3), server.test_loop).result(60)
    t.join(30)
    assert len(errors) == 1 and errors[0].code == grpc.StatusCode.UNAVAILABLE, (errors, len(got))
    assert "shut down" in errors[0].details and 0 < len(got) < 480
    assert not server.engine.has_unfinished()
    server.engine.scheduler.block_manager.check_idle()
