"""The gateway's jobs and callbacks under attack, in-process in front of a fake instance (a few lines of grpc.aio),
with real gRPC and real HTTP receivers on 127.0.0.1: callback URLs that try to reach what they should not (a redirect
to another host, an unlisted port, userinfo and backslash forms, a name that resolves to loopback, a receiver that
drips one byte a second), signed deliveries, a receiver down across a gateway restart, idempotent submission, tenant
isolation and CancelJob, retention, and a configuration reload that would turn authentication off."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import http.server
import json
import socket
import threading
import time
import types

import grpc
import pytest
import yaml

from serving.gateway.app import Gateway
from serving.gateway.proto import gateway_pb2 as gpb
from serving.gateway.proto import gateway_pb2_grpc as gpb_grpc
from serving.gateway.service import AdminServicer, InferenceServicer, JobsServicer
from serving.wire.client import generate_request
from serving.wire import meshserve_pb2 as pb
from serving.wire import meshserve_pb2_grpc as pb_grpc

ALICE_KEY = bytes(range(32))
ALICE_SECRET = "whsec_" + base64.b64encode(ALICE_KEY).decode()
AUTH = {"tenants": [{"name": "alice", "api_keys": ["key-alice"], "webhook_secret": ALICE_SECRET},
                    {"name": "bob", "api_keys": ["key-bob"]}],
        "admin_keys": ["key-admin"]}
FAST_RETRIES = {"retry_initial_s": 0.1, "retry_max_s": 0.3, "retry_window_s": 2.0, "timeout_s": 1.0}


def _md(key):
    return [("authorization", f"Bearer {key}")]


class FakeInstance(pb_grpc.InferenceServicer):
    """max_tokens tokens (10, 11, ...), `delay` seconds apart; counts streams cancelled by the gateway."""

    def __init__(self):
        self.delay = 0.0
        self.cancelled = 0

    async def Generate(self, request, context):
        n = request.sampling.max_tokens
        try:
            for i in range(n):
                if self.delay:
                    await asyncio.sleep(self.delay)
                yield pb.GenerateResponse(request_id=request.request_id, token_ids=[10 + i], text=f"t{i}",
                                          finish_reason=pb.FINISH_REASON_LENGTH if i == n - 1 else 0,
                                          usage=pb.Usage(prompt_tokens=2, completion_tokens=i + 1))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def WatchLoad(self, request, context):
        while True:
            yield pb.LoadReport(instance_id="fake", timestamp=time.time(), serving=True, max_num_seqs=8)
            await asyncio.sleep(0.05)

    async def ModelInfo(self, request, context):
        return pb.ModelInfoResponse(vocab_size=512, max_model_len=512, max_request_bytes=1 << 20,
                                    served_model_name="fake-model")


@contextlib.asynccontextmanager
async def _cluster(tmp_path, config: dict, db: str = "jobs.sqlite"):
    """A fake instance, and a gateway (config + its pool) serving Inference, Jobs and GatewayAdmin on 127.0.0.1;
    yields a namespace with the gateway, its JobsStub, the fake and the config path. Restartable: a second
    `_cluster` on the same tmp_path and db is the same gateway after a restart."""
    fake = FakeInstance()
    fake_server = grpc.aio.server()
    pb_grpc.add_InferenceServicer_to_server(fake, fake_server)
    fake_port = fake_server.add_insecure_port("127.0.0.1:0")
    await fake_server.start()
    path = tmp_path / "gw.yaml"
    full = {"pools": [{"name": "a", "instances": [{"name": "fake", "target": f"127.0.0.1:{fake_port}"}]}], **config}
    path.write_text(yaml.safe_dump(full))
    gw = Gateway(str(path), str(tmp_path / db))
    await gw.start()
    server = grpc.aio.server()
    pb_grpc.add_InferenceServicer_to_server(InferenceServicer(gw), server)
    gpb_grpc.add_JobsServicer_to_server(JobsServicer(gw), server)
    gpb_grpc.add_GatewayAdminServicer_to_server(AdminServicer(gw), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 10
        while gw.pools.instances["fake"].report is None:  # routable once it reports
            assert time.monotonic() < deadline, "no load report from the fake instance"
            await asyncio.sleep(0.02)
        yield types.SimpleNamespace(gw=gw, jobs=gpb_grpc.JobsStub(channel), fake=fake, path=path, channel=channel,
                                    config=full)
    finally:
        await channel.close()
        await server.stop(0)
        await gw.stop()
        await fake_server.stop(0)


async def _until(c, job_id, done, key="key-alice", timeout=20.0) -> gpb.Job:
    deadline = time.monotonic() + timeout
    while True:
        job = await c.jobs.GetJob(gpb.GetJobRequest(job_id=job_id), metadata=_md(key))
        if done(job):
            return job
        assert time.monotonic() < deadline, job
        await asyncio.sleep(0.05)


def _finished(job):
    return job.state in (gpb.JOB_STATE_SUCCEEDED, gpb.JOB_STATE_FAILED, gpb.JOB_STATE_CANCELLED)


def _callback_settled(job):
    return job.callback_status in ("delivered", "failed")


class Receiver:
    """An HTTP receiver on 127.0.0.1 in a thread: records each POST (headers, body) and answers `status` (with
    `location` for a redirect)."""

    def __init__(self, status=200, location="", port=0, host="127.0.0.1"):
        self.hits: list[tuple[dict, bytes]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.hits.append(({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Dripper:
    """Accepts, then sends a 200 status line one byte a second; records how long each connection stayed open."""

    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.open_for: list[float] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn):
        reply = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
        t0 = last = time.monotonic()
        sent = 0
        conn.settimeout(0.1)
        with conn:
            while sent < len(reply):
                try:
                    if conn.recv(65536) == b"":  # the client hung up
                        break
                except socket.timeout:
                    pass
                except OSError:
                    break
                if time.monotonic() - last >= 1.0:
                    try:
                        conn.sendall(reply[sent:sent + 1])
                    except OSError:
                        break
                    sent, last = sent + 1, time.monotonic()
        self.open_for.append(time.monotonic() - t0)

    def close(self):
        self.server.close()


def _verify(headers: dict, body: bytes, key: bytes) -> None:
    """Standard Webhooks verification, written from the spec (not the gateway's code)."""
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    versions = dict(sig.split(",", 1) for sig in headers["webhook-signature"].split())
    assert hmac.compare_digest(versions["v1"], expected)
    assert abs(int(headers["webhook-timestamp"]) - time.time()) < 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_callbacks_reach_only_what_the_policy_allows(tmp_path):
    # `elsewhere` (an unlisted port) and `other_host` (127.0.0.2, the redirect's target) must never be reached.
    good, elsewhere, other_host, dripper = Receiver(), Receiver(), Receiver(host="127.0.0.2"), Dripper()
    redirecting = Receiver(status=307, location=f"http://127.0.0.2:{other_host.port}/stolen")
    ports = [good.port, redirecting.port, dripper.port, other_host.port]  # the redirect differs by host only
    config = {**AUTH, "callbacks": {"allowed_hosts": ["127.0.0.1", "localhost"], "allowed_ports": ports,
                                    **FAST_RETRIES}}
    req = generate_request([5, 6], max_tokens=3)

    async def main():
        async with _cluster(tmp_path, config) as c:
            refused = {}
            for name, url in {
                    "unlisted port": f"http://127.0.0.1:{elsewhere.port}/x",
                    "userinfo": f"http://127.0.0.1:{elsewhere.port}@127.0.0.1:{good.port}/x",
                    "userinfo, allowed part first": f"http://127.0.0.1:{good.port}@localhost:{elsewhere.port}/x",
                    "backslash": f"http://127.0.0.1:{elsewhere.port}\\@127.0.0.1:{good.port}/x",
                    "a name that resolves to 127.0.0.1": f"http://localhost:{good.port}/x"}.items():
                with pytest.raises(grpc.RpcError) as e:
                    await c.jobs.SubmitJob(gpb.SubmitJobRequest(request=req, callback_url=url),
                                           metadata=_md("key-alice"))
                refused[name] = (e.value.code(), e.value.details())
            # Bob has no webhook secret (and the file no default one): an unsigned callback is not sent at all.
            with pytest.raises(grpc.RpcError) as e:
                await c.jobs.SubmitJob(gpb.SubmitJobRequest(request=req, callback_url=f"http://127.0.0.1:{good.port}/"),
                                       metadata=_md("key-bob"))
            refused["no secret"] = (e.value.code(), e.value.details())
            jobs = {}
            for name, port in (("good", good.port), ("redirect", redirecting.port), ("drip", dripper.port)):
                url = f"http://127.0.0.1:{port}/hook?tenant=alice#frag"
                jobs[name] = (await c.jobs.SubmitJob(gpb.SubmitJobRequest(request=req, callback_url=url),
                                                     metadata=_md("key-alice"))).job_id
            return refused, {k: await _until(c, j, _callback_settled) for k, j in jobs.items()}

    try:
        refused, jobs = asyncio.run(main())
    finally:
        for r in (good, elsewhere, other_host, redirecting, dripper):
            r.close()
    assert refused["unlisted port"][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert f"port {elsewhere.port} is not on the gateway's callback allow-list" in refused["unlisted port"][1]
    for name in ("userinfo", "userinfo, allowed part first"):
        assert refused[name] == (grpc.StatusCode.INVALID_ARGUMENT,
                                 "callback_url: user information (user@host) is not allowed"), name
    assert "backslashes are not allowed" in refused["backslash"][1]
    assert "'localhost' resolves to" in refused["a name that resolves to 127.0.0.1"][1]
    assert "127.0.0.1" in refused["a name that resolves to 127.0.0.1"][1]
    assert refused["no secret"][0] == grpc.StatusCode.FAILED_PRECONDITION and "'bob'" in refused["no secret"][1]
    assert not elsewhere.hits and not other_host.hits  # no refused URL reached anything, no redirect was followed
    # The allowed receiver got one signed delivery, at the rebuilt URL (the fragment dropped).
    assert jobs["good"].callback_status == "delivered" and jobs["good"].callback_attempts == 1
    assert jobs["good"].callback_url == f"http://127.0.0.1:{good.port}/hook?tenant=alice"
    [(headers, body)] = good.hits
    _verify(headers, body, ALICE_KEY)
    payload = json.loads(body)
    assert headers["webhook-id"] == payload["job_id"] == jobs["good"].job_id
    assert payload["state"] == "JOB_STATE_SUCCEEDED" and payload["token_ids"] == [10, 11, 12]
    # The redirect is an answer that is not 2xx: retried within the window, never followed.
    assert jobs["redirect"].callback_status == "failed" and len(redirecting.hits) == jobs["redirect"].callback_attempts
    assert jobs["redirect"].callback_attempts >= 3
    # The dripping receiver is cut off at the attempt's deadline (1 s), not after the 37 s its answer would take.
    assert jobs["drip"].callback_status == "failed" and dripper.open_for and max(dripper.open_for) < 3.5
    # What a tenant reads is generic: no exception text, no address (no port-scan oracle).
    for job in jobs.values():
        assert job.callback_status in ("delivered", "failed") and not job.error_message


def test_a_receiver_down_across_a_gateway_restart_still_gets_the_result(tmp_path):
    port = _free_port()  # nothing listens there yet: connection refused
    config = {**AUTH, "callbacks": {"allowed_hosts": ["127.0.0.1"], "allowed_ports": [port], "retry_initial_s": 0.2,
                                    "retry_max_s": 0.5, "retry_window_s": 60.0, "timeout_s": 1.0}}

    async def first():
        async with _cluster(tmp_path, config) as c:
            job = await c.jobs.SubmitJob(gpb.SubmitJobRequest(request=generate_request([5], max_tokens=2),
                                                              callback_url=f"http://127.0.0.1:{port}/done"),
                                         metadata=_md("key-alice"))
            return await _until(c, job.job_id, lambda j: j.callback_attempts >= 2)

    async def second(job_id):
        async with _cluster(tmp_path, config) as c:
            await asyncio.sleep(0.5)
            receiver = Receiver(port=port)  # back up
            try:
                return await _until(c, job_id, _callback_settled), receiver.hits
            finally:
                receiver.close()

    pending = asyncio.run(first())
    assert pending.state == gpb.JOB_STATE_SUCCEEDED and pending.callback_status == "pending"
    done, hits = asyncio.run(second(pending.job_id))  # the same jobs file: the gateway after a restart
    assert done.callback_status == "delivered" and done.callback_attempts > pending.callback_attempts
    [(headers, body)] = hits
    _verify(headers, body, ALICE_KEY)
    assert json.loads(body)["token_ids"] == [10, 11]


def test_idempotency_tenant_isolation_cancel_and_retention(tmp_path):
    config = {**AUTH, "jobs": {"retention_s": 1.0}}

    async def main():
        async with _cluster(tmp_path, config) as c:
            c.fake.delay = 0.05
            req = generate_request([5, 6], max_tokens=100)
            submit = gpb.SubmitJobRequest(request=req, idempotency_key="order-17")
            # A SubmitJob retried (twice at once, then again) with the same key: one job.
            first, again = await asyncio.gather(*[c.jobs.SubmitJob(submit, metadata=_md("key-alice"))
                                                  for _ in range(2)])
            third = await c.jobs.SubmitJob(submit, metadata=_md("key-alice"))
            ids = {first.job_id, again.job_id, third.job_id}
            count = c.gw.jobs.store.db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]
            with pytest.raises(grpc.RpcError) as reused:
                await c.jobs.SubmitJob(gpb.SubmitJobRequest(request=generate_request([7], max_tokens=100),
                                                            idempotency_key="order-17"), metadata=_md("key-alice"))
            bobs = await c.jobs.SubmitJob(submit, metadata=_md("key-bob"))  # keys are per tenant
            job_id = first.job_id
            await _until(c, job_id, lambda j: j.state == gpb.JOB_STATE_RUNNING)
            denied = []
            for call in (c.jobs.GetJob, c.jobs.CancelJob):
                with pytest.raises(grpc.RpcError) as e:
                    await call(gpb.GetJobRequest(job_id=job_id) if call is c.jobs.GetJob else
                               gpb.CancelJobRequest(job_id=job_id), metadata=_md("key-bob"))
                denied.append((e.value.code(), e.value.details()))
            seen_by_admin = await c.jobs.GetJob(gpb.GetJobRequest(job_id=job_id), metadata=_md("key-admin"))
            cancelled = await c.jobs.CancelJob(gpb.CancelJobRequest(job_id=job_id), metadata=_md("key-alice"))
            await asyncio.sleep(0.3)
            streams_cut = c.fake.cancelled
            by_admin = await c.jobs.CancelJob(gpb.CancelJobRequest(job_id=bobs.job_id), metadata=_md("key-admin"))
            after = await c.jobs.GetJob(gpb.GetJobRequest(job_id=job_id), metadata=_md("key-alice"))
            await asyncio.sleep(2.0)  # past the 1 s retention window (swept every 0.5 s)
            with pytest.raises(grpc.RpcError) as gone:
                await c.jobs.GetJob(gpb.GetJobRequest(job_id=job_id), metadata=_md("key-alice"))
            return (ids, count, reused.value, bobs, denied, seen_by_admin, cancelled, streams_cut, by_admin, after,
                    gone.value)

    ids, count, reused, bobs, denied, seen_by_admin, cancelled, streams_cut, by_admin, after, gone = asyncio.run(main())
    assert len(ids) == 1 and count == 1
    assert reused.code() == grpc.StatusCode.ALREADY_EXISTS and "'order-17' was used for a different" in reused.details()
    assert bobs.job_id not in ids and bobs.tenant == "bob"
    assert denied == [(grpc.StatusCode.NOT_FOUND, f"job_id: no job {seen_by_admin.job_id!r}")] * 2
    assert seen_by_admin.tenant == "alice"
    assert cancelled.state == gpb.JOB_STATE_CANCELLED and cancelled.error_message == "cancelled by alice"
    assert streams_cut == 1  # the instance's stream was cancelled with the job
    assert by_admin.state == gpb.JOB_STATE_CANCELLED and by_admin.error_message == "cancelled by an admin"
    assert after.state == gpb.JOB_STATE_CANCELLED and len(after.result.token_ids) == 0
    assert gone.code() == grpc.StatusCode.NOT_FOUND


def test_an_empty_config_written_over_a_running_gateway_keeps_auth_on(tmp_path):
    async def main():
        async with _cluster(tmp_path, AUTH) as c:
            stub = pb_grpc.InferenceStub(c.channel)
            for text in ("", "pools: [{name: a, instances: [{name: fake, tar"):  # empty, then half-written
                c.path.write_text(text)
                await asyncio.sleep(1.6)  # the file is polled every second
                with pytest.raises(grpc.RpcError) as e:
                    async for _ in stub.Generate(generate_request([5], max_tokens=1)):
                        pass
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, text
            ok = [r async for r in stub.Generate(generate_request([5], max_tokens=1), metadata=_md("key-alice"))]
            return c.gw.watcher.version, c.gw.watcher.last_error, ok

    version, error, ok = asyncio.run(main())
    assert version == 1 and "not valid YAML" in error and len(ok) == 1


@pytest.mark.e2e
def test_a_job_that_crashes_the_gateway_stops_being_retried(tmp_path):
    """A real gateway process whose job kills it (injected: tests/support/crashing_gateway.py): run again after the
    first crash, failed with a clear error after the second (jobs.max_crashes: 2), and the gateway serves on."""
    import sqlite3

    from serving.process import ReadyFileProcess
    from tests.support.crashing_gateway import CRASH_EXIT_CODE
    from tests.support.gateway import GatewayProcess

    gw = GatewayProcess(str(tmp_path), {"jobs": {"max_crashes": 2}}, module="tests.support.crashing_gateway")
    try:
        with grpc.insecure_channel(gw.target) as ch:
            try:
                gpb_grpc.JobsStub(ch).SubmitJob(gpb.SubmitJobRequest(
                    request=generate_request([5, 6], max_tokens=2, request_id="crash-1")), timeout=10)
            except grpc.RpcError:
                pass  # the job may kill the gateway before its answer is out; the job is stored before that
        assert gw.proc.wait(30) == CRASH_EXIT_CODE
        [(job_id,)] = sqlite3.connect(gw.jobs_db).execute("SELECT job_id FROM jobs").fetchall()
        ReadyFileProcess.start(gw)  # restarted: the job runs again, and kills it again
        assert gw.proc.wait(30) == CRASH_EXIT_CODE
        gw.start()  # restarted: the job is failed, not run
        with grpc.insecure_channel(gw.target) as ch:
            job = gpb_grpc.JobsStub(ch).GetJob(gpb.GetJobRequest(job_id=job_id), timeout=10)
            normal = gpb_grpc.JobsStub(ch).SubmitJob(gpb.SubmitJobRequest(request=generate_request([5], max_tokens=1)),
                                                     timeout=10)
        assert gw.proc.poll() is None and normal.state == gpb.JOB_STATE_QUEUED
        assert job.state == gpb.JOB_STATE_FAILED and job.error_code == "INTERNAL" and job.attempts == 2
        assert "stopped unexpectedly 2 times while running this job" in job.error_message
        assert "died 2 times while running it; failed, not run again" in gw.log()
    finally:
        gw.stop()
