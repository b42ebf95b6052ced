"""The gateway routes LoRA adapters' requests by its instances' load reports: a real in-process gateway (gRPC and its
OpenAI HTTP API, driven by the `openai` package) in front of two small gRPC instances that report which adapters they
serve and hold in a slot. An adapter's requests land on the instance holding it (affinity), one no instance holds
goes where a slot is free; a tenant limited to named adapters is refused the others; an adapter no instance serves
is a 404 naming it."""
from __future__ import annotations

import asyncio
import time

import grpc
import openai
import yaml

from serving.gateway.app import Gateway
from serving.gateway.http import GatewayHTTP
from serving.gateway.routing import InstanceView, adapter_candidates
from serving.gateway.service import InferenceServicer
from serving.wire import meshserve_pb2 as pb
from serving.wire import meshserve_pb2_grpc as pb_grpc
from serving.wire.client import generate_request
from tests.serving.gateway.test_gateway_inprocess import FakeInstance

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
        gw = Gateway(str(path), str(tmp_path / "jobs.sqlite"))
        await gw.start()
        grpc_server = grpc.aio.server()
        pb_grpc.add_InferenceServicer_to_server(InferenceServicer(gw), grpc_server)
        grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        api = GatewayHTTP(gw)
        http_port = await api.start("127.0.0.1", 0)
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not (gw.model_name and all(
                    i.report is not None and i.report.lora_adapters for i in gw.pools.instances.values())):
                await asyncio.sleep(0.05)
            return await asyncio.to_thread(_drive, http_port, grpc_port), fakes
        finally:
            await api.stop()
            await grpc_server.stop(0)
            await gw.stop()
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
