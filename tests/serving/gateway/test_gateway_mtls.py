"""Mutual TLS from the gateway to an instance: the instance serves TLS and requires a client certificate signed
by its CA; plaintext and certificate-less clients are refused; the gateway, configured with `instance_tls`,
routes through it."""
import json
import os
import subprocess

import grpc
import pytest

from serving.process import start_process as Process
from serving.wire.client import Client, ClientError, generate_request
from serving.wire import meshserve_pb2_grpc as pb_grpc
from models.synthetic import shared_small_llama
from serving.process import ServerProcess
from tests.support.gateway import wait_for

pytestmark = pytest.mark.e2e


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("pki"))
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=meshserve-test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    for name in ("instance", "gateway"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out",
                 f"{name}.csr", cwd=d)
        with open(os.path.join(d, f"{name}.ext"), "w") as f:
            f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)
    return {k: os.path.join(d, v) for k, v in dict(ca="ca.pem", cert="gateway.pem", key="gateway.key",
                                                      server_cert="instance.pem", server_key="instance.key").items()}


def _complete_once_routable(client):
    """The completion, or None while the gateway answers UNAVAILABLE ("no healthy instance; retry later"): it is
    ready before its first TLS load report from the instance arrives, which on a loaded machine can take seconds."""
    try:
        return client.complete([5, 6, 7], max_tokens=4, temperature=0.0, ignore_eos=True)
    except ClientError as e:
        if e.code != grpc.StatusCode.UNAVAILABLE:
            raise
        return None


def test_gateway_to_instance_mutual_tls(pki, tmp_path):
    instance = ServerProcess(shared_small_llama(), str(tmp_path / "instance"), f"--tls_cert={pki['server_cert']}",
                             f"--tls_key={pki['server_key']}", f"--tls_client_ca={pki['ca']}")
    gateway = None
    try:
        instance.wait_ready(600)
        target = f"127.0.0.1:{instance.port}"
        request = generate_request([5, 6, 7], max_tokens=3, temperature=0.0, ignore_eos=True)
        with pytest.raises(ClientError):  # plaintext is refused
            Client(target, timeout=10).complete([5, 6, 7], max_tokens=3)
        no_cert = grpc.ssl_channel_credentials(root_certificates=open(pki["ca"], "rb").read())
        with grpc.secure_channel(target, no_cert) as ch, pytest.raises(grpc.RpcError):  # no client certificate
            list(pb_grpc.InferenceStub(ch).Generate(request, timeout=10))
        mutual = grpc.ssl_channel_credentials(root_certificates=open(pki["ca"], "rb").read(),
                                              private_key=open(pki["key"], "rb").read(),
                                              certificate_chain=open(pki["cert"], "rb").read())
        with grpc.secure_channel(target, mutual) as ch:
            assert sum(len(r.token_ids) for r in pb_grpc.InferenceStub(ch).Generate(request, timeout=60)) == 3

        config = tmp_path / "gateway.json"
        config.write_text(json.dumps({
            "pools": [{"name": "p", "instances": [{"name": "tls0", "target": target}]}],
            "instance_tls": {"ca": pki["ca"], "cert": pki["cert"], "key": pki["key"]}}))
        gateway = Process("gateway", ["-m", "serving.gateway", f"--config={config}", "--host=127.0.0.1", "--port=0",
                                      "--metrics_port=-1", f"--jobs_db={tmp_path / 'jobs.db'}"], str(tmp_path))
        gateway.wait_ready(120)
        with Client(f"127.0.0.1:{gateway.info['port']}", timeout=120) as client:
            c = wait_for(lambda: _complete_once_routable(client), 120, interval=0.2, what="routed over mutual TLS")
        assert c.completion_tokens == 4
    finally:
        if gateway is not None:
            gateway.stop()
        instance.terminate()
