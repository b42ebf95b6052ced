"""The gateway end to end: a real `python -m serving.gateway` in front of real instance processes on 127.0.0.1
(three shared by the module, a fourth for the kill -9 test). Each test starts its own small gateway (~1 s) with
the configuration it needs; instances are slowed down at run time through tests.support.gateway_instance."""
from __future__ import annotations

import base64
import concurrent.futures
import http.server
import json
import threading
import time
import urllib.request

import grpc
import pytest

from serving.gateway.proto import gateway_pb2 as gpb
from serving.gateway.proto import gateway_pb2_grpc as gpb_grpc
from serving.wire.client import Client, ClientError, generate_request
from models.synthetic import shared_small_llama
from tests.support.gateway import GatewayProcess, InstanceProcess, wait_for, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def model_dir():
    return shared_small_llama()


@pytest.fixture(scope="module")
def instances(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("instances")
    # One first, then two that load its programs from the run's compilation cache (tests/conftest.py)
    # Each with a host KV tier and its KV-event stream (test_affinity_from_kv_events; no cost to the others)
    flags = ("--host_kv_cache_gb=0.01", "--kv_events_endpoint=tcp://127.0.0.1:*")
    procs = [InstanceProcess(model_dir, str(root / "i0"), *flags)]
    try:
        procs[0].wait_ready()
        procs += [InstanceProcess(model_dir, str(root / f"i{k}"), *flags) for k in (1, 2)]
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.set_delay(0)
            p.terminate()


@pytest.fixture(autouse=True)
def _reset_delays(request):
    yield
    if "instances" in request.fixturenames:
        for p in request.getfixturevalue("instances"):
            p.set_delay(0)


def pool(instances, names=("i0", "i1"), long_lane=("i2",)):
    return [{"name": "a", "instances": [{"name": n, "target": instances[int(n[1:])].target, "long_lane": n in long_lane}
                                        for n in names]}]


@pytest.fixture
def gateways(tmp_path):
    started = []

    def start(config, *flags):
        gw = GatewayProcess(str(tmp_path / f"gw{len(started)}"), config, *flags)
        started.append(gw)
        return gw
    yield start
    for gw in started:
        if gw.proc.poll() is None:
            gw.stop()


def wait_reports(gw, names, key=""):
    wait_for(lambda: all(gw.instances(key)[n].report_age_s >= 0 for n in names), 30, what="load reports")


def prompt(seed: int, n: int = 8) -> list[int]:
    return [3 + (seed * 7 + i * 13) % 500 for i in range(n)]


def test_same_api_validation_and_output_as_an_instance(instances, gateways):
    gw = gateways({"pools": pool(instances, ("i0",), ())})
    wait_reports(gw, ["i0"])
    with Client(gw.target, timeout=30) as g, Client(instances[0].target, timeout=30) as inst:
        kw = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
        assert g.complete([5, 6, 7, 8], **kw).token_ids == inst.complete([5, 6, 7, 8], **kw).token_ids
        for bad in (dict(max_tokens=0), dict(top_p=0.0), dict(logprobs=99), dict(stop_token_ids=[9999]),
                    dict(max_tokens=600)):
            errors = []
            for c in (g, inst):
                with pytest.raises(ClientError) as e:
                    c.complete([5, 6, 7], **bad)
                errors.append((e.value.code, e.value.details))
            assert errors[0] == errors[1], bad
        for bad_prompt in ([5, 9999], []):
            with pytest.raises(ClientError) as e1:
                g.complete(bad_prompt)
            with pytest.raises(ClientError) as e2:
                inst.complete(bad_prompt)
            assert (e1.value.code, e1.value.details) == (e2.value.code, e2.value.details)
        assert g.model_info().vocab_size == 512 and g.tokenize("hello") == inst.tokenize("hello")
        assert g.health() == "SERVING"


def _stream_all(target, reqs, timeout=60, metadata=None):
    """Runs each request in a thread; returns (Completion | ClientError, tokens seen before an error)."""
    def one(kw):
        seen = []
        try:
            with Client(target, timeout=timeout) as c:
                ids, last = [], None
                for r in c.generate(metadata=metadata, **kw):
                    ids.extend(r.token_ids)
                    seen.append(len(r.token_ids))
                    last = r
                return ("ok", ids, last.finish_reason), seen
        except ClientError as e:
            return e, seen
    with concurrent.futures.ThreadPoolExecutor(len(reqs)) as ex:
        return list(ex.map(one, reqs))


def test_load_aware_prefers_less_loaded_and_avoids_a_stuck_instance(instances, gateways):
    gw = gateways({"pools": pool(instances), "isolation": {"enabled": False},
                   "routing": {"policy": "load_aware", "load_interval_ms": 100}})
    wait_reports(gw, ["i0", "i1"])
    # Sent straight to i1, so only its load reports show them.
    instances[1].set_delay(0.05)
    # i1 is stuck: all its 32 sequence slots hold long requests and two more wait behind them.
    stuck = Client(instances[1].target)

    def consume(k):
        try:
            for _ in stuck.generate(prompt(k, 16), max_tokens=400, ignore_eos=True):
                pass
        except ClientError:
            pass  # cancelled at the end of the test
    threads = [threading.Thread(target=consume, args=(k,), daemon=True) for k in range(34)]
    for t in threads:
        t.start()
    try:
        # Stuck as the gateway sees it: a report with every slot running and two waiting. (num_waiting >= 2 alone
        # can be a report taken while the 34 arrive, a few running and a few waiting: an instance that looks
        # almost idle, to which a load-aware gateway rightly sends some of the 8.)
        def stuck_report():
            r = gw.instances()["i1"].last_report
            return r.max_num_seqs > 0 and r.num_running == r.max_num_seqs and r.num_waiting >= 2
        wait_for(stuck_report, 60, what="i1 stuck")
        before = {n: (s.routed_total, round(s.score, 3)) for n, s in gw.instances().items()}
        results = _stream_all(gw.target, [dict(prompt=prompt(100 + k), max_tokens=4, ignore_eos=True)
                                          for k in range(8)])
        assert all(r[0][0] == "ok" for r in results), results
        after = {n: (s.routed_total, round(s.score, 3)) for n, s in gw.instances().items()}
        assert after["i0"][0] - before["i0"][0] == 8 and after["i1"][0] == before["i1"][0], (before, after)
    finally:
        stuck.close()


def test_affinity_from_kv_events(instances, gateways):
    """A gateway following its instances' KV events (kv_events: auto, the endpoint their ModelInfo reports) sends a
    token prompt to the instance that holds its prefix, though the prefix got there without the gateway (its own
    guess knows nothing of it), and only to one holding it under the request's own salt; the instances' ModelInfo and
    load reports carry the host KV tier."""
    infos = []
    for p in instances[:2]:
        with Client(p.target, timeout=30) as c:
            info, load = c.model_info(), c.get_load()
        assert info.host_kv_cache_pages > 0 and info.host_kv_cache_bytes >= info.host_kv_cache_pages
        assert info.kv_events_endpoint.startswith("tcp://127.0.0.1:")
        assert load.host_kv_pages_total == info.host_kv_cache_pages and load.host_kv_pages_used >= 0
        infos.append(info)
    config = {"pools": pool(instances, long_lane=()), "isolation": {"enabled": False},
              "routing": {"policy": "load_aware", "load_interval_ms": 100, "weights": {"affinity": 3.0}}}
    for inst in config["pools"][0]["instances"]:
        inst["kv_events"] = "auto"
    gw = gateways(config)
    wait_reports(gw, ["i0", "i1"])
    time.sleep(0.5)  # the gateway subscribed before its first WatchLoad; let the SUB connections settle
    prompts = [[3 + (k * 31 + i * 17) % 500 for i in range(41)] for k in range(4)]  # 5 full pages of 8 each
    for k, p in enumerate(prompts):  # straight to one instance: only its KV events tell the gateway
        with Client(instances[k % 2].target, timeout=60) as c:
            c.complete(p, max_tokens=1)
    time.sleep(0.5)
    for k, p in enumerate(prompts):
        before = {n: s.routed_total for n, s in gw.instances().items()}
        with Client(gw.target, timeout=60) as c:
            assert c.complete(p + [7, k], max_tokens=2).finish_reason
        after = {n: s.routed_total for n, s in gw.instances().items()}
        assert after[f"i{k % 2}"] == before[f"i{k % 2}"] + 1, (k, before, after)
    # one prompt cached under a salt (the tenant, which the gateway passes on when it has no tenants) on i0, plain on
    # i1: each request goes where its own salt's blocks are, not where the same tokens are under another salt
    p = [5 + (i * 23) % 500 for i in range(41)]
    for k, tenant in enumerate(("t", "")):
        with Client(instances[k].target, timeout=60) as c:
            c.complete(p, max_tokens=1, tenant=tenant)
    time.sleep(0.5)
    for k, tenant in enumerate(("t", "", "t", "")):
        before = {n: s.routed_total for n, s in gw.instances().items()}
        with Client(gw.target, timeout=60) as c:
            assert c.complete(p + [9, k], max_tokens=2, tenant=tenant).finish_reason
        after = {n: s.routed_total for n, s in gw.instances().items()}
        assert after[f"i{k % 2}"] == before[f"i{k % 2}"] + 1, (tenant, before, after)


def test_slow_instance_is_quarantined_then_readmitted(instances, gateways):
    window = 0.5
    gw = gateways({"pools": pool(instances), "routing": {"policy": "round_robin"},
                   "isolation": {"window_s": window, "abnormal_windows": 2, "healthy_windows": 2,
                                 "slow_ratio": 3.0, "slow_min_delta_s": 0.05}})
    wait_reports(gw, ["i0", "i1"])
    stop = threading.Event()

    def traffic(k):
        with Client(gw.target, timeout=60) as c:
            while not stop.is_set():
                try:
                    c.complete(prompt(k), max_tokens=12, ignore_eos=True)
                except ClientError:
                    time.sleep(0.1)
    workers = [threading.Thread(target=traffic, args=(k,), daemon=True) for k in range(3)]
    for w in workers:
        w.start()
    try:
        time.sleep(2 * window)
        assert gw.instances()["i1"].state == "healthy", gw.instances()["i1"]
        instances[1].set_delay(0.3)
        t0 = time.monotonic()
        status = wait_for(lambda: (s := gw.instances()["i1"]).state == "quarantined" and s, 20, 0.05,
                          what="quarantine")
        took = time.monotonic() - t0
        # N=2 windows once its tokens arrive 0.3 s apart (the first gap needs 0.3 s, and a window may be partial).
        assert took < (2 + 2) * window + 1.0, took
        assert "inter-token latency" in status.state_reason
        routed = status.routed_total
        time.sleep(3 * window)
        assert gw.instances()["i1"].routed_total == routed  # no new traffic while quarantined
        instances[1].set_delay(0)
        t1 = time.monotonic()
        wait_for(lambda: gw.instances()["i1"].state == "healthy", 20, 0.05, what="readmission")
        assert time.monotonic() - t1 < (2 + 3) * window + 2.0
        wait_for(lambda: gw.instances()["i1"].routed_total > routed, 10, what="traffic again")
    finally:
        stop.set()
        for w in workers:
            w.join(30)
    log = gw.log()
    assert "i1: healthy -> quarantined" in log and "i1: quarantined -> healthy" in log
    metrics = urllib.request.urlopen(gw.metrics_url).read().decode()
    assert ('meshserve:gateway_instance_transitions_total{from_state="healthy",instance="i1",to_state="quarantined"} '
            '1.0') in metrics


def test_long_lane_routing_cap_and_max_tokens_cap(instances, gateways):
    gw = gateways({"pools": pool(instances, ("i0", "i1", "i2")), "routing": {"policy": "least_requests"},
                   "isolation": {"enabled": False},
                   "long_lane": {"threshold_tokens": 100, "max_concurrent": 1, "max_queue": 1},
                   "admission": {"max_tokens_cap": 40}})
    wait_reports(gw, ["i0", "i1", "i2"])
    instances[2].set_delay(0.04)
    before = {n: s.routed_total for n, s in gw.instances().items()}
    long_reqs = [dict(prompt=prompt(200 + k, 80), max_tokens=30, ignore_eos=True) for k in range(3)]
    results = _stream_all(gw.target, long_reqs)
    errors = [r[0] for r in results if isinstance(r[0], ClientError)]
    assert len(errors) == 1 and errors[0].code == grpc.StatusCode.RESOURCE_EXHAUSTED, results
    assert "long queue is full" in errors[0].details and errors[0].retry_after_s is not None
    assert sum(r[0][0] == "ok" for r in results if not isinstance(r[0], ClientError)) == 2
    after = {n: s.routed_total for n, s in gw.instances().items()}
    assert after["i2"] - before["i2"] == 2 and after["i0"] == before["i0"] and after["i1"] == before["i1"]
    # Short requests never use the long lane; max_tokens over the cap ends with finish reason length at the cap.
    with Client(gw.target, timeout=30) as c:
        out = c.complete([5, 6], max_tokens=300, ignore_eos=True)
    assert out.finish_reason == "length" and len(out.token_ids) == 40
    assert gw.instances()["i2"].routed_total == after["i2"]


AUTH = {"tenants": [{"name": "alice", "api_keys": ["key-alice"]},
                    {"name": "bob", "api_keys": ["key-bob"], "rate_limit": {"requests_per_s": 0.5, "burst": 2}}],
        "admin_keys": ["key-admin"]}


def _md(key):
    return [("authorization", f"Bearer {key}")]


def test_auth_admin_priority_queue_bound_and_rate_limit(instances, gateways):
    gw = gateways({"pools": pool(instances, ("i0",), ()), **AUTH, "isolation": {"enabled": False},
                   "admission": {"max_inflight_per_instance": 1, "queue_bounds": {"interactive": 1, "batch": 1}}})
    wait_reports(gw, ["i0"], "key-admin")
    with Client(gw.target, timeout=30) as c:
        for md, code in ((None, grpc.StatusCode.UNAUTHENTICATED), (_md("nope"), grpc.StatusCode.UNAUTHENTICATED)):
            with pytest.raises(ClientError) as e:
                c.complete([5, 6], max_tokens=2, metadata=md)
            assert e.value.code == code
        assert c.complete([5, 6], max_tokens=2, metadata=_md("key-alice")).completion_tokens == 2
    for key, code in (("key-alice", grpc.StatusCode.PERMISSION_DENIED), ("", grpc.StatusCode.UNAUTHENTICATED)):
        with pytest.raises(grpc.RpcError) as e:
            gw.instances(key)
        assert e.value.code() == code
    channel, admin, md = gw.admin("key-admin")
    with channel:
        assert admin.ReloadConfig(gpb.ReloadConfigRequest(), metadata=md).applied
        with pytest.raises(grpc.RpcError) as e:
            admin.DrainInstance(gpb.DrainInstanceRequest(name="i0"), metadata=_md("key-bob"))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # One slot (max_inflight_per_instance 1): one batch request runs, one waits, the third finds the queue full;
    # an interactive one, sent once the batch queue is full, has its own queue and goes before the waiting batch
    # request. The queue-depth gauge shows the waiting request while it waits.
    instances[0].set_delay(0.03)
    reqs = [dict(prompt=prompt(300 + k), max_tokens=20, ignore_eos=True, priority="batch") for k in range(3)]
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        batch = [ex.submit(_stream_all, gw.target, [r], metadata=_md("key-alice")) for r in reqs]
        done, _ = concurrent.futures.wait(batch, timeout=30, return_when=concurrent.futures.FIRST_COMPLETED)
        (rejected,) = [f.result()[0][0] for f in done]
        assert isinstance(rejected, ClientError) and rejected.code == grpc.StatusCode.RESOURCE_EXHAUSTED, rejected
        assert "batch queue is full" in rejected.details
        depth = urllib.request.urlopen(gw.metrics_url).read().decode()
        assert 'meshserve:gateway_queue_depth{class="batch"} 1.0' in depth
        interactive = ex.submit(_stream_all, gw.target, [dict(prompt=prompt(310), max_tokens=20, ignore_eos=True,
                                                              priority="interactive")], metadata=_md("key-alice"))
        finished = list(concurrent.futures.as_completed([f for f in batch if f not in done] + [interactive]))
        assert finished[1] is interactive  # after the running batch request, before the waiting one
        results = [f.result()[0] for f in batch + [interactive]]
    errors = [r[0] for r in results if isinstance(r[0], ClientError)]
    assert errors == [rejected], results
    assert results[3][0][0] == "ok"
    depth = urllib.request.urlopen(gw.metrics_url).read().decode()
    assert 'meshserve:gateway_queue_depth{class="batch"} 0.0' in depth
    instances[0].set_delay(0)
    # Rate limit: bob has a burst of 2 at 0.5 requests/s.
    with Client(gw.target, timeout=30) as c:
        for _ in range(2):
            c.complete([5, 6], max_tokens=1, metadata=_md("key-bob"))
        with pytest.raises(ClientError) as e:
            c.complete([5, 6], max_tokens=1, metadata=_md("key-bob"))
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "rate limit" in e.value.details
    assert e.value.retry_after_s and e.value.retry_after_s > 0.5


class _Hook(http.server.BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Hook.received.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def _watch_until_done(target, job_id, key, timeout=60):
    with grpc.insecure_channel(target) as ch:
        jobs = gpb_grpc.JobsStub(ch)
        for job in jobs.WatchJob(gpb.GetJobRequest(job_id=job_id), metadata=_md(key), timeout=timeout):
            if job.state in (gpb.JOB_STATE_SUCCEEDED, gpb.JOB_STATE_FAILED):
                return job
    raise AssertionError("WatchJob ended before the job finished")


def test_jobs_callback_allow_list_and_restart(instances, gateways):
    hook = http.server.HTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    gw = gateways({"pools": pool(instances, ("i0",), ()), **AUTH, "callbacks": {
        "allowed_hosts": ["127.0.0.1"], "allowed_ports": [hook.server_port],
        "webhook_secret": "whsec_" + base64.b64encode(b"e2e-test-webhook-key-32-bytes-ok").decode()}})
    wait_reports(gw, ["i0"], "key-admin")
    try:
        with grpc.insecure_channel(gw.target) as ch:
            jobs = gpb_grpc.JobsStub(ch)
            req = generate_request([5, 6, 7], max_tokens=5, temperature=0.0, ignore_eos=True)
            with pytest.raises(grpc.RpcError) as e:
                jobs.SubmitJob(gpb.SubmitJobRequest(request=req, callback_url="http://evil.example:80/x"),
                               metadata=_md("key-alice"))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "allow-list" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                jobs.SubmitJob(gpb.SubmitJobRequest(request=generate_request([5], max_tokens=0)),
                               metadata=_md("key-alice"))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            url = f"http://127.0.0.1:{hook.server_port}/done"
            job = jobs.SubmitJob(gpb.SubmitJobRequest(request=req, callback_url=url), metadata=_md("key-alice"))
            assert job.state == gpb.JOB_STATE_QUEUED and job.tenant == "alice"
            done = _watch_until_done(gw.target, job.job_id, "key-alice")
            assert done.state == gpb.JOB_STATE_SUCCEEDED and len(done.result.token_ids) == 5
            wait_for(lambda: _Hook.received, 10, what="callback")
            assert _Hook.received[0]["job_id"] == job.job_id and _Hook.received[0]["token_ids"] == list(
                done.result.token_ids)
            with pytest.raises(grpc.RpcError) as e:  # another tenant cannot see it
                jobs.GetJob(gpb.GetJobRequest(job_id=job.job_id), metadata=_md("key-bob"))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            # A job still running when the gateway is killed is run again after the restart.
            instances[0].set_delay(0.2)
            time.sleep(0.3)  # the instance re-reads its delay file every 0.1 s
            slow = jobs.SubmitJob(gpb.SubmitJobRequest(request=generate_request([8, 9], max_tokens=30,
                                                                                 ignore_eos=True)),
                                  metadata=_md("key-alice"))
            wait_for(lambda: jobs.GetJob(gpb.GetJobRequest(job_id=slow.job_id), metadata=_md("key-alice")).state
                     == gpb.JOB_STATE_RUNNING, 10, 0.02, what="job running")
            time.sleep(0.5)
            assert jobs.GetJob(gpb.GetJobRequest(job_id=slow.job_id), metadata=_md("key-alice")).state == \
                gpb.JOB_STATE_RUNNING
        gw.stop(kill=True)
        instances[0].set_delay(0)
        gw.start()
        finished = _watch_until_done(gw.target, slow.job_id, "key-alice")
        assert finished.state == gpb.JOB_STATE_SUCCEEDED and len(finished.result.token_ids) == 30
        assert finished.attempts == 2
        with grpc.insecure_channel(gw.target) as ch:
            again = gpb_grpc.JobsStub(ch).GetJob(gpb.GetJobRequest(job_id=job.job_id), metadata=_md("key-alice"))
        assert again.result.token_ids == done.result.token_ids and again.callback_status == "delivered"
    finally:
        hook.shutdown()


def test_invalid_config_file_keeps_the_old_configuration(instances, gateways):
    config = {"pools": pool(instances, ("i0",), ()), "routing": {"policy": "round_robin"}}
    gw = gateways(config)
    wait_reports(gw, ["i0"])
    with open(gw.config_path, "w") as f:
        f.write("routing: {policy: fastest}\n")
    time.sleep(1.5)
    channel, admin, md = gw.admin()
    with channel:
        resp = admin.ReloadConfig(gpb.ReloadConfigRequest(), metadata=md)
        assert not resp.applied and "routing.policy" in resp.error and resp.config_version == 1
        listed = admin.ListInstances(gpb.ListInstancesRequest(), metadata=md)
        assert listed.routing_policy == "round_robin" and [i.name for i in listed.instances] == ["i0"]
    with Client(gw.target, timeout=30) as c:
        assert c.complete([5, 6], max_tokens=2).completion_tokens == 2
    assert "rejected, keeping version 1" in gw.log()
    write_config(gw.config_path, {**config, "pools": pool(instances, ("i0", "i1"), ()),
                                  "routing": {"policy": "least_requests"}})
    wait_for(lambda: set(gw.instances()) == {"i0", "i1"}, 10, what="reload")
    channel, admin, md = gw.admin()
    with channel:
        assert admin.ListInstances(gpb.ListInstancesRequest(), metadata=md).routing_policy == "least_requests"


def test_kill9_under_load_retries_unstarted_and_fails_started(model_dir, instances, gateways, tmp_path):
    victim = InstanceProcess(model_dir, str(tmp_path / "victim")).wait_ready()
    try:
        gw = gateways({"pools": [{"name": "a", "instances": [
            {"name": "i0", "target": instances[0].target}, {"name": "victim", "target": victim.target}]}],
            "routing": {"policy": "round_robin"}, "isolation": {"enabled": False}})
        wait_reports(gw, ["i0", "victim"])
        # Slow steps on the victim: its 8 requests' prompts (320 tokens) take 10 steps of a 32-token budget, so
        # when it dies some are streaming and the others still wait for their first token.
        victim.set_delay(0.3)
        reqs = [dict(prompt=prompt(400 + k, 40), max_tokens=24, ignore_eos=True) for k in range(16)]
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            future = ex.submit(_stream_all, gw.target, reqs, 60)
            wait_for(lambda: gw.instances()["victim"].inflight >= 8, 10, 0.02, what="victim loaded")
            time.sleep(0.9)
            victim.proc.kill()
            t0 = time.monotonic()
            results = future.result(timeout=60)
        assert time.monotonic() - t0 < 30  # nothing hangs
        ok = [r for r in results if not isinstance(r[0], ClientError)]
        failed = [r for r in results if isinstance(r[0], ClientError)]
        for err, seen in failed:
            assert err.code == grpc.StatusCode.UNAVAILABLE and seen, (err, seen)  # only mid-stream ones fail
            assert "after the response had started" in err.details
        for (status, ids, _), _seen in ok:
            assert len(ids) == 24  # complete, no duplicated tokens
        metrics = urllib.request.urlopen(gw.metrics_url).read().decode()
        retried = sum(float(line.split()[-1]) for line in metrics.splitlines()
                      if line.startswith("meshserve:gateway_retries_total"))
        # i0's 8 complete, and so do the victim's unstarted ones, retried on i0.
        assert len(ok) > 8 and retried >= len(ok) - 8, (len(ok), retried, results)
        assert len(ok) + len(failed) == 16
        # The gateway keeps serving, on the survivor.
        wait_for(lambda: gw.instances()["victim"].state == "failed", 10, what="victim removed")
        with Client(gw.target, timeout=30) as c:
            assert c.complete([5, 6], max_tokens=3).completion_tokens == 3
    finally:
        victim.proc.kill()
        victim.proc.wait()


def test_tenant_pools_spill_over_and_draining_instance_removed(instances, gateways):
    gw = gateways({"pools": [{"name": "p1", "instances": [{"name": "i0", "target": instances[0].target}]},
                             {"name": "p2", "instances": [{"name": "i1", "target": instances[1].target}]}],
                   "tenants": [{"name": "t", "api_keys": ["kt"], "pools": ["p1", "p2"]}], "admin_keys": ["ka"],
                   "admission": {"max_inflight_per_instance": 1},
                   "isolation": {"window_s": 0.3, "healthy_windows": 2}})
    wait_reports(gw, ["i0", "i1"], "ka")
    instances[0].set_delay(0.05)
    results = _stream_all(gw.target, [dict(prompt=prompt(500 + k), max_tokens=10, ignore_eos=True)
                                      for k in range(2)], metadata=_md("kt"))
    assert all(not isinstance(r[0], ClientError) for r in results), results
    listed = gw.instances("ka")
    assert listed["i0"].routed_total == 1 and listed["i1"].routed_total == 1  # p1 full: spilled to p2
    metrics = urllib.request.urlopen(gw.metrics_url).read().decode()
    assert 'meshserve:gateway_spillovers_total{pool="p2"} 1.0' in metrics
    # An instance that drains (its own Drain RPC: health NOT_SERVING) is taken out, and back after resuming.
    with Client(instances[1].target) as c:
        c.drain()
        try:
            wait_for(lambda: gw.instances("ka")["i1"].state == "failed", 10, what="draining instance removed")
        finally:
            c.drain(resume=True)
    wait_for(lambda: gw.instances("ka")["i1"].state == "healthy", 10, what="readmitted")
