"""Server behaviour under pressure and at shutdown, on a deliberately slow instance (50 ms per step, 4 running,
4 waiting): queue overflow is RESOURCE_EXHAUSTED with a retry hint while accepted requests all finish; a deadline
shorter than the generation is DEADLINE_EXCEEDED and frees the pages; SIGTERM drains without losing a request."""
import asyncio
import concurrent.futures
import threading
import time
import urllib.request

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from serving.wire.client import AsyncClient, Client, ClientError
from models.synthetic import shared_small_llama
from serving.process import ServerProcess
from tests.support.server import wait_idle

pytestmark = pytest.mark.e2e


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector on 127.0.0.1 that keeps what it receives."""

    def __init__(self):
        self.spans = []
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    yield c
    c.server.stop(0)


@pytest.fixture(scope="module")
def server(tmp_path_factory, collector):
    workdir = tmp_path_factory.mktemp("slow_server")
    flagfile = workdir / "server.flags"
    flagfile.write_text("\n".join(["--debug_step_delay_s=0.05", "--max_num_seqs=4", "--max_waiting_requests=4",
                                   "--retry_after_s=0.25", "--drain_grace_s=30", "--log_format=json",
                                   f"--otlp_endpoint=127.0.0.1:{collector.port}"]) + "\n")
    proc = ServerProcess(shared_small_llama(), str(workdir), f"--flagfile={flagfile}",
                         env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        yield proc.wait_ready()
    finally:
        proc.terminate()


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target, timeout=60) as c:
        yield c


def test_queue_overflow_is_resource_exhausted_and_accepted_requests_finish(server, client):
    async def main():
        async with AsyncClient(server.target, timeout=60) as c:
            async def one(i):
                try:
                    return await c.complete([3 + i] * 8, max_tokens=6, ignore_eos=True, temperature=0.0)
                except ClientError as e:
                    return e
            return await asyncio.gather(*[one(i) for i in range(16)])

    results = asyncio.run(main())
    rejected = [r for r in results if isinstance(r, ClientError)]
    accepted = [r for r in results if not isinstance(r, ClientError)]
    assert rejected and accepted, results
    for e in rejected:
        assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_waiting_requests" in e.details
        assert e.retry_after_s == 0.25
    assert all(o.finish_reason == "length" and o.completion_tokens == 6 for o in accepted)
    load = wait_idle(client)
    assert load.invariant_error == "" and load.kv_pages_free == load.kv_pages_total


def test_deadline_exceeded_frees_pages(server, client):
    t0 = time.monotonic()
    with pytest.raises(ClientError) as e:
        client.complete([5] * 12, max_tokens=300, ignore_eos=True, timeout=0.6)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 3.0
    load = wait_idle(client)
    assert load.invariant_error == "" and load.num_running == 0
    assert load.kv_pages_free == load.kv_pages_total, "the timed-out request's pages were not freed"
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    timeouts = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "meshserve:request_success_total" and s.labels.get("finished_reason") == "timeout"]
    assert timeouts == [1.0]
    # The slow device shows in the load report's step times.
    assert client.get_load().step_time_p50_s >= 0.05


def test_traces_are_exported_over_otlp(server, client, collector):
    client.complete([7] * 20, max_tokens=3, ignore_eos=True, request_id="otlp-1")
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10:
        roots = [s for s in collector.spans if s.name == "generate" and any(
            a.key == "meshserve.request_id" and a.value.string_value == "otlp-1" for a in s.attributes)]
        if roots:
            break
        time.sleep(0.05)
    assert len(roots) == 1
    children = {s.name for s in collector.spans if s.parent_span_id == roots[0].span_id}
    assert children == {"queue", "prefill_chunk", "decode"}


def test_sigterm_drains_without_losing_a_running_request(server, client):
    got, first_token, errors = [], threading.Event(), []

    def stream():
        try:
            for r in client.generate([9] * 10, max_tokens=30, ignore_eos=True, temperature=0.0):
                got.append(r)
                first_token.set()
        except ClientError as e:  # pragma: no cover - reported below
            errors.append(e)
            first_token.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first_token.wait(30)
    server.proc.send_signal(15)
    time.sleep(0.3)
    with pytest.raises(ClientError) as e:  # no new admissions while draining
        client.complete([4, 5, 6], max_tokens=2)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    t.join(60)
    assert not errors, errors
    assert sum(len(r.token_ids) for r in got) == 30 and got[-1].finish_reason != 0
    assert server.proc.wait(60) == 0
    log = server.log()
    assert '"msg": "SIGTERM: draining"' in log and "drained in" in log
