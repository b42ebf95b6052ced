"""The gateway routes LoRA adapters' requests by its instances' load reports: a real in-process gateway (gRPC and its
OpenAI HTTP API, driven by the `openai` package) in front of two small gRPC instances that report which adapters they
serve and hold in a slot. An adapter's requests land on the instance holding it (affinity), one no instance holds
goes where a slot is free; a tenant limited to named adapters is refused the others; an adapter no instance serves
is a 404 naming it. Then the gateway's own load / unload (vLLM's HTTP routes and the gRPC RPCs, admin key only) over
two real instance servers (`python -m serving.server --enable_lora`, a small Llama, random PEFT adapters): loaded on
both, PEFT's greedy tokens through the gateway, the instances' refusals passed through, reloaded on an instance that
lost it, unloaded everywhere."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
import yaml

from models.synthetic import shared_small_llama
from serving.gateway import lora as gateway_lora
from serving.gateway.routing import InstanceView, adapter_candidates
from serving.wire import meshserve_pb2 as pb
from serving.wire import meshserve_pb2_grpc as pb_grpc
from serving.process import ServerProcess
from serving.wire.client import Client, generate_request
from tests.serving.gateway.test_gateway_inprocess import FakeInstance
from tests.support import lora as peft_support
from tests.support.gateway import in_process_gateway
from tests.support.server import running

KEYS = {"limited": "limited-key-0123456789abcdef", "any": "any-key-0123456789abcdef-any"}
SERVED = ["chat", "code", "sql"]


class LoRAInstance(FakeInstance):
    """FakeInstance's tokens, reporting the adapters it serves, those in its slots, and its slot count."""

    def __init__(self, resident: list[str], max_loras: int):
        super().__init__()
        self.resident, self.max_loras = resident, max_loras

    async def WatchLoad(self, request, context):
        while True:
            yield pb.LoadReport(instance_id="fake", timestamp=time.time(), serving=True, max_num_seqs=8,
                                lora_adapters=SERVED, lora_resident=self.resident, max_loras=self.max_loras)
            await asyncio.sleep(0.05)


def test_adapter_candidates_prefer_resident_then_free_slot():
    def view(name, resident, max_loras, served=SERVED):
        return InstanceView(name, report=pb.LoadReport(lora_adapters=served, lora_resident=resident,
                                                       max_loras=max_loras))
    full, free, other = view("full", ["chat"], 1), view("free", ["sql"], 2), view("other", [], 4, served=["x"])
    assert [v.name for v in adapter_candidates([full, free, other], "chat")] == ["full"]
    assert [v.name for v in adapter_candidates([full, free, other], "code")] == ["free"]  # a free slot
    assert [v.name for v in adapter_candidates([full, view("f2", ["sql"], 1)], "code")] == ["full", "f2"]  # evicts
    assert adapter_candidates([full, free], "nope") == []


def test_gateway_routes_adapters_to_the_instance_holding_them(tmp_path):
    async def main():
        fakes, servers, ports = [], [], []
        for resident, max_loras in ((["sql"], 2), (["chat"], 1)):  # a: sql and a free slot; b: chat, full
            fake = LoRAInstance(resident, max_loras)
            server = grpc.aio.server()
            pb_grpc.add_InferenceServicer_to_server(fake, server)
            ports.append(server.add_insecure_port("127.0.0.1:0"))
            await server.start()
            fakes.append(fake)
            servers.append(server)
        path = tmp_path / "gw.yaml"
        path.write_text(yaml.safe_dump({
            "pools": [{"name": "p", "instances": [{"name": n, "target": f"127.0.0.1:{port}"}
                                                  for n, port in zip("ab", ports)]}],
            "tenants": [{"name": "limited", "api_keys": [KEYS["limited"]], "adapters": ["sql"]},
                        {"name": "any", "api_keys": [KEYS["any"]]}]}))
        try:
            async with in_process_gateway(path, tmp_path, lambda r: r.lora_adapters, 10) as (http_port, grpc_port):
                return await asyncio.to_thread(_drive, http_port, grpc_port), fakes
        finally:
            for s in servers:
                await s.stop(0)

    got, (a, b) = asyncio.run(main())
    # affinity: sql's and code's (a free slot) requests on a, chat's on b, each carrying its adapter
    assert sorted(r.sampling.adapter for r in a.requests) == ["code", "code", "sql", "sql", "sql"]
    assert [r.sampling.adapter for r in b.requests] == ["chat", "chat"]
    models = got["models"]
    assert models[0] == ("fake-model", None)
    assert sorted(models[1:]) == [(n, "fake-model") for n in SERVED]
    assert got["response_model"] == "sql"
    assert got["limited_chat"][0] == 403 and "'chat'" in got["limited_chat"][1] and "sql" in got["limited_chat"][1]
    assert got["unknown"][0] == 404 and "nope" in got["unknown"][1]
    assert got["grpc_unknown"] == (grpc.StatusCode.NOT_FOUND, True)


def _drive(http_port: int, grpc_port: int) -> dict:
    out = {}
    base = f"http://127.0.0.1:{http_port}/v1"
    with openai.OpenAI(base_url=base, api_key=KEYS["any"], max_retries=0, timeout=30) as any_, \
            openai.OpenAI(base_url=base, api_key=KEYS["limited"], max_retries=0, timeout=30) as limited:
        out["models"] = [(m.id, getattr(m, "parent", None)) for m in any_.models.list().data]
        for model in ("sql", "chat", "code", "chat", "code"):
            r = any_.completions.create(model=model, prompt=[5, 6], max_tokens=3)
            out.setdefault("response_model", r.model)
        limited.completions.create(model="sql", prompt=[5, 6], max_tokens=3)
        try:
            limited.completions.create(model="chat", prompt=[5, 6], max_tokens=3)
        except openai.APIStatusError as e:
            out["limited_chat"] = (e.status_code, e.message)
        try:
            any_.completions.create(model="nope", prompt=[5, 6], max_tokens=3)
        except openai.APIStatusError as e:
            out["unknown"] = (e.status_code, e.message)
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        stub = pb_grpc.InferenceStub(ch)
        list(stub.Generate(generate_request([5], max_tokens=3, adapter="sql"), timeout=10,
                           metadata=[("authorization", f"Bearer {KEYS['any']}")]))
        try:
            list(stub.Generate(generate_request([5], max_tokens=3, adapter="nope"), timeout=10,
                               metadata=[("authorization", f"Bearer {KEYS['any']}")]))
        except grpc.RpcError as e:
            out["grpc_unknown"] = (e.code(), "'nope'" in e.details())
    return out


# ---------------------------------------------------------------------------------------------- the gateway loads
GW_ADMIN = "gateway-admin-key-0123456789abcdef"
INSTANCE_ADMIN = "instance-admin-key-0123456789abcdef"
PROMPT, STEPS = [5, 17, 42, 99, 3, 64], 5
PEFT = {"sql": dict(r=8, alpha=16, targets=["q_proj", "v_proj", "down_proj"], seed=11),
        "big": dict(r=32, alpha=32, targets=["q_proj"], seed=13)}  # rank over --max_lora_rank: refused


def _post(port: int, path: str, body: dict, key: str) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.e2e
def test_gateway_loads_and_unloads_adapters_on_its_instances(tmp_path, monkeypatch):
    monkeypatch.setattr(gateway_lora, "RETRY_S", 0.2)
    model = shared_small_llama()
    root, outside = tmp_path / "root", tmp_path / "outside"
    dirs = {n: peft_support.save_peft_adapter(model, str(root / n), **cfg) for n, cfg in PEFT.items()}
    dirs["outside"] = peft_support.save_peft_adapter(model, str(outside / "sql"), **PEFT["sql"])
    keys = tmp_path / "instance_admin.keys"
    keys.write_text(INSTANCE_ADMIN + "\n")
    def instance(i: int) -> ServerProcess:  # test_lora_server.py's shapes: the suite's compilation cache has them
        return ServerProcess(model, str(tmp_path / f"run{i}"), "--enable_lora", "--max_loras=2", "--max_lora_rank=16",
                             f"--lora_root={root}", f"--admin_key_file={keys}")
    with running(instance(0)) as a, running(instance(1)) as b:  # one after the other: b compiles nothing
        cfg = tmp_path / "gw.yaml"
        cfg.write_text(yaml.safe_dump({
            "pools": [{"name": "p", "instances": [{"name": n, "target": p.target} for n, p in (("a", a), ("b", b))]}],
            "routing": {"load_interval_ms": 50}, "admin_keys": [GW_ADMIN], "instance_admin_key_file": str(keys),
            "tenants": [{"name": "any", "api_keys": [KEYS["any"]]}]}))

        async def main():
            async with in_process_gateway(cfg, tmp_path, lambda r: r.max_loras, 30,
                                          auth=True) as (http_port, grpc_port):
                return await asyncio.to_thread(_drive_loads, http_port, grpc_port, a, b, dirs)

        got = asyncio.run(main())
    reference = peft_support.greedy(peft_support.reference_model(model, dirs["sql"]), PROMPT, STEPS)
    assert got["tokens"] == reference


def _served(client: Client) -> list[str]:
    return list(client.get_load().lora_adapters)


def _drive_loads(http_port: int, grpc_port: int, a, b, dirs: dict) -> dict:
    out = {}
    admin = [("authorization", f"Bearer {INSTANCE_ADMIN}")]
    with Client(a.target, timeout=60) as ca, Client(b.target, timeout=60) as cb, \
            openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key=KEYS["any"], max_retries=0,
                          timeout=120) as oai, grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        body = {"lora_name": "sql", "lora_path": dirs["sql"]}
        # who may call: a tenant's key is not an admin key
        status, text = _post(http_port, "/v1/load_lora_adapter", body, KEYS["any"])
        assert status == 403 and "admin" in text, text
        # the instances' refusals, passed through with their status and message
        status, text = _post(http_port, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": dirs["outside"]},
                             GW_ADMIN)
        assert status == 403 and "--lora_root" in text, text
        status, text = _post(http_port, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": dirs["big"]},
                             GW_ADMIN)
        assert status == 400 and "32" in text and "16" in text, text
        assert _served(ca) == _served(cb) == []  # nothing left behind by the refused loads
        status, text = _post(http_port, "/v1/unload_lora_adapter", {"lora_name": "sql"}, GW_ADMIN)
        assert status == 404 and "'sql'" in text, text
        # loaded on both instances; requests for it through the gateway decode with it
        status, text = _post(http_port, "/v1/load_lora_adapter", body, GW_ADMIN)
        assert status == 200 and "sql" in text, text
        assert _served(ca) == _served(cb) == ["sql"]
        status, text = _post(http_port, "/v1/load_lora_adapter", body, GW_ADMIN)
        assert status == 400 and "already loaded" in text, text
        assert "sql" in [m.id for m in oai.models.list().data]
        r = oai.completions.create(model="sql", prompt=PROMPT, max_tokens=STEPS, temperature=0,
                                   extra_body={"ignore_eos": True})
        assert r.model == "sql" and r.choices[0].text == ca.complete(
            PROMPT, max_tokens=STEPS, temperature=0, ignore_eos=True, adapter="sql").text
        stub = pb_grpc.InferenceStub(ch)
        out["tokens"] = [t for resp in stub.Generate(
            generate_request(PROMPT, max_tokens=STEPS, temperature=0, ignore_eos=True, adapter="sql"), timeout=120,
            metadata=[("authorization", f"Bearer {KEYS['any']}")]) for t in resp.token_ids]
        # an instance that lost it (restarted, or unloaded there) gets it again from its load reports
        cb.unload_lora_adapter("sql", metadata=admin)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _served(cb) != ["sql"]:
            time.sleep(0.05)
        assert _served(cb) == ["sql"]
        # gRPC: admin key only; unload removes it everywhere, then it is unknown
        gw_admin = [("authorization", f"Bearer {GW_ADMIN}")]
        try:
            stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="sql"), timeout=30,
                                   metadata=[("authorization", f"Bearer {KEYS['any']}")])
            raise AssertionError("a tenant key unloaded an adapter")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.PERMISSION_DENIED
        stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="sql"), timeout=30, metadata=gw_admin)
        assert _served(ca) == _served(cb) == []
        try:
            oai.completions.create(model="sql", prompt=PROMPT, max_tokens=2)
            raise AssertionError("an unloaded adapter served")
        except openai.NotFoundError as e:
            assert "sql" in e.message
        resp = stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="sql2", lora_path=dirs["sql"]), timeout=60,
                                    metadata=gw_admin)
        assert resp.adapter.name == "sql2" and resp.adapter.rank == 8
        assert _served(ca) == _served(cb) == ["sql2"]
        try:
            stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="x", lora_path=dirs["outside"]), timeout=60,
                                 metadata=gw_admin)
            raise AssertionError("a path outside the instances' root loaded")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.PERMISSION_DENIED and "--lora_root" in e.details()
        for c in (ca, cb):
            load = c.get_load()
            assert load.num_running == load.num_waiting == 0
    return out
