"""Prefill/decode disaggregation's faults end to end: a real gateway in front of one --role=prefill instance (which waits
1.5 s before each PullKV chunk, a test-only hook: the window to kill an instance mid-transfer) and two --role=decode
instances, d0 preferred (its pool comes first) and refusing every request for a full queue. A refusal is retried on
d1; a decode instance killed (SIGKILL) before its first token is retried on d1 from the pages still held; the prefill
instance killed mid-transfer ends the stream with an explicit UNAVAILABLE after the first token, the decode instances
still routable. Every live instance holds no page once idle (their load reports)."""
from __future__ import annotations

import concurrent.futures
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.wire import meshserve_pb2 as pb
from serving.wire.client import Client, ClientError
from tests.support.gateway import GatewayProcess, InstanceProcess, wait_for
from tests.support.tiny import model_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

INSTANCE_KEY = "instance-key-0123456789"
TENANT_KEY = "tenant-key-0123456789"
ADMIN_KEY = "admin-key-0123456789"
PULL_DELAY_S = 1.5  # the prefill instance's wait before each PullKV chunk
PROMPT = "The quick brown fox jumps over the lazy dog and then it runs far away into the"
MD = [("authorization", f"Bearer {INSTANCE_KEY}")]
TENANT = [("authorization", f"Bearer {TENANT_KEY}")]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("pdf")
    key_file = root / "instance.keys"
    key_file.write_text(INSTANCE_KEY + "\n")
    common = ("--http_port=-1", "--served_model_name=tiny", f"--api_key_file={key_file}")
    decode = ("--role=decode", f"--kv_peer_key_file={key_file}", *common)
    procs = {}
    try:
        procs["p0"] = InstanceProcess(model_dir("target"), str(root / "p0"), "--role=prefill", *common,
                                      env={"MESHSERVE_DEBUG_PULL_CHUNK_DELAY_S": str(PULL_DELAY_S)})
        procs["p0"].wait_ready()  # the others load its programs from the compilation cache it filled
        # d0 refuses any prompt over 8 tokens: RESOURCE_EXHAUSTED (a full queue), after its pull
        procs["d0"] = InstanceProcess(model_dir("target"), str(root / "d0"), *decode, "--max_waiting_tokens=8")
        procs["d1"] = InstanceProcess(model_dir("target"), str(root / "d1"), *decode)
        procs["d0"].wait_ready()
        procs["d1"].wait_ready()
        config = {"pools": [{"name": "prefill", "instances": [{"name": "p0", "target": procs["p0"].target}]},
                            {"name": "decode", "instances": [{"name": "d0", "target": procs["d0"].target}]},
                            {"name": "decode_b", "instances": [{"name": "d1", "target": procs["d1"].target}]}],
                  "disaggregation": {"prefill_pools": ["prefill"], "decode_pools": ["decode", "decode_b"]},
                  "isolation": {"enabled": False}, "instance_key_file": str(key_file),
                  "tenants": [{"name": "acme", "api_keys": [TENANT_KEY]}], "admin_keys": [ADMIN_KEY]}
        gw = GatewayProcess(str(root / "gw"), config, "--http_port=-1")
        try:
            wait_for(lambda: all(i.report_age_s >= 0 for i in gw.instances(ADMIN_KEY).values()), 30,
                     what="load reports")
            yield procs, gw
        finally:
            gw.stop()
    finally:
        for p in procs.values():
            if p.proc.poll() is None:
                p.terminate()


def _load(proc) -> pb.LoadReport:
    with Client(proc.target, timeout=10) as c:
        return c.stub.GetLoad(pb.GetLoadRequest(), timeout=10, metadata=MD)


def _assert_idle(*procs) -> None:
    """Every page free (or only cached, evictable) and nothing running, on each of `procs`."""
    for proc in procs:
        def idle(proc=proc):
            load = _load(proc)
            return load if load.num_running == 0 and load.kv_pages_free == load.kv_pages_total else None
        try:
            wait_for(idle, 10, interval=0.05, what="idle")
        except TimeoutError:
            load = _load(proc)
            raise AssertionError(f"{proc.target}: {load.kv_pages_total - load.kv_pages_free} pages used, "
                                 f"{load.num_running} running once idle") from None


def _reference(procs, prompt: str) -> list[int]:
    with Client(procs["d1"].target, timeout=60) as c:  # a plain request on one instance
        return c.complete(prompt, max_tokens=8, temperature=0.0, ignore_eos=True, metadata=MD).token_ids


def _through_gateway(gw, prompt: str) -> tuple[list[int], ClientError | None]:
    """The tokens the client got, and the error its stream ended with (None: it finished)."""
    tokens = []
    try:
        with Client(gw.target, timeout=60) as c:
            for r in c.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True, metadata=TENANT):
                tokens.extend(r.token_ids)
    except ClientError as e:
        return tokens, e
    return tokens, None


def _kill_during_pull(gw, victim, decode: str):
    """Sends a request through the gateway and SIGKILLs `victim` once the decode stage is on `decode` (the decode
    instance is then waiting on the prefill instance's first chunk); returns _through_gateway's result."""
    def decode_running():
        return gw.instances(ADMIN_KEY)[decode].inflight == 1 or None
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_through_gateway, gw, PROMPT + f" {decode}")
        wait_for(decode_running, 30, interval=0.02, what=f"the decode stage on {decode}")
        time.sleep(PULL_DELAY_S / 3)
        assert victim.proc.poll() is None
        victim.proc.kill()
        victim.proc.wait(10)
        return fut.result(timeout=60)


def _counters(gw, name: str, label: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{gw.info['metrics_port']}/metrics", timeout=10).read().decode()
    return {s.labels[label]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name}


def _states(gw) -> dict[str, str]:
    return {name: i.state for name, i in gw.instances(ADMIN_KEY).items()}


def test_a_decode_instance_that_refuses_is_retried_on_another(fleet):
    procs, gw = fleet
    prompt = PROMPT + " refused"
    ref = _reference(procs, prompt)
    routed = {n: i.routed_total for n, i in gw.instances(ADMIN_KEY).items()}
    tokens, err = _through_gateway(gw, prompt)
    assert err is None and tokens == ref
    after = {n: i.routed_total for n, i in gw.instances(ADMIN_KEY).items()}
    # d0 (preferred) got the decode stage and refused it; d1 pulled the still-held pages again and finished it
    assert {n: after[n] - routed[n] for n in after} == {"p0": 1, "d0": 1, "d1": 1}
    assert _states(gw)["d0"] == "healthy"  # a full queue is no failure
    assert _counters(gw, "meshserve:gateway_retries_total", "code") == {"RESOURCE_EXHAUSTED": 1}
    _assert_idle(procs["p0"], procs["d0"], procs["d1"])


def test_a_decode_instance_killed_before_its_first_token_is_retried_on_another(fleet):
    procs, gw = fleet
    ref = _reference(procs, PROMPT + " d0")
    tokens, err = _kill_during_pull(gw, procs["d0"], "d0")
    assert err is None and tokens == ref  # the pages were still held: d1 pulled them and finished the stream
    assert _states(gw)["d0"] == "failed"
    assert _counters(gw, "meshserve:gateway_retries_total", "code") == {"RESOURCE_EXHAUSTED": 1, "UNAVAILABLE": 1}
    _assert_idle(procs["p0"], procs["d1"])


def test_the_prefill_instance_killed_mid_transfer_is_an_explicit_error(fleet):
    procs, gw = fleet
    ref = _reference(procs, PROMPT + " d1")
    tokens, err = _kill_during_pull(gw, procs["p0"], "d1")
    # the first token came from the prefill instance; the pull failed, and no decode instance is left to retry on
    assert tokens == ref[:1]
    assert err is not None and err.code == grpc.StatusCode.UNAVAILABLE, err
    assert "decode stage" in err.details and procs["p0"].target in err.details, err.details
    assert _states(gw)["d1"] == "healthy"  # the prefill side failed, not d1: it stays routable
    outcomes = _counters(gw, "meshserve:gateway_disaggregated_requests_total", "outcome")
    assert (outcomes.get("prefill_decode"), outcomes.get("decode_failed")) == (2, 1)
    _assert_idle(procs["d1"])
