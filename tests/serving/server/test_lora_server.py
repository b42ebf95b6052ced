"""LoRA adapters through a real instance server (`python -m serving.server --enable_lora` on 127.0.0.1, a small Llama,
random PEFT adapters): OpenAI `model` = an adapter's name (the `openai` package) and gRPC
`SamplingParameters.adapter` give HF transformers + PEFT's greedy tokens; `/v1/models` lists the adapters with their
parent; an unknown adapter is a 404 / NOT_FOUND naming it; adapters load and unload at run time over HTTP (vLLM's
routes) and gRPC, with the admin key only, from under --lora_root only, a mismatched one refused naming why; the
`meshserve:lora_requests_info` metric and the load report carry the adapters."""
import json
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from models.synthetic import shared_small_llama
from serving.process import ServerProcess
from serving.wire.client import Client, ClientError
from tests.support import lora as peft_support
from tests.support.server import running

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"
ADMIN_KEY = "admin-key-0123456789abcdef"
PROMPT = [5, 17, 42, 99, 3, 64]
STEPS = 6
ADAPTERS = {  # name -> PEFT LoraConfig (random A and B)
    "sql": dict(r=8, alpha=16, targets=["q_proj", "v_proj", "down_proj"], seed=11),
    "chat": dict(r=4, alpha=12, targets=["k_proj", "o_proj", "up_proj"], seed=12),
    "big": dict(r=32, alpha=32, targets=["q_proj"], seed=13),  # rank over --max_lora_rank: refused
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = shared_small_llama()
    root = tmp_path_factory.mktemp("lora_root")
    outside = tmp_path_factory.mktemp("lora_outside")
    dirs = {n: peft_support.save_peft_adapter(model, str(root / n), **cfg) for n, cfg in ADAPTERS.items()}
    dirs["outside"] = peft_support.save_peft_adapter(model, str(outside / "chat"), **ADAPTERS["chat"])
    key_file = tmp_path_factory.mktemp("keys") / "admin.keys"
    key_file.write_text(ADMIN_KEY + "\n")
    return model, str(root), dirs, str(key_file)


@pytest.fixture(scope="module")
def server(setup, tmp_path_factory):
    model, root, dirs, key_file = setup
    with running(ServerProcess(model, str(tmp_path_factory.mktemp("lora_run")), "--http_port=0",
                               f"--served_model_name={MODEL}", "--enable_lora", "--max_loras=2",
                               "--max_lora_rank=16", f"--lora_modules=sql={dirs['sql']}", f"--lora_root={root}",
                               f"--admin_key_file={key_file}")) as proc:
        yield proc


@pytest.fixture(scope="module")
def reference(setup):
    """HF + PEFT's greedy tokens of PROMPT, per adapter (None: the base model)."""
    model, _, dirs, _ = setup
    return lambda name: peft_support.greedy(peft_support.reference_model(model, name and dirs[name]), PROMPT, STEPS)


def _post(port: int, path: str, body: dict, key: str | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _idle(client: Client, timeout: float = 30.0):
    """The load report once nothing runs or waits (GetLoad's invariant scan is an admin call here): every KV page
    free again, or the last report after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        load = client.get_load()
        if (load.num_running == load.num_waiting == 0 and load.kv_pages_free == load.kv_pages_total) \
                or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


def _lora_info(server) -> list[dict]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        text = r.read().decode()
    return [s.labels for f in text_string_to_metric_families(text) if f.name == "meshserve:lora_requests_info"
            for s in f.samples]


def test_requests_name_adapters_over_http_and_grpc(server, reference):
    port = server.info["http_port"]
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120) as oai, \
            Client(server.target, timeout=120) as client:
        models = oai.models.list().data
        assert [(m.id, getattr(m, "parent", None)) for m in models] == [(MODEL, None), ("sql", MODEL)]
        sql = client.complete(PROMPT, max_tokens=STEPS, temperature=0, ignore_eos=True, adapter="sql")
        base = client.complete(PROMPT, max_tokens=STEPS, temperature=0, ignore_eos=True)
        assert list(sql.token_ids) == reference("sql")
        assert list(base.token_ids) == reference(None)
        r = oai.completions.create(model="sql", prompt=PROMPT, max_tokens=STEPS, temperature=0,
                                   extra_body={"ignore_eos": True})
        assert r.model == "sql" and r.choices[0].text == sql.text
        with pytest.raises(openai.NotFoundError, match="nope"):
            oai.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
        with pytest.raises(ClientError) as e:
            client.complete(PROMPT, max_tokens=2, adapter="nope")
        assert e.value.code == grpc.StatusCode.NOT_FOUND and "'nope'" in e.value.details
        info = client.model_info()
        assert [a.name for a in info.lora_adapters] == ["sql"] and info.max_loras == 2
        load = _idle(client)
        assert list(load.lora_adapters) == ["sql"] and load.max_loras == 2
        assert load.kv_pages_free == load.kv_pages_total  # nothing leaked
    assert {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "2"} in _lora_info(server)


def test_load_and_unload_at_run_time_over_http(server, setup, reference):
    _, _, dirs, _ = setup
    port = server.info["http_port"]
    body = {"lora_name": "chat", "lora_path": dirs["chat"]}
    status, text = _post(port, "/v1/load_lora_adapter", body)
    assert status == 401, text  # no key: refused before the body is read
    status, text = _post(port, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": dirs["outside"]}, ADMIN_KEY)
    assert status == 403 and "--lora_root" in text
    status, text = _post(port, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": dirs["big"]}, ADMIN_KEY)
    assert status == 400 and "32" in text and "16" in text, text  # its rank over --max_lora_rank, named
    status, text = _post(port, "/v1/load_lora_adapter", body, ADMIN_KEY)
    assert status == 200 and "chat" in text
    status, text = _post(port, "/v1/load_lora_adapter", body, ADMIN_KEY)
    assert status == 400 and "chat" in text  # the name is taken
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120) as oai, \
            Client(server.target, timeout=120) as client:
        assert client.complete(PROMPT, max_tokens=STEPS, temperature=0, ignore_eos=True,
                               adapter="chat").token_ids == reference("chat")
        assert "chat" in [m.id for m in oai.models.list().data]
        status, text = _post(port, "/v1/unload_lora_adapter", {"lora_name": "chat"}, ADMIN_KEY)
        assert status == 200, text
        with pytest.raises(openai.NotFoundError, match="chat"):
            oai.completions.create(model="chat", prompt=PROMPT, max_tokens=2)
        status, text = _post(port, "/v1/unload_lora_adapter", {"lora_name": "chat"}, ADMIN_KEY)
        assert status == 404 and "chat" in text
        load = _idle(client)
        assert load.kv_pages_free == load.kv_pages_total


def test_load_and_unload_over_grpc_need_the_admin_key(server, setup, reference):
    _, _, dirs, _ = setup
    admin = [("authorization", f"Bearer {ADMIN_KEY}")]
    with Client(server.target, timeout=120) as client:
        with pytest.raises(ClientError) as e:
            client.load_lora_adapter("chat2", dirs["chat"])
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        resp = client.load_lora_adapter("chat2", dirs["chat"], metadata=admin)
        assert resp.adapter.name == "chat2" and resp.adapter.rank == 4
        assert client.complete(PROMPT, max_tokens=STEPS, temperature=0, ignore_eos=True,
                               adapter="chat2").token_ids == reference("chat")
        assert client.unload_lora_adapter("chat2", metadata=admin).adapter.name == "chat2"
        with pytest.raises(ClientError) as e:
            client.unload_lora_adapter("chat2", metadata=admin)
        assert e.value.code == grpc.StatusCode.NOT_FOUND and "chat2" in e.value.details
        with pytest.raises(ClientError) as e:
            client.complete(PROMPT, max_tokens=2, adapter="chat2")
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        load = _idle(client)
        assert load.kv_pages_free == load.kv_pages_total
