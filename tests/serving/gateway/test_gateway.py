"""Gateway unit tests without processes: configuration, routing score, prefix index, slow-node state machine,
admission queues, rate limits, validation parity with the server, job store, generated stubs, import rules."""
from __future__ import annotations

import asyncio
import base64
import ipaddress
import os
import re
import stat
import subprocess
import sys

import grpc
import pytest
import yaml

from serving.gateway import config as gconfig
from serving.gateway.admission import Admission, QueueFull, RateLimiter
from serving.gateway.config import ConfigError, ConfigWatcher, IsolationConfig, ScoreWeights, parse_config
from serving.gateway.health import FAILED, HEALTHY, QUARANTINED, HealthTracker
from serving.gateway.callbacks import CallbackRefused, address_allowed, check_url, sign
from serving.gateway.jobs import JobError, JobManager, JobStore
from serving.gateway.proto import gateway_pb2 as gpb
from serving.gateway.routing import InstanceView, PrefixIndex, Router, load_scores, prompt_blocks
from serving.gateway.validation import check_generate
from serving.params import InvalidArgument, ModelLimits
from serving.process import REPO_ROOT
from serving.wire import meshserve_pb2 as pb
from serving.wire.client import generate_request

BASE = {"pools": [{"name": "a", "instances": [{"name": "i0", "target": "127.0.0.1:1"},
                                              {"name": "i1", "target": "127.0.0.1:2", "long_lane": True,
                                               "labels": {"zone": "z1"}}]},
                  {"name": "b", "instances": [{"name": "i2", "target": "127.0.0.1:3"}]}],
        "tenants": [{"name": "acme", "api_keys": ["k1"], "priority": "batch", "pools": ["b", "a"],
                     "rate_limit": {"requests_per_s": 2, "burst": 3}}],
        "admin_keys": ["adm"], "long_lane": {"threshold_tokens": 100}, "callbacks": {"allowed_hosts": ["Hooks.X"]}}


def test_generated_stubs_are_up_to_date(tmp_path):
    from serving.gateway.proto import generate
    from serving.wire.generate import stub_content
    for path in generate.generate(str(tmp_path)):
        ours = os.path.join(REPO_ROOT, "serving/gateway/proto", os.path.basename(path))
        with open(path) as f, open(ours) as g:
            assert stub_content(f.read()) == stub_content(g.read()), (
                f"{ours} is stale: run python -m serving.gateway.proto.generate")


@pytest.mark.e2e
def test_gateway_never_imports_core():
    code = ("import sys, serving.gateway.service, serving.bench.gateway, serving.gateway.__main__; "
            "bad = [m for m in sys.modules if m.startswith('serving.core') or m == 'jax']; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT})


def test_config_parses_pools_tenants_lanes():
    cfg = parse_config(BASE)
    assert cfg.pools == ("a", "b")
    assert [(i.name, i.pool, i.long_lane) for i in cfg.instances] == [("i0", "a", False), ("i1", "a", True),
                                                                       ("i2", "b", False)]
    assert cfg.instances[1].labels == (("zone", "z1"),)
    assert cfg.tenants[0].pools == ("b", "a") and cfg.tenants[0].rate_limit.burst == 3
    assert cfg.callbacks.allowed_hosts == ("hooks.x",) and cfg.callbacks.allowed_ports == (80, 443)
    assert cfg.auth_enabled and cfg.jobs.max_crashes == 3 and cfg.callbacks.retry_window_s == 3600
    assert cfg.routing.policy == "load_aware" and cfg.admission.queue_bound("batch") == 1024


@pytest.mark.parametrize("patch, message", [
    ({"routing": {"policy": "random"}}, "routing.policy"),
    ({"routing": {"weights": {"kv": "high"}}}, "routing.weights.kv"),
    ({"isolation": {"abnormal_windows": 0}}, "isolation.abnormal_windows"),
    ({"admission": {"queue_bounds": {"interactive": -1}}}, "admission.queue_bounds.interactive"),
    ({"tenants": [{"name": "x", "pools": ["nope"]}]}, "tenants[0].pools"),
    ({"tenants": [{"name": "x", "api_keys": ["adm"]}]}, "tenants[0].api_keys"),
    ({"bogus": 1}, "bogus: unknown key"),
    ({"tool_call_parser": "json"}, "tool_call_parser: unknown 'json'"),
    ({"reasoning_parser": "o1"}, "reasoning_parser: unknown 'o1'"),
    ({"pools": [{"name": "a", "instances": [{"name": "i0", "target": "nohost"}]}]}, "pools[0].instances[0].target"),
    ({"pools": [{"name": "a", "instances": [{"name": "i0", "target": "h:1"}, {"name": "i0", "target": "h:2"}]}]},
     "defined twice"),
    # admin keys act as "admin" (every tenant's jobs): no tenant may take the name
    ({"tenants": [{"name": "admin", "api_keys": ["k9"]}]}, "tenants[0].name: 'admin' is reserved"),
    ({"tenants": [{"name": "Admin"}]}, "tenants[0].name: 'Admin' is reserved"),
    ({"tenants": [{"name": "x"}, {"name": "x"}]}, "tenants[1].name: tenant 'x' is defined twice"),
    ({"tenants": [{"name": "x", "webhook_secret": "hunter2-hunter2-hunter2"}]}, "tenants[0].webhook_secret: expected"),
    ({"callbacks": {"webhook_secret": "whsec_c2hvcnQ="}}, "callbacks.webhook_secret: a key of 5 bytes"),
    ({"callbacks": {"allowed_ports": [0]}}, "callbacks.allowed_ports"),
    ({"callbacks": {"allowed_networks": ["10.0.0.0/33"]}}, "callbacks.allowed_networks: '10.0.0.0/33'"),
    ({"callbacks": {"retry_window_s": 0}}, "callbacks.retry_window_s: must be > 0"),
    ({"jobs": {"max_crashes": 0}}, "jobs.max_crashes: must be > 0"),
    ({"allow_unauthenticated": "yes"}, "allow_unauthenticated: expected true or false"),
    ({"disaggregation": {"prefill_pools": ["a"]}}, "disaggregation: prefill_pools and decode_pools go together"),
    ({"disaggregation": {"prefill_pools": ["a"], "decode_pools": ["nope"]}}, "disaggregation.decode_pools: unknown"),
    ({"disaggregation": {"prefill_pools": ["a"], "decode_pools": ["a"]}}, "a pool is both a prefill and a decode"),
    ({"disaggregation": {"prefill": ["a"]}}, "disaggregation.prefill: unknown key"),
    # required keys left out, and names of the wrong type: named, not a TypeError
    ({"pools": [{"name": "a", "instances": [{"name": "i0"}]}]}, "pools[0].instances[0].target: required"),
    ({"pools": [{"name": "a", "instances": [{"name": 7, "target": "h:1"}]}]},
     "pools[0].instances[0].name: expected a string, got 7"),
    ({"tenants": [{"api_keys": ["k9"]}]}, "tenants[0].name: required"),
    ({"tenants": [{"name": ["x"]}]}, "tenants[0].name: expected a string"),
])
def test_config_errors_name_the_key(patch, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_config({**BASE, **patch})


def test_watcher_keeps_old_config_on_invalid_file(tmp_path):
    path = tmp_path / "gw.yaml"
    path.write_text("routing: {policy: round_robin}\n")
    w = ConfigWatcher(str(path))
    assert w.config.routing.policy == "round_robin"
    path.write_text("routing: {policy: [unclosed\n")
    os.utime(path, ns=(1, 1))
    assert not w.poll() and "not valid YAML" in w.last_error and w.config.routing.policy == "round_robin"
    path.write_text("routing: {policy: least_requests}\n")
    assert w.poll() and w.config.routing.policy == "least_requests" and w.version == 2 and not w.last_error


def test_reload_never_fails_open(tmp_path, caplog):
    """Authentication on: an empty or half-written file (no tenants, no admin keys), or one that leaves no instance,
    is refused with the running configuration kept, unless the file says it means it."""
    path = tmp_path / "gw.yaml"
    base = {**BASE, "long_lane": {}}
    empty_pools = [{"name": "a"}, {"name": "b"}]
    path.write_text(yaml.safe_dump(base))
    w = ConfigWatcher(str(path))
    for text, error in (("", "would turn authentication off"), ("pools: [{name: a, insta", "not valid YAML"),
                        ("routing: {policy: round_robin}\n", "would turn authentication off"),
                        (yaml.safe_dump({**base, "pools": empty_pools}), "no instance left")):
        path.write_text(text)
        assert not w.poll(force=True) and error in w.last_error, (text, w.last_error)
        assert w.config == parse_config(base) and w.config.auth_enabled and w.version == 1
    assert "rejected, keeping version 1" in caplog.text
    path.write_text(yaml.safe_dump({**base, "pools": empty_pools, "allow_no_instances": True}))
    assert w.poll(force=True) and not w.config.instances and w.config.auth_enabled
    path.write_text("allow_unauthenticated: true\nallow_no_instances: true\n")
    assert w.poll(force=True) and not w.config.auth_enabled


def _report(**kw) -> pb.LoadReport:
    base = dict(max_num_seqs=32, serving=True, step_time_p50_s=0.01, generation_tokens_per_s=100.0, num_running=1)
    return pb.LoadReport(**{**base, **kw})


def test_load_score_prefers_less_loaded_and_treats_stale_as_unknown():
    w = ScoreWeights()
    views = [InstanceView("busy", report=_report(num_waiting=20, num_running=32, kv_cache_usage=0.9), report_age_s=0.1),
             InstanceView("idle", report=_report(num_running=1, kv_cache_usage=0.1), report_age_s=0.1)]
    s = load_scores(views, w, stale_after_s=1.0)
    assert s["idle"] < s["busy"]
    # A stale report is unknown load: the busy numbers no longer count, only in-flight + the unknown penalty.
    views[0].report_age_s = 5.0
    s = load_scores(views, w, stale_after_s=1.0)
    assert s["busy"] == pytest.approx(w.unknown)
    # Slowness: a step 10x the fleet median outweighs a moderate queue elsewhere.
    views = [InstanceView("slow", report=_report(), report_age_s=0.1, step_time_s=0.3),
             InstanceView("ok1", report=_report(num_waiting=8), report_age_s=0.1, step_time_s=0.01),
             InstanceView("ok2", report=_report(num_waiting=8), report_age_s=0.1, latency_ewma_s=0.01)]
    s = load_scores(views, w, stale_after_s=1.0)
    assert s["slow"] > s["ok1"] == s["ok2"]
    # Requests routed since the last report count as waiting.
    a = InstanceView("a", sent_since_report=8, report=_report(), report_age_s=0.1)
    b = InstanceView("b", report=_report(), report_age_s=0.1)
    s = load_scores([a, b], w, 1.0)
    assert s["b"] < s["a"]


def test_policies_and_prefix_affinity():
    from serving.gateway.config import RoutingConfig
    views = [InstanceView("a", inflight=3), InstanceView("b", inflight=1), InstanceView("c", inflight=2)]
    rr = Router(RoutingConfig(policy="round_robin"))
    assert [rr.choose(views).name for _ in range(4)] == ["a", "b", "c", "a"]
    lr = Router(RoutingConfig(policy="least_requests"))
    assert {lr.choose(views).name for _ in range(5)} == {"b"}
    la = Router(RoutingConfig(policy="load_aware"))
    req = generate_request("S" * 300 + " question one")
    blocks = prompt_blocks(req, 64)
    assert len(blocks) == 4
    even = [InstanceView(n, report=_report(), report_age_s=0.1, step_time_s=0.01) for n in "abc"]
    la.record(blocks, "c")
    assert la.choose(even, prompt_blocks(generate_request("S" * 300 + " another one"), 64)).name == "c"
    idx = PrefixIndex(max_entries=3)
    idx.record(blocks, "a")
    assert len(idx) == 3 and idx.affinity(blocks) == {}  # the first block was evicted: no leading run


def test_kv_event_index_and_held_affinity():
    """The index rebuilt from an instance's KV-event batches: a block counts while any tier holds it, a child of an
    unknown parent is left out, AllBlocksCleared and a gap in the batch numbers empty it; the router's `held`
    affinity replaces the guess for the instances it names; an invalid kv_events address is refused."""
    from serving.gateway.config import RoutingConfig
    from serving.gateway.kv_index import KVEventIndex, first_block_extra_keys
    ix = KVEventIndex()
    a = list(range(100, 109))  # two blocks of 4 and one more token
    ix.apply(0, [0.0, [["BlockStored", [11], None, a[:4], 4, None, "GPU"],
                       ["BlockStored", [12], 11, a[4:8], 4, None, "GPU"],
                       ["BlockStored", [13], 99, a[:4], 4, None, "GPU"]], 0])  # parent 99 unknown: left out
    keys = ix.prompt_keys(a)
    assert len(keys) == 2 and ix.match(keys) == 1.0 and len(ix) == 2
    assert ix.match(ix.prompt_keys(a[:4] + [0, 0, 0, 0, 0])) == 0.5
    ix.apply(1, [0.0, [["BlockRemoved", [12], "GPU"], ["BlockStored", [12], 11, a[4:8], 4, None, "CPU"]], 0])
    assert ix.match(keys) == 1.0  # moved to the host tier: still held
    ix.apply(2, [0.0, [["BlockRemoved", [12], "CPU"]], 0])
    assert ix.match(keys) == 0.5
    ix.apply(3, [0.0, [["AllBlocksCleared"]], 0])
    assert ix.match(keys) == 0.0
    ix.apply(4, [0.0, [["BlockStored", [11], None, a[:4], 4, None, "GPU"]], 0])
    ix.apply(6, [0.0, [], 0])  # batch 5 lost: it may have removed blocks
    assert len(ix) == 0
    # the same tokens under adapter "sql" (lora id 3, lora name, per-block extra keys) and under a salt: a prompt
    # matches only the blocks stored under its own adapter and salt
    sql, salted = first_block_extra_keys("sql", ""), first_block_extra_keys("", "t\x00s")
    ix.apply(7, [0.0, [["BlockStored", [21, 22], None, a[:8], 4, 3, "GPU", "sql", [["sql"], ["sql"]]],
                       ["BlockStored", [31], None, a[:4], 4, None, "GPU", None, [["t\x00s"]]]], 0])
    assert ix.match(ix.prompt_keys(a, sql)) == 1.0 and ix.match(keys) == 0.0  # the base model holds nothing
    assert ix.match(ix.prompt_keys(a, salted)) == 0.5 and ix.match(ix.prompt_keys(a, ("sql", "t\x00s"))) == 0.0
    assert ix.match(ix.prompt_keys(a, first_block_extra_keys("other", ""))) == 0.0
    la = Router(RoutingConfig(policy="load_aware"))
    even = [InstanceView(n, report=_report(), report_age_s=0.1, step_time_s=0.01) for n in "ab"]
    blocks = prompt_blocks(generate_request("S" * 300), 64)
    la.record(blocks, "a")  # the guess says a; b's events say it holds the whole prefix
    assert {la.choose(even, blocks, {"a": 0.0, "b": 1.0}).name for _ in range(4)} == {"b"}
    raw = {"pools": [{"name": "p", "instances": [{"name": "i", "target": "h:1", "kv_events": "tcp://h"}]}]}
    with pytest.raises(ConfigError, match="kv_events"):
        parse_config(raw)


def test_kv_event_subscription_replays_batches_published_before_it_and_lost_after():
    """With the instance's replay socket (a real KVEventPublisher, ZMQ on 127.0.0.1) the gateway's subscription first
    applies the batches published before it connected, and a batch lost at the socket is replayed instead of
    emptying the index; blocks published under a LoRA adapter and a salt reach it under them (a prompt of the base
    model does not match them); the replay address is a checked config key."""
    import zmq

    from serving.core.kv_events import KVEventPublisher
    from serving.gateway.kv_index import KVEventIndex, first_block_extra_keys, subscribe
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    a = list(range(100, 113))  # three blocks of 4 and one more token
    pub.publish([("stored", 11, None, a[:4], "GPU", None, None, None)])
    pub.publish([("stored", 12, 11, a[4:8], "GPU", None, None, None)])
    lora = first_block_extra_keys("sql", "tenant-a")
    pub.publish([("stored", 21, None, a[:4], "CPU", 5, "sql", lora), ("stored", 22, 21, a[4:8], "CPU", 5, "sql",
                                                                       ("sql",))])
    ix = KVEventIndex()

    async def until(cond, what):
        for _ in range(200):
            if cond():
                return
            await asyncio.sleep(0.025)
        raise AssertionError(f"timed out waiting for {what} (index at batch {ix.last_seq})")

    async def run():
        stop = asyncio.Event()
        task = asyncio.ensure_future(subscribe(pub.endpoint, ix, stop.is_set, pub.replay_endpoint))
        await until(lambda: ix.last_seq == 2, "the replay of batches 0-2")
        assert ix.match(ix.prompt_keys(a[:9])) == 1.0  # stored before the subscription
        assert ix.match(ix.prompt_keys(a[:9], lora)) == 1.0 and len(ix) == 4
        assert ix.match(ix.prompt_keys(a[:9], first_block_extra_keys("sql", ""))) == 0.0  # another salt
        while ix.last_seq < 3 or ix.batches < 4:  # until the live stream reaches the subscriber
            pub.publish([("removed", 999, "GPU")])  # a block it never held: changes nothing
            await asyncio.sleep(0.05)
        await until(lambda: ix.last_seq == pub._seq - 1, "the live batches")
        send = pub._pub.send_multipart
        pub._pub.send_multipart = lambda *a, **k: (_ for _ in ()).throw(zmq.Again())  # this batch is lost
        pub.publish([("stored", 13, 12, a[8:12], "GPU", None, None, None)])
        pub._pub.send_multipart = send
        pub.publish([("removed", 999, "GPU")])  # the gap shows: the subscriber replays the lost batch
        await until(lambda: ix.last_seq == pub._seq - 1, "the batch after the lost one")
        assert ix.match(ix.prompt_keys(a)) == 1.0 and len(ix) == 5  # nothing emptied, the lost block known
        stop.set()
        await task

    try:
        asyncio.run(run())
    finally:
        pub.close()
    raw = {"pools": [{"name": "p", "instances": [{"name": "i", "target": "h:1", "kv_events": "auto",
                                                  "kv_events_replay": "udp://h:1"}]}]}
    with pytest.raises(ConfigError, match="kv_events_replay"):
        parse_config(raw)


def test_health_quarantines_after_n_windows_and_readmits_after_m():
    h = HealthTracker(IsolationConfig(abnormal_windows=2, healthy_windows=2, slow_ratio=3, slow_min_delta_s=0.02))
    for n in "abc":
        h.add(n)

    def window(slow_latency, probe_ok=None):
        for n in "ab":
            h.observe_latency(n, 0.01)
        if slow_latency is not None:
            if probe_ok is None:
                h.observe_latency("c", slow_latency)
            else:
                h.probe_result("c", probe_ok, [slow_latency])
        return h.end_window()

    assert window(0.2) == [] and h.state("c") == HEALTHY
    assert window(None) == []  # no measurement: the streak neither grows nor resets
    [t] = window(0.2)
    assert (t.name, t.old, t.new) == ("c", HEALTHY, QUARANTINED) and not h.routable("c")
    assert window(0.2, probe_ok=True) == []  # still slow
    assert window(0.01, probe_ok=True) == []
    [t] = window(0.012, probe_ok=True)
    assert (t.new, h.routable("c")) == (HEALTHY, True)
    # Failures: removed at once, readmitted after M healthy checks.
    t = h.mark_failed("a", "connection refused")
    assert t.new == FAILED and h.mark_failed("a", "again") is None
    h.probe_result("a", True)
    assert h.end_window() == []
    h.probe_result("a", True)
    [t] = h.end_window()
    assert t.new == HEALTHY
    # Never quarantine the last healthy instance for slowness (it is only slow relative to peers).
    h2 = HealthTracker(IsolationConfig(abnormal_windows=1))
    for n in "ab":
        h2.add(n)
    h2.mark_failed("a", "down")
    h2.baseline_s = 0.01
    h2.observe_latency("b", 1.0)
    assert h2.end_window() == [] and h2.routable("b")


def test_admission_bounds_and_priority_order():
    depths = []  # (interactive, batch) each time a queue changed: what the gateway's depth gauges show

    async def main():
        adm = Admission(on_change=lambda a: depths.append((a.depth("interactive"), a.depth("batch"))))
        capacity = {"n": 0}
        order = []

        def route(tag):
            def f():
                if capacity["n"] > 0:
                    capacity["n"] -= 1
                    order.append(tag)
                    return tag
                return None
            return f
        tasks = [asyncio.ensure_future(adm.acquire("batch", 2, route(f"b{i}"), 5, lambda _: None)) for i in range(2)]
        await asyncio.sleep(0)
        assert depths == [(0, 1), (0, 2)]  # live while they wait
        with pytest.raises(QueueFull, match="batch queue is full"):
            await adm.acquire("batch", 2, route("b2"), 5, lambda _: None)
        tasks.append(asyncio.ensure_future(adm.acquire("interactive", 1, route("i0"), 5, lambda _: None)))
        await asyncio.sleep(0)
        assert depths[-1] == (1, 2)
        capacity["n"] = 2
        assert adm.notify() == 2
        assert depths[-1] == (0, 1)
        await asyncio.sleep(0)
        assert order == ["i0", "b0"]
        with pytest.raises(asyncio.TimeoutError):
            await adm.acquire("interactive", 1, route("late"), 0.05, lambda _: None)
        capacity["n"] = 1
        adm.notify()
        assert sorted(await asyncio.gather(*tasks)) == ["b0", "b1", "i0"]
        assert depths[-1] == (0, 0)
    asyncio.run(main())


def test_rate_limiter_token_bucket():
    r = RateLimiter()
    assert [r.allow("t", 2.0, 3, now=0.0) for _ in range(3)] == [0, 0, 0]
    assert r.allow("t", 2.0, 3, now=0.0) == pytest.approx(0.5)
    assert r.allow("t", 2.0, 3, now=0.5) == 0
    assert r.allow("other", 0.0, 0) == 0  # unlimited


BAD_SAMPLING = [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-5), dict(min_p=1.5),
                dict(repetition_penalty=0.0), dict(presence_penalty=3.0), dict(logprobs=21),
                dict(min_tokens=20, max_tokens=10), dict(stop_token_ids=[-1]), dict(stop=[""]), dict(n=0), dict(n=17),
                dict(logit_bias={5: 100.5}), dict(logit_bias={-3: 1.0}), dict(logit_bias={t: 1.0 for t in range(301)})]


@pytest.mark.parametrize("sampling", BAD_SAMPLING)
def test_validation_messages_equal_the_servers(sampling):
    """The gateway's check and the SamplingParams the server makes of the same message reject with the same text."""
    from serving.wire.requests import sampling_params
    req = generate_request([5, 6, 7], **sampling)
    with pytest.raises(InvalidArgument) as gw:
        check_generate(req, ModelLimits())
    with pytest.raises(ValueError) as server:
        sampling_params(req.sampling)
    assert str(gw.value) == f"sampling.{server.value}"


def test_validation_prompt_and_context():
    limits = ModelLimits(vocab_size=512, max_model_len=64)
    for req, msg in [(pb.GenerateRequest(), "prompt: empty"), (generate_request(""), "text: the prompt is empty"),
                     (generate_request([1, 600]), "token_ids: token id 600 at position 1"),
                     (generate_request(list(range(64))), "token_ids: the prompt has 64 tokens"),
                     (generate_request([1] * 60, max_tokens=10), "sampling.max_tokens: the prompt (60 tokens)"),
                     (generate_request(messages=[{"role": "", "content": "x"}]), "chat.messages[0].role: empty"),
                     (generate_request([1], request_id="x" * 300), "request_id: 300 characters"),
                     (generate_request([1], priority=7), "priority: unknown value 7"),
                     (generate_request([1], logit_bias={600: 1.0}), "sampling.logit_bias: token id 600 is outside"),
                     (generate_request([1], stop_token_ids=[512]), "sampling.stop_token_ids: token id 512")]:
        with pytest.raises(InvalidArgument, match=msg.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            check_generate(req, limits)
    check_generate(generate_request([1, 2], max_tokens=62), limits)


def test_callback_url_policy(monkeypatch):
    cfg = parse_config({"callbacks": {"allowed_hosts": ["hooks.x", "10.1.2.3", "[::1]"],
                                      "allowed_ports": [443, 8080]}}).callbacks
    assert check_url("http://hooks.x:8080/done", cfg) == "http://hooks.x:8080/done"
    assert check_url("https://HOOKS.x/a b/../%41?q=1#frag".replace(" ", "%20"), cfg) == \
        "https://hooks.x/a%20b/../%41?q=1"  # rebuilt from its parts: the fragment dropped
    assert check_url("https://[::1]:8080/x", cfg) == "https://[::1]:8080/x"
    for url, why in (("http://evil.example:8080/done", "host 'evil.example' is not on"),
                     ("ftp://hooks.x/", "not an http(s) URL"), ("hooks.x/done", "not an http(s) URL"),
                     ("http://hooks.x/", "port 80 is not on"), ("https://hooks.x:22/", "port 22 is not on"),
                     ("https://hooks.x:99999/", "not a number in 1-65535"),
                     ("https://user:pw@hooks.x/", "user information"), ("https://hooks.x@evil.example/", "user info"),
                     ("https://evil.example\\@hooks.x/", "backslashes"), ("https://evil.example\\.hooks.x/", "backsl"),
                     ("https://hooks.x/ x", "printable ASCII"), ("https://hooks.x/\u00e9", "printable ASCII"),
                     ("https://10.1.2.3.nip.io/", "not on"), ("https://hooks.x/" + "a" * 3000, "at most 2048")):
        with pytest.raises(CallbackRefused, match=re.escape(why)):
            check_url(url, cfg)
    # Addresses a callback may connect to: public ones, or those in allowed_networks; an IPv4 address inside an IPv6
    # one (mapped, 6to4, NAT64) counts as itself.
    lan = parse_config({"callbacks": {"allowed_networks": ["10.20.0.0/16"]}}).callbacks
    for address, ok in (("8.8.8.8", True), ("2001:4860:4860::8888", True), ("10.20.3.4", True), ("10.21.0.1", False),
                        ("127.0.0.1", False), ("::1", False), ("169.254.169.254", False), ("fe80::1", False),
                        ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.1", False), ("::ffff:127.0.0.1", False),
                        ("2002:7f00:1::", False), ("64:ff9b::a9fe:a9fe", False), ("64:ff9b::808:808", True)):
        assert address_allowed(ipaddress.ip_address(address), lan) is ok, address
    # Standard Webhooks' example (standard-webhooks/standard-webhooks, spec): this key, id, time and body sign so.
    key = base64.b64decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    body = b'{"test": 2432232314}'
    assert sign(key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body) == \
        "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_job_store_file_mode_and_restart(tmp_path):
    path = str(tmp_path / "jobs.sqlite")
    store = JobStore(path)
    store.insert("j1", "acme", generate_request([1, 2], max_tokens=3), "")
    store.update("j1", state=gpb.JOB_STATE_RUNNING, attempts=1)
    for p in (path, path + "-wal"):  # prompts and results: readable by the gateway's user only
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, p
    store.insert("j2", "acme", generate_request([3]), "http://hooks.x/cb")
    store.update("j2", state=gpb.JOB_STATE_SUCCEEDED)  # finished by an older gateway, callback never tried
    store.close()
    os.chmod(path, 0o644)
    store = JobStore(path)  # reopened: as after a restart; a file left readable is tightened
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert store.unfinished() == [("j1", gpb.JOB_STATE_RUNNING, 0)] and store.get("j1").attempts == 1
    assert store.due_callbacks(1e12, 10) == ["j2"]  # its callback is due at the next start
    assert list(store.request("j1").token_ids.ids) == [1, 2]
    assert store.get("nope") is None
    # a job's result holds one completion: n > 1 is refused at submission, not cut to one sample
    jobs = JobManager(store, run=None, config=lambda: parse_config({}))
    request = generate_request([1, 2], max_tokens=3)
    request.sampling.n = 2
    with pytest.raises(JobError) as e:
        asyncio.run(jobs.submit(request, "", "acme"))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "sampling.n" in e.value.details
    assert [j for j, _, _ in store.unfinished()] == ["j1"]  # nothing stored


def test_config_module_documents_every_section():
    doc = open(os.path.join(REPO_ROOT, "docs/gateway.md")).read()
    for section in ("pools", "routing", "isolation", "long_lane", "admission", "tenants", "admin_keys", "callbacks",
                    "jobs", "instance_tls", "allow_unauthenticated", "allow_no_instances", "disaggregation"):
        assert f"`{section}`" in doc or f"{section}:" in doc, section
    assert gconfig.POLICIES
