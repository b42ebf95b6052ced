"""Helpers for the gateway tests and benchmark-style checks: instance processes with a run-time step delay (see
tests/support/gateway_instance.py), a `python -m serving.gateway` process, an in-process gateway, and clients."""
from __future__ import annotations

import asyncio
import contextlib
import os
import time

import grpc
import yaml

from serving.gateway.proto import gateway_pb2 as gpb
from serving.gateway.proto import gateway_pb2_grpc as gpb_grpc
from serving.process import ReadyFileProcess
from serving.process import ServerProcess


class InstanceProcess(ServerProcess):
    """ServerProcess started through tests.support.gateway_instance: `set_delay(s)` slows every step at run time;
    `env` adds environment variables (e.g. MESHSERVE_DEBUG_PULL_CHUNK_DELAY_S, test-only: see gateway_instance)."""

    def __init__(self, model_dir: str, workdir: str, *flags: str, env: dict | None = None):
        os.makedirs(workdir, exist_ok=True)
        self.delay_file = os.path.join(workdir, "step_delay")
        self.delay = 0.0
        with open(self.delay_file, "w") as f:
            f.write("0")
        super().__init__(model_dir, workdir, "--metrics_port=-1", *flags, module="tests.support.gateway_instance",
                         env={"MESHSERVE_DEBUG_STEP_DELAY_FILE": self.delay_file, **(env or {})})

    def set_delay(self, seconds: float) -> None:
        """Returns once the instance has re-read the delay (it polls every 0.1 s): until then its steps run at
        full speed, milliseconds each, which can finish work a test meant to be slow. The delay it already has
        returns at once (the tests reset every instance's to 0 after each test)."""
        if seconds == self.delay:
            return
        self.delay = seconds
        tmp = self.delay_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(seconds))
        os.replace(tmp, self.delay_file)
        time.sleep(0.25)


def write_config(path: str, config: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump(config, f)
    os.replace(tmp, path)


class GatewayProcess(ReadyFileProcess):
    """`python -m serving.gateway` (or `module`, a wrapper of it) on 127.0.0.1 with `config` (written to
    <workdir>/gateway.yaml); started and waited for at construction; `start()` again after `stop()` restarts it on the
    same config and jobs db."""

    def __init__(self, workdir: str, config: dict | None = None, *flags: str, jobs_db: str = "",
                 module: str = "serving.gateway"):
        os.makedirs(workdir, exist_ok=True)
        self.config_path = os.path.join(workdir, "gateway.yaml")
        if config is not None:
            write_config(self.config_path, config)
        self.jobs_db = jobs_db or os.path.join(workdir, "jobs.sqlite")
        super().__init__("gateway", ["-m", module, f"--config={self.config_path}", "--host=127.0.0.1",
                                     "--port=0", "--metrics_port=0", f"--jobs_db={self.jobs_db}", "--drain_grace_s=5",
                                     *flags], workdir, ready_timeout_s=60.0)
        self.start()

    def start(self) -> "GatewayProcess":
        super().start()
        return self.wait_ready()

    def admin(self, key: str = ""):
        channel = grpc.insecure_channel(self.target)
        return channel, gpb_grpc.GatewayAdminStub(channel), [("authorization", f"Bearer {key}")] if key else []

    def instances(self, key: str = "") -> dict[str, gpb.InstanceStatus]:
        channel, stub, md = self.admin(key)
        try:
            listed = stub.ListInstances(gpb.ListInstancesRequest(), metadata=md, timeout=10)
            return {i.name: i for i in listed.instances}
        finally:
            channel.close()


def wait_for(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached in {timeout}s")


@contextlib.asynccontextmanager
async def in_process_gateway(config, tmp_path, ready, timeout_s: float, auth: bool = False):
    """An in-process gateway (gRPC, with its auth interceptor if `auth`, and HTTP) on 127.0.0.1 for the config file
    `config`, yielded as (http port, grpc port) once every instance's load report satisfies `ready` (or after
    `timeout_s`)."""
    from serving.gateway.app import Gateway
    from serving.gateway.http import GatewayHTTP
    from serving.gateway.security import GatewayAuthInterceptor
    from serving.gateway.service import InferenceServicer
    from serving.wire import meshserve_pb2_grpc as pb_grpc
    gw = Gateway(str(config), str(tmp_path / "jobs.sqlite"))
    await gw.start()
    grpc_server = grpc.aio.server(interceptors=[GatewayAuthInterceptor(gw.auth)] if auth else None)
    pb_grpc.add_InferenceServicer_to_server(InferenceServicer(gw), grpc_server)
    grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()
    api = GatewayHTTP(gw)
    http_port = await api.start("127.0.0.1", 0)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not (gw.model_name and all(
                i.report is not None and ready(i.report) for i in gw.pools.instances.values())):
            await asyncio.sleep(0.05)
        yield http_port, grpc_port
    finally:
        await api.stop()
        await grpc_server.stop(0)
        await gw.stop()


def through_gateway(targets: list[str], tmp_path, drive, timeout_s: float = 60.0):
    """`drive(http_port, grpc_port)` (run in a thread) against an in-process gateway with one pool of the instances
    at `targets`, once each has sent a load report; returns what it returns."""
    config = tmp_path / "gateway.yaml"
    write_config(str(config), {"pools": [{"name": "p", "instances": [
        {"name": f"i{k}", "target": t} for k, t in enumerate(targets)]}]})

    async def main():
        async with in_process_gateway(config, tmp_path, lambda report: True, timeout_s) as ports:
            return await asyncio.to_thread(drive, *ports)
    return asyncio.run(main())


def greedy_through_gateway(target: str, tmp_path, model: str, prompt: list[int], max_tokens: int):
    """The greedy completion of token-id `prompt` through an in-process gateway in front of the instance at
    `target`, over gRPC (its token ids) and the `openai` package (its text)."""
    import openai

    from serving.wire.client import Client

    def drive(http_port, grpc_port):
        with Client(f"127.0.0.1:{grpc_port}", timeout=120) as client:
            tokens = client.complete(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True).token_ids
        with openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0,
                           timeout=120) as oai:
            done = oai.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          extra_body={"ignore_eos": True})
        return list(tokens), done.choices[0].text
    return through_gateway([target], tmp_path, drive)
