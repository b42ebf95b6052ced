"""The attacks of issue 35 on the gRPC side, sent for real to one `python -m serving.server` with key files and one
gateway in front of it on 127.0.0.1 (both shared by the module): every instance RPC without a key, with a wrong key,
and with a regular key where an admin key is needed; calls refused before their bytes are decoded (auth first, then
size); a rotated key file; the gateway serving through the instance with its key; two tenants reusing one
request_id; token rate limits and the in-flight cap; HTTP/2 stream caps and ping floods; a deeply nested JSON schema
and an oversized grammar. Also the pieces in-process: key files, the bind warning, config errors that hold secrets."""
from __future__ import annotations

import concurrent.futures
import os
import secrets
import socket
import struct
import time

import grpc
import pytest
import yaml

from absl import flags
from grpc_health.v1 import health_pb2, health_pb2_grpc

from models.synthetic import shared_small_llama
from serving.auth import InstanceKeys, KeyFile, Refused, bind_warning, read_keys
from serving.gateway.app import Gateway, GatewayError, instance_request_id
from serving.gateway.config import ConfigError, load_config, parse_config
from serving.wire.client import Client, ClientError, generate_request
from serving.wire import meshserve_pb2 as pb
from serving.wire import meshserve_pb2_grpc as pb_grpc
from serving.transport import MAX_CONCURRENT_STREAMS, TRANSPORT_SLACK_BYTES
from serving.params import MAX_REQUEST_ID_CHARS
from tests.support.gateway import GatewayProcess, InstanceProcess, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

StatusCode = grpc.StatusCode
KEYS = {name: secrets.token_urlsafe(24) for name in
        ("instance", "instance_old", "instance_new", "instance_admin", "alpha", "beta", "metered", "capped", "admin")}
METERED_BURST = 400  # tokens


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def write_keys(path: str, *keys: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("# instance keys\n" + "".join(k + "\n" for k in keys))
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def key_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    files = {name: str(d / f"{name}.keys") for name in ("api", "admin", "gateway")}
    write_keys(files["api"], KEYS["instance_old"], KEYS["instance"])
    write_keys(files["admin"], KEYS["instance_admin"])
    write_keys(files["gateway"], KEYS["instance"])
    return files


@pytest.fixture(scope="module")
def instance(key_files, tmp_path_factory):
    proc = InstanceProcess(shared_small_llama(), str(tmp_path_factory.mktemp("keyed_instance")),
                           f"--api_key_file={key_files['api']}", f"--admin_key_file={key_files['admin']}")
    try:
        yield proc.wait_ready()
    finally:
        proc.set_delay(0)
        assert proc.terminate() == 0, proc.log()[-4000:]


def tenant(name: str, **kw) -> dict:
    return {"name": name, "api_keys": [KEYS[name]], **kw}


@pytest.fixture(scope="module")
def gateway(instance, key_files, tmp_path_factory):
    config = {"pools": [{"name": "a", "instances": [{"name": "i0", "target": instance.target}]}],
              "isolation": {"enabled": False}, "instance_key_file": key_files["gateway"],
              "admin_keys": [KEYS["admin"]],
              "tenants": [tenant("alpha"), tenant("beta"), tenant("capped", max_inflight=1),
                          tenant("metered", rate_limit={"tokens_per_s": 1.0, "token_burst": METERED_BURST})]}
    gw = GatewayProcess(str(tmp_path_factory.mktemp("keyed_gateway")), config)
    try:
        wait_for(lambda: all(i.report_age_s >= 0 and i.state == "healthy" for i in
                             gw.instances(KEYS["admin"]).values()), 60, what="a load report through the key")
        yield gw
    finally:
        assert gw.stop() == 0, gw.log()[-4000:]


def outcome(fn) -> tuple[StatusCode, str]:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return StatusCode.OK, ""


def instance_calls(stub, metadata):
    """Every meshserve.v1.Inference RPC, as (name, needs an admin key, call)."""
    req = generate_request([5, 6, 7], max_tokens=2, ignore_eos=True)
    return [
        ("Generate", False, lambda: list(stub.Generate(req, metadata=metadata, timeout=60))),
        ("Tokenize", False, lambda: stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=metadata, timeout=30)),
        ("ModelInfo", False, lambda: stub.ModelInfo(pb.ModelInfoRequest(), metadata=metadata, timeout=30)),
        ("GetLoad", False, lambda: stub.GetLoad(pb.GetLoadRequest(), metadata=metadata, timeout=30)),
        ("WatchLoad", False, lambda: next(iter(stub.WatchLoad(pb.WatchLoadRequest(interval_ms=10),
                                                              metadata=metadata, timeout=30)))),
        ("GetLoad(check_invariants)", True,
         lambda: stub.GetLoad(pb.GetLoadRequest(check_invariants=True), metadata=metadata, timeout=30)),
        ("Drain(resume)", True, lambda: stub.Drain(pb.DrainRequest(resume=True), metadata=metadata, timeout=30)),
    ]


# ---------------------------------------------------------------------------------------------------- the instance
def test_every_instance_rpc_needs_its_key(instance):
    with grpc.insecure_channel(instance.target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        got = {}
        for who, metadata in (("none", None), ("wrong", bearer(KEYS["alpha"])), ("x-api-key wrong",
                              [("x-api-key", "not-" + KEYS["instance"])]), ("regular", bearer(KEYS["instance"])),
                              ("admin", bearer(KEYS["instance_admin"]))):
            for name, admin, call in instance_calls(stub, metadata):
                got[who, name] = outcome(call)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    for (who, name), (code, details) in got.items():
        admin = "check_invariants" in name or "Drain" in name
        expected = {"none": StatusCode.UNAUTHENTICATED, "wrong": StatusCode.UNAUTHENTICATED,
                    "x-api-key wrong": StatusCode.UNAUTHENTICATED,
                    "regular": StatusCode.PERMISSION_DENIED if admin else StatusCode.OK, "admin": StatusCode.OK}[who]
        assert code == expected, f"{who} key, {name}: {code.name}: {details}"
        assert KEYS["instance"] not in details and KEYS["instance_admin"] not in details
    assert "admin key" in got["regular", "Drain(resume)"][1]
    assert got["none", "Generate"][1].startswith("no API key")
    assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no key


def test_a_call_is_refused_on_its_key_before_its_bytes_are_decoded(instance, gateway):
    """Bytes that are no GenerateRequest: without a key UNAUTHENTICATED (nothing parsed them); with one the decoder's
    INVALID_ARGUMENT. A message over --max_request_bytes + the slack: RESOURCE_EXHAUSTED from gRPC core, not the
    decoder's error, so it was never decoded either; both servers still serve."""
    garbage = b"\x12\xff\xff\xff\xff\x0f"
    oversized = b"\xff" * ((1 << 20) + TRANSPORT_SLACK_BYTES + 1)
    for proc, key in ((instance, KEYS["instance"]), (gateway, KEYS["alpha"])):
        with grpc.insecure_channel(proc.target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
            generate = channel.unary_stream("/meshserve.v1.Inference/Generate")  # bytes sent as they are
            tokenize = channel.unary_unary("/meshserve.v1.Inference/Tokenize")
            anonymous = outcome(lambda: list(generate(garbage, timeout=30)))
            anonymous_big = outcome(lambda: tokenize(oversized, timeout=30))
            keyed = outcome(lambda: list(generate(garbage, metadata=bearer(key), timeout=30)))
            big = outcome(lambda: list(generate(oversized, metadata=bearer(key), timeout=30)))
        assert anonymous[0] == StatusCode.UNAUTHENTICATED and anonymous_big[0] == StatusCode.UNAUTHENTICATED, \
            (proc.name, anonymous, anonymous_big)
        assert keyed[0] == StatusCode.INVALID_ARGUMENT and keyed[1].startswith("request: the bytes are not"), keyed
        assert big[0] == StatusCode.RESOURCE_EXHAUSTED and "larger than max" in big[1], (proc.name, big)
    with Client(gateway.target, timeout=60) as client:
        assert client.complete([5, 6], max_tokens=2, ignore_eos=True, metadata=bearer(KEYS["alpha"])
                               ).completion_tokens == 2


def test_a_rotated_key_file_is_read_again(instance, key_files):
    with grpc.insecure_channel(instance.target) as channel:
        info = pb_grpc.InferenceStub(channel).ModelInfo
        assert outcome(lambda: info(pb.ModelInfoRequest(), metadata=bearer(KEYS["instance_old"])))[0] == StatusCode.OK
        try:
            write_keys(key_files["api"], KEYS["instance"], KEYS["instance_new"])
            wait_for(lambda: outcome(lambda: info(pb.ModelInfoRequest(), metadata=bearer(KEYS["instance_old"])))[0]
                     == StatusCode.UNAUTHENTICATED, 10, what="the old key refused")
            assert outcome(lambda: info(pb.ModelInfoRequest(), metadata=bearer(KEYS["instance_new"])))[0] \
                == StatusCode.OK
            with open(key_files["api"], "w") as f:  # half-written: the keys in force stay
                f.write("short\n")
            time.sleep(1.5)
            assert outcome(lambda: info(pb.ModelInfoRequest(), metadata=bearer(KEYS["instance_new"])))[0] \
                == StatusCode.OK
            assert "line 1 is not a key" in instance.log() and "short" not in instance.log()
        finally:
            write_keys(key_files["api"], KEYS["instance_old"], KEYS["instance"])


# ---------------------------------------------------------------------------------------------------- the gateway
def test_the_gateway_serves_through_the_instance_with_its_key(gateway):
    with Client(gateway.target, timeout=60) as client:
        md = bearer(KEYS["alpha"])
        c = client.complete([5, 6, 7], max_tokens=4, ignore_eos=True, temperature=0.0, metadata=md)
        ids = client.stub.Tokenize(pb.TokenizeRequest(text="hello world"), metadata=md, timeout=30).token_ids
        info = client.stub.ModelInfo(pb.ModelInfoRequest(), metadata=md, timeout=30)
        with pytest.raises(grpc.RpcError) as refused:  # the gateway's own admin RPCs: a tenant key is not enough
            client.stub.Drain(pb.DrainRequest(resume=True), metadata=md, timeout=30)
    assert c.completion_tokens == 4 and len(ids) > 0 and info.vocab_size == 512
    assert refused.value.code() == StatusCode.PERMISSION_DENIED
    assert gateway.instances(KEYS["admin"])["i0"].state == "healthy"  # WatchLoad carries the key too


def test_two_tenants_reusing_one_request_id_do_not_collide(instance, gateway):
    instance.set_delay(0.02)  # every request is still running when the last one arrives
    try:
        def run(key):
            with Client(gateway.target, timeout=120) as client:
                return list(client.generate([5, 6, 7, 8], max_tokens=12, ignore_eos=True, request_id="order-1",
                                            metadata=bearer(key)))
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            streams = list(ex.map(run, [KEYS["alpha"], KEYS["beta"]] * 4))
    finally:
        instance.set_delay(0)
    for responses in streams:
        assert sum(len(r.token_ids) for r in responses) == 12
        assert {r.request_id for r in responses} == {"order-1"}  # the client's id comes back, not the instance's


def test_a_token_rate_limit_counts_prompt_plus_max_tokens_times_n(gateway):
    with Client(gateway.target, timeout=120) as client:
        md = bearer(KEYS["metered"])
        served = client.complete([5] * 8, max_tokens=16, n=16, ignore_eos=True, metadata=md)  # 8 + 16 x 16 = 264
        with pytest.raises(ClientError) as again:  # 264 more: over what is left of the bucket
            client.complete([5] * 8, max_tokens=16, n=16, ignore_eos=True, metadata=md)
        with pytest.raises(ClientError) as never:  # 8 + 64 x 16 = 1032: over the whole bucket
            client.complete([5] * 8, max_tokens=64, n=16, ignore_eos=True, metadata=md)
        other = client.complete([5] * 8, max_tokens=16, n=16, ignore_eos=True, metadata=bearer(KEYS["beta"]))
    assert len(served.outputs) == 16 and len(other.outputs) == 16
    assert again.value.code == StatusCode.RESOURCE_EXHAUSTED and "tokens/s (this request counts 264" in \
        again.value.details and again.value.retry_after_s > 60, again.value
    assert never.value.code == StatusCode.RESOURCE_EXHAUSTED and "counts 1032 tokens" in never.value.details \
        and never.value.retry_after_s is None, never.value


def test_a_tenant_over_its_in_flight_cap_is_refused(instance, gateway):
    instance.set_delay(0.05)
    try:
        with Client(gateway.target, timeout=120) as client:
            first = client.generate([5, 6, 7], max_tokens=40, ignore_eos=True, metadata=bearer(KEYS["capped"]))
            next(first)  # running
            with pytest.raises(ClientError) as refused:
                client.complete([5, 6], max_tokens=2, metadata=bearer(KEYS["capped"]))
            other = client.complete([5, 6], max_tokens=2, ignore_eos=True, metadata=bearer(KEYS["alpha"]))
            assert sum(len(r.token_ids) for r in first) > 0
            after = client.complete([5, 6], max_tokens=2, ignore_eos=True, metadata=bearer(KEYS["capped"]))
    finally:
        instance.set_delay(0)
    assert refused.value.code == StatusCode.RESOURCE_EXHAUSTED and "max_inflight" in refused.value.details
    assert refused.value.retry_after_s is not None
    assert other.completion_tokens == 2 and after.completion_tokens == 2


def test_many_prompts_with_n_16_count_as_their_tokens(tmp_path):
    """What the HTTP API's multi-prompt completions pass to check_rate: eight prompts x n=16 are refused by a token
    limit that one of them passes (in-process: the rate check alone)."""
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump({"tenants": [tenant("metered", rate_limit={"tokens_per_s": 1.0,
                                                                              "token_burst": METERED_BURST})]}))
    gw = Gateway(str(path), str(tmp_path / "jobs.sqlite"))
    try:
        t = gw.config.tenants[0]
        prompts = [gw.prepare(generate_request([5] * 8, max_tokens=16, n=16), t) for _ in range(8)]
        with pytest.raises(GatewayError) as e:
            gw.check_rate(t, prompts)
        assert e.value.code == StatusCode.RESOURCE_EXHAUSTED and "counts 2112 tokens" in e.value.details
        gw.check_rate(t, prompts[:1])  # 264 of 400: passes
    finally:
        gw.jobs.store.close()


# ---------------------------------------------------------------------------------------------------- HTTP/2
def _frames(sock, deadline):
    """HTTP/2 frames (type, flags, payload) as they arrive, until the connection closes or `deadline`."""
    buf = b""
    while time.monotonic() < deadline:
        while len(buf) >= 9:
            length = int.from_bytes(buf[:3], "big")
            if len(buf) < 9 + length:
                break
            yield buf[3], buf[4], buf[9:9 + length]
            buf = buf[9 + length:]
        try:
            chunk = sock.recv(65536)
        except (socket.timeout, OSError):
            return
        if not chunk:
            return
        buf += chunk


def test_http2_stream_cap_and_ping_flood(instance, gateway):
    """Each server says max_concurrent_streams in its SETTINGS, and answers ten pings on an idle connection with
    GOAWAY ENHANCE_YOUR_CALM (too_many_pings)."""
    for proc in (instance, gateway):
        with socket.create_connection(("127.0.0.1", proc.port), timeout=5) as s:
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            settings, goaway = None, None
            for kind, flags_, payload in _frames(s, time.monotonic() + 10):
                if kind == 4 and not flags_ & 1 and settings is None:  # the server's SETTINGS
                    settings = dict(struct.unpack(">HI", payload[i:i + 6]) for i in range(0, len(payload), 6))
                    s.sendall(b"\x00\x00\x00\x04\x01\x00\x00\x00\x00" + b"".join(  # ACK, then the flood
                        b"\x00\x00\x08\x06\x00\x00\x00\x00\x00" + i.to_bytes(8, "big") for i in range(10)))
                elif kind == 7:
                    goaway = struct.unpack(">II", payload[:8])[1], payload[8:]
                    break
        assert settings is not None and settings.get(3) == MAX_CONCURRENT_STREAMS, (proc.name, settings)
        assert goaway is not None and goaway[0] == 0xB and b"too_many_pings" in goaway[1], (proc.name, goaway)


# ---------------------------------------------------------------------------------------------------- grammars
def test_a_deep_schema_and_a_huge_grammar_are_invalid_argument(instance, gateway):
    deep = '{"type": "array", "items": ' * 600 + '{"type": "string"}' + "}" * 600  # valid JSON, 601 levels
    huge = "start: " + " | ".join(f'"w{i}"' for i in range(20000))  # a valid grammar of ~200K characters
    for proc, key in ((instance, KEYS["instance"]), (gateway, KEYS["alpha"])):
        with Client(proc.target, timeout=60) as client:
            for kind, value, words in (("json_schema", deep, "601 levels deep"),
                                       ("grammar", huge, "characters, more than the 131072")):
                with pytest.raises(ClientError) as e:
                    client.complete("hi", max_tokens=2, structured={kind: value}, metadata=bearer(key))
                assert e.value.code == StatusCode.INVALID_ARGUMENT, (proc.name, e.value)
                assert e.value.details.startswith(f"sampling.structured.{kind}:") and words in e.value.details
            ok = client.complete("hi", max_tokens=4, structured={"choice": ["yes", "no"]}, metadata=bearer(key))
            assert ok.text in ("yes", "no")
    with Client(instance.target, timeout=30) as client:
        load = client.stub.GetLoad(pb.GetLoadRequest(check_invariants=True), metadata=bearer(KEYS["instance_admin"]))
    assert load.invariant_error == "" and load.kv_pages_free == load.kv_pages_total


# ---------------------------------------------------------------------------------------------------- in-process
def test_key_files_never_show_a_key_and_keep_the_keys_in_force(tmp_path, caplog):
    path = str(tmp_path / "keys")
    secret = "x" * 12  # too short: refused
    with open(path, "w") as f:
        f.write(f"{'k' * 20}\n{secret}\n")
    with pytest.raises(ValueError) as e:
        read_keys(path, "--api_key_file")
    assert "line 2" in str(e.value) and secret not in str(e.value)
    write_keys(path)  # comments only
    with pytest.raises(ValueError, match="no key"):
        read_keys(path, "--api_key_file")
    write_keys(path, "k" * 20)
    keys = KeyFile(path, "--api_key_file")
    with open(path, "w") as f:
        f.write("")
    keys._checked -= 2  # as if a second had passed
    assert keys.current() == (b"k" * 20,) and "keeping the 1 keys" in caplog.text


def test_instance_keys_levels():
    with pytest.raises(ValueError, match="--api_key_file=/nonexistent"):
        InstanceKeys("/nonexistent")
    open_keys = InstanceKeys()
    assert open_keys.authorize([], admin=True) == 0 and open_keys.authorize([]) == 0


def test_the_bind_warning(tmp_path):
    path = str(tmp_path / "keys")
    write_keys(path, "k" * 20)
    for host in ("127.0.0.1", "::1", "localhost"):
        assert bind_warning(host, 1, InstanceKeys()) == ""
    assert bind_warning("0.0.0.0", 1, InstanceKeys(api_key_file=path)) == ""
    warning = bind_warning("0.0.0.0", 50051, InstanceKeys())
    assert "0.0.0.0:50051 without --api_key_file" in warning and "drain it" in warning
    assert "drain" not in bind_warning("10.0.0.5", 1, InstanceKeys(admin_key_file=path))


def test_the_server_listens_on_loopback_unless_told_otherwise():
    from serving.server.__main__ import define_flags
    fv = flags.FlagValues()
    define_flags(fv)
    fv(["serving.server", "--model=x"])
    assert fv.host == "127.0.0.1" and fv.api_key_file == "" and fv.max_concurrent_streams == MAX_CONCURRENT_STREAMS


def test_config_errors_never_show_a_secret(tmp_path):
    secret = "sk-" + secrets.token_hex(16)
    bad = [{"admin_keys": secret}, {"admin_keys": {secret: 1}},
           {"tenants": [{"name": "a", "api_keys": secret}]},
           {"tenants": [{"name": "a", "api_keys": [secret, 5]}]},
           {"tenants": [{"name": "a", "webhook_secret": 12345678901234567890, "api_keys": [secret]}]},
           {"tenants": [{"name": "a", "webhook_secret": secret}]},
           {"callbacks": {"webhook_secret": ["whsec_" + secret]}}]
    for raw in bad:
        with pytest.raises(ConfigError) as e:
            parse_config(raw)
        assert secret not in str(e.value) and "12345678901234567890" not in str(e.value), str(e.value)
    path = tmp_path / "bad.yaml"
    path.write_text(f'admin_keys: ["{secret}\\q"]\n')
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert secret not in str(e.value)
    key_file = tmp_path / "instance.keys"
    key_file.write_text(secret[:10] + "\n")
    with pytest.raises(ConfigError) as e:
        parse_config({"instance_key_file": str(key_file)})
    assert "instance_key_file" in str(e.value) and secret[:10] not in str(e.value)
    config = parse_config({"admin_keys": [secret], "tenants": [{"name": "a", "api_keys": [secret + "x"]}]})
    assert secret not in repr(config)  # keys stay out of reprs (logs)


def test_instance_request_ids_are_scoped_and_bounded():
    a, b = instance_request_id("alpha", "r1"), instance_request_id("alpha", "r1")
    assert a.startswith("alpha/r1/") and a != b
    long = instance_request_id("t" * 64, "r" * MAX_REQUEST_ID_CHARS)
    assert len(long) <= MAX_REQUEST_ID_CHARS and long.startswith("t" * 64 + "/#")


def test_refused_names_the_http_status():
    assert Refused(StatusCode.UNAUTHENTICATED, "x").http_status == 401
    assert Refused(StatusCode.PERMISSION_DENIED, "x").http_status == 403
