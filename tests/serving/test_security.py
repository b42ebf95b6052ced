"""The attacks of issue 35 on the gRPC side, sent for real to one `python -m serving.server` with key files and one
gateway in front of it on 127.0.0.1 (both shared by the module): every instance RPC without a key, with a wrong key,
and with a regular key where an admin key is needed; calls refused before their bytes are decoded (auth first, then
size); a rotated key file; the gateway serving through the instance with its key; two tenants reusing one
request_id; token rate limits and the in-flight cap; HTTP/2 stream caps and ping floods; a deeply nested JSON schema
and an oversized grammar. Over HTTP (the same two processes): keys on every route, bodies past the cap (a lying
Content-Length, chunked), huge headers, slowloris clients, the connection cap, token rate limits, stop-string bounds,
the prefix cache salted per tenant. Also the pieces in-process: key files, the bind warning, config errors that hold
secrets, 500s and unexpected gRPC failures that show the client no internals."""
from __future__ import annotations

import concurrent.futures
import json
import os
import secrets
import socket
import struct
import time

import grpc
import openai
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
        ("instance", "instance_old", "instance_new", "instance_admin", "alpha", "beta", "metered", "capped", "admin",
         "metered_http")}
# The HTTP ports' slow-client limits, small so the attacks end quickly (flags of both servers).
HTTP_FLAGS = ("--http_port=0", "--http_header_timeout_s=2", "--http_body_timeout_s=3")
HTTP_MAX_CONNECTIONS = 256
METERED_BURST = 400  # tokens
LONG = {"ignore_eos": True}


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
                           f"--api_key_file={key_files['api']}", f"--admin_key_file={key_files['admin']}",
                           *HTTP_FLAGS, f"--http_max_connections={HTTP_MAX_CONNECTIONS}")
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
                          tenant("metered", rate_limit={"tokens_per_s": 1.0, "token_burst": METERED_BURST}),
                          tenant("metered_http", rate_limit={"tokens_per_s": 1.0, "token_burst": METERED_BURST})]}
    gw = GatewayProcess(str(tmp_path_factory.mktemp("keyed_gateway")), config, *HTTP_FLAGS)
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


# ---------------------------------------------------------------------------------------------------- HTTP
HTTP_ROUTES = (("GET", "/v1/models", b""), ("POST", "/v1/completions", b'{"prompt": [5, 6], "max_tokens": 2}'),
               ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'),
               ("POST", "/tokenize", b'{"prompt": "hi"}'), ("POST", "/detokenize", b'{"tokens": [5, 6]}'))


def http_port(proc) -> int:
    return proc.info["http_port"]


def rss_bytes(proc) -> int:
    with open(f"/proc/{proc.info['pid']}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024


def read_response(sock, timeout: float = 10.0) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one HTTP/1.1 response with a Content-Length; (0, {}, b"") if the server closed the
    connection without one."""
    sock.settimeout(timeout)
    buf = b""
    try:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                return 0, {}, b""
            buf += chunk
        head, body = buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        while len(body) < int(headers.get("content-length", 0)):
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    except ConnectionResetError:
        return 0, {}, b""
    return int(lines[0].split()[1]), headers, body


def http(proc, method: str, path: str, body: bytes = b"", key: str | None = None, extra: bytes = b""
         ) -> tuple[int, dict, bytes]:
    auth = f"Authorization: Bearer {key}\r\n".encode() if key is not None else b""
    with socket.create_connection(("127.0.0.1", http_port(proc)), timeout=60) as s:
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n".encode() + auth + extra + b"\r\n" + body)
        return read_response(s, 120)


def served(proc, key: str) -> bool:
    status, _, body = http(proc, "POST", "/v1/completions", b'{"prompt": [5, 6], "max_tokens": 2, "ignore_eos": true}',
                           key)
    return status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2


def test_every_http_route_needs_the_key(instance, gateway):
    """The instance's HTTP API takes the keys of its gRPC port, the gateway's its tenants' keys: no key and a wrong
    key are 401 with OpenAI's error body on every route (a route that does not exist too) but /health; the key of
    the other server is a wrong key; the right one is served, and /v1/models names no path on disk."""
    for proc, good, wrong in ((instance, KEYS["instance"], KEYS["alpha"]), (gateway, KEYS["alpha"], KEYS["instance"])):
        for method, path, body in HTTP_ROUTES + (("GET", "/v1/nowhere", b""),):
            for key in (None, wrong, good[:-1]):
                status, headers, got = http(proc, method, path, body, key)
                error = json.loads(got)["error"]
                assert status == 401 and error["code"] == "invalid_api_key", (proc.name, path, key, status, got)
                assert set(error) == {"message", "type", "param", "code"} and headers["x-request-id"]
                assert good not in got.decode() and wrong not in got.decode()
            status, _, got = http(proc, method, path, body, good)
            assert status == (404 if path == "/v1/nowhere" else 200), (proc.name, path, status, got)
        assert http(proc, "GET", "/health")[0] == 200  # probes need no key
        with openai.OpenAI(base_url=f"http://127.0.0.1:{http_port(proc)}/v1", api_key=wrong, max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError):
                c.models.list()
        with openai.OpenAI(base_url=f"http://127.0.0.1:{http_port(proc)}/v1", api_key=good, max_retries=0) as c:
            card = c.models.list().data[0]
            assert c.completions.create(model=card.id, prompt="hi", max_tokens=2).usage.completion_tokens <= 2
    status, _, body = http(instance, "GET", "/v1/models", key=KEYS["instance"])
    assert "/" not in json.loads(body)["data"][0]["root"] and instance.workdir not in body.decode()


def test_http_refuses_before_reading_the_body(instance, gateway):
    """A 100 MiB Content-Length without a key is 401, with a key 413, answered at once with not one byte of the body
    sent; a chunked body is cut off once past the cap (413); a Content-Length smaller than the bytes that follow
    reads only what it says and the rest ends the connection; headers past 64 KiB end it too; the servers' memory
    does not grow and they serve."""
    huge = 100 << 20
    for proc, key in ((instance, KEYS["instance"]), (gateway, KEYS["alpha"])):
        rss0 = rss_bytes(proc)
        for who, expected in ((None, 401), (key, 413)):
            with socket.create_connection(("127.0.0.1", http_port(proc)), timeout=10) as s:
                auth = f"Authorization: Bearer {who}\r\n" if who else ""
                s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {huge}\r\n{auth}\r\n".encode())
                status, _, body = read_response(s, 10)  # no body sent: the answer cannot wait for it
            assert status == expected, (proc.name, who, status, body)
            if expected == 413:
                assert f"Content-Length is {huge} bytes" in json.loads(body)["error"]["message"]
        with socket.create_connection(("127.0.0.1", http_port(proc)), timeout=10) as s:
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                      f"Authorization: Bearer {key}\r\n\r\n".encode())
            chunk, sent = b"%x\r\n" % (1 << 20) + b"a" * (1 << 20) + b"\r\n", 0
            try:
                while sent < huge:
                    s.sendall(chunk)
                    sent += 1 << 20
            except (BrokenPipeError, ConnectionResetError):
                pass
            status, _, body = read_response(s, 10)
        assert sent < huge and status in (413, 0), (proc.name, sent, status)  # 0: reset before the answer was read
        with socket.create_connection(("127.0.0.1", http_port(proc)), timeout=10) as s:
            lie = b'{"prompt": "hi"}' + b"x" * (4 << 20)  # Content-Length names the first 16 bytes only
            s.sendall(f"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 16\r\nAuthorization: Bearer {key}\r\n"
                      "\r\n".encode())
            try:
                s.sendall(lie)
            except (BrokenPipeError, ConnectionResetError):
                pass
            first = read_response(s, 10)
            second = read_response(s, 10)
        # The 16 bytes it said are the request (answered, or refused with the garbage after them, by the parser);
        # the rest is no request: refused and the connection closed, never read as a body.
        assert first[0] == 400 or first[0] == 200 and json.loads(first[2])["count"] > 0, first
        assert second[0] in (0, 400), second
        with socket.create_connection(("127.0.0.1", http_port(proc)), timeout=10) as s:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: ")
            sent = 0
            try:
                while sent < 64 << 20:  # as fast as the server reads: it must not buffer headers without end
                    s.sendall(b"a" * (1 << 20))
                    sent += 1 << 20
            except OSError:
                pass
            headers_cut = read_response(s, 10)[0]
        assert sent < 64 << 20 and headers_cut in (0, 400, 431), (proc.name, sent, headers_cut)
        assert rss_bytes(proc) - rss0 < 48 << 20, (proc.name, rss0, rss_bytes(proc))
        assert served(proc, key)


def test_slow_clients_are_cut_off_and_others_served(instance, gateway):
    """200 connections to each server sending their headers one byte a second are closed once the header timeout
    (2 s) passes, while a real request is served meanwhile; a body dripping a byte a second gets 408."""
    conns = {}
    for proc in (instance, gateway):
        conns[proc.name] = [socket.create_connection(("127.0.0.1", http_port(proc)), timeout=5) for _ in range(200)]
    try:
        header = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 64
        for s in (s for group in conns.values() for s in group):
            s.sendall(header[:1])
            s.setblocking(False)
        assert served(instance, KEYS["instance"]) and served(gateway, KEYS["alpha"])  # while all 400 are open
        t0, closed = time.monotonic(), set()
        for i in range(1, 12):
            for s in (s for group in conns.values() for s in group):
                if s in closed:
                    continue
                try:
                    if s.recv(1024) == b"":
                        closed.add(s)
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    closed.add(s)
                    continue
                try:
                    s.send(header[i:i + 1])
                except OSError:
                    closed.add(s)
            if len(closed) == 400:
                break
            time.sleep(1)
        assert len(closed) == 400, f"{len(closed)} of 400 slow connections closed after {time.monotonic() - t0:.0f}s"
    finally:
        for s in (s for group in conns.values() for s in group):
            s.close()
    for proc, key in ((instance, KEYS["instance"]), (gateway, KEYS["alpha"])):
        with socket.create_connection(("127.0.0.1", http_port(proc)), timeout=10) as s:
            s.sendall(f"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\nAuthorization: Bearer {key}\r\n"
                      "\r\n{".encode())
            t0 = time.monotonic()
            s.settimeout(1.0)
            status = 0
            for _ in range(10):  # a byte a second, until the server answers
                try:
                    status = read_response(s, 1.0)[0]
                    break
                except socket.timeout:
                    s.sendall(b" ")
            assert status == 408 and 2.5 < time.monotonic() - t0 < 8, (proc.name, status)
        assert served(proc, key)


def test_connections_over_the_cap_get_503(instance):
    """The instance holds HTTP_MAX_CONNECTIONS connections at most: with them all open, a request gets 503 at once;
    once they go it is served."""
    held = [socket.create_connection(("127.0.0.1", http_port(instance)), timeout=5)
            for _ in range(HTTP_MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        status, _, _ = http(instance, "GET", "/v1/models", key=KEYS["instance"])
    finally:
        for s in held:
            s.close()
    assert status == 503
    wait_for(lambda: served(instance, KEYS["instance"]), 10, what="served once the connections closed")


def test_http_rate_limits_count_tokens(gateway):
    """Over HTTP a request counts its tokens as over gRPC: prompt + max_tokens x n, for every prompt."""
    with openai.OpenAI(base_url=f"http://127.0.0.1:{http_port(gateway)}/v1", api_key=KEYS["metered_http"],
                       max_retries=0, timeout=120) as c:
        model = c.models.list().data[0].id
        ok = c.completions.create(model=model, prompt=[5] * 8, max_tokens=16, n=16, extra_body=LONG)
        with pytest.raises(openai.RateLimitError) as again:
            c.completions.create(model=model, prompt=[5] * 8, max_tokens=16, n=16, extra_body=LONG)
        with pytest.raises(openai.RateLimitError) as never:  # eight prompts: 8 x (8 + 16 x 16) = 2112
            c.completions.create(model=model, prompt=[[5] * 8] * 8, max_tokens=16, n=16, extra_body=LONG)
    assert len(ok.choices) == 16
    assert "this request counts 264" in again.value.body["message"] and int(again.value.response.headers[
        "retry-after"]) > 60
    assert "counts 2112 tokens" in never.value.body["message"]


def test_stop_strings_are_bounded(instance, gateway):
    for proc, key in ((instance, KEYS["instance"]), (gateway, KEYS["alpha"])):
        for stop, words in ((["x"] * 17, "17 strings, more than 16"), (["y" * 257], "at most 256 characters")):
            body = json.dumps({"prompt": "hi", "max_tokens": 2, "stop": stop}).encode()
            status, _, got = http(proc, "POST", "/v1/completions", body, key)
            error = json.loads(got)["error"]
            assert status == 400 and error["param"] == "stop" and words in error["message"], (proc.name, got)
            with Client(proc.target, timeout=30) as client:
                with pytest.raises(ClientError) as e:
                    client.complete("hi", max_tokens=2, stop=stop, metadata=bearer(key))
            assert e.value.code == StatusCode.INVALID_ARGUMENT and words in e.value.details
        assert served(proc, key)


def test_a_500_shows_the_client_no_internals(caplog):
    """A frontend whose run fails with a message naming a path: the client reads a generic 500 with its request id
    (echoed in x-request-id), the log has the exception; the server goes on serving. (A real uvicorn server on
    127.0.0.1 over the OpenAI app; the frontend is a stand-in, as no real engine fails on request.)"""
    import asyncio

    from serving.api.app import ChatParsers, OpenAIApp
    from serving.params import ModelLimits

    class Failing:
        render_elsewhere, tokenizer = True, None

        def model_name(self): return "m"
        def model_card(self): return {}
        def limits(self): return ModelLimits(vocab_size=100, max_model_len=64, max_request_bytes=1 << 20)
        def parsers(self): return ChatParsers()
        def refusal(self): return None
        def unhealthy(self): return None
        def authorize(self, headers): return None
        def count_error(self, e): pass

        def run(self, ereq, response_id, caller, headers):
            raise RuntimeError("cannot open /srv/secret/weights.bin")

    async def main():
        app = OpenAIApp(Failing(), title="t", description="t")
        port = await app.start("127.0.0.1", 0)
        proc = type("P", (), {"info": {"http_port": port}})
        try:
            failed = await asyncio.to_thread(http, proc, "POST", "/v1/completions", b'{"prompt": [5, 6]}',
                                             extra=b"X-Request-Id: probe-1\r\n")
            health = await asyncio.to_thread(http, proc, "GET", "/health")
        finally:
            await app.stop()
        return failed, health
    with caplog.at_level("ERROR"):
        (status, headers, body), health = asyncio.run(main())
    error = json.loads(body)["error"]
    assert status == 500 and "secret" not in body.decode() and "RuntimeError" not in body.decode(), body
    assert "probe-1" in error["message"] and headers["x-request-id"] == "probe-1"
    assert "/srv/secret/weights.bin" in caplog.text and "probe-1" in caplog.text
    assert health[0] == 200


def test_the_prefix_cache_is_salted_per_tenant(instance, gateway):
    """A prompt one tenant sent is cached for it alone: another tenant sending it reads cached_tokens 0 (so it cannot
    test what others asked); over both HTTP APIs a request's cache_salt (vLLM's) parts it the same way, within the
    tenant's salt at the gateway."""
    prompt = list(range(20, 20 + 70))  # four full pages of 16
    with Client(gateway.target, timeout=60) as client:
        def cached(key):
            return client.complete(prompt, max_tokens=1, metadata=bearer(key)).cached_prompt_tokens
        first, other, again = cached(KEYS["alpha"]), cached(KEYS["beta"]), cached(KEYS["alpha"])
    assert first == 0 and other == 0 and again >= 48, (first, other, again)

    def over_http(salt):
        body = {"prompt": [p + 100 for p in prompt], "max_tokens": 1, **({"cache_salt": salt} if salt else {})}
        status, _, got = http(instance, "POST", "/v1/completions", json.dumps(body).encode(), KEYS["instance"])
        assert status == 200, got
        return json.loads(got)["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    results = [over_http(s) for s in ("s1", "s2", "s1", None)]
    assert results[0] == 0 and results[1] == 0 and results[2] >= 48 and results[3] == 0, results

    def through_gateway(salt, key=KEYS["alpha"]):  # the gateway's HTTP API carries cache_salt within the tenant's
        body = {"prompt": [p + 200 for p in prompt], "max_tokens": 1, **({"cache_salt": salt} if salt else {})}
        status, _, got = http(gateway, "POST", "/v1/completions", json.dumps(body).encode(), key)
        assert status == 200, got
        return json.loads(got)["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    results = [through_gateway("s1"), through_gateway("s2"), through_gateway("s1"), through_gateway(None),
               through_gateway("s1", KEYS["beta"])]
    assert results[:2] == [0, 0] and results[2] >= 48 and results[3:] == [0, 0], results
    status, _, got = http(instance, "POST", "/v1/completions", json.dumps(
        {"prompt": "hi", "cache_salt": "x" * 257}).encode(), KEYS["instance"])
    assert status == 400 and json.loads(got)["error"]["param"] == "cache_salt", got


def test_an_unexpected_grpc_failure_shows_the_client_no_internals(caplog):
    """A handler failing with a message naming a path: the client reads INTERNAL with an error id (gRPC's own answer
    would be UNKNOWN with the exception's text), the log has the text; the server serves the next call. (A real
    grpc.aio server on 127.0.0.1 with the servers' interceptor over a stand-in servicer.)"""
    import asyncio

    from serving.wire.decoding import DecodeErrorInterceptor

    class Failing(pb_grpc.InferenceServicer):
        async def Tokenize(self, request, context):
            if request.text == "fail":
                raise RuntimeError("cannot open /srv/secret/tokenizer.json")
            return pb.TokenizeResponse(token_ids=[1, 2])

        async def Generate(self, request, context):
            yield pb.GenerateResponse(token_ids=[1])
            raise KeyError("/srv/secret/engine-state")

    async def main():
        server = grpc.aio.server(interceptors=[DecodeErrorInterceptor()])
        pb_grpc.add_InferenceServicer_to_server(Failing(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub, got = pb_grpc.InferenceStub(channel), []
                try:
                    await stub.Tokenize(pb.TokenizeRequest(text="fail"))
                except grpc.aio.AioRpcError as e:
                    got.append((e.code(), e.details()))
                stream = stub.Generate(generate_request([5]))
                try:
                    async for _ in stream:
                        pass
                except grpc.aio.AioRpcError as e:
                    got.append((e.code(), e.details()))
                ok = await stub.Tokenize(pb.TokenizeRequest(text="hi"))
                return got, ok
        finally:
            await server.stop(None)
    with caplog.at_level("ERROR"):
        got, ok = asyncio.run(main())
    assert [code for code, _ in got] == [StatusCode.INTERNAL] * 2, got
    for _, details in got:
        assert "secret" not in details and "error id" in details, details
        assert details.split("error id ")[1].split(")")[0] in caplog.text
    assert "/srv/secret/tokenizer.json" in caplog.text and "/srv/secret/engine-state" in caplog.text
    assert list(ok.token_ids) == [1, 2]
