"""Helpers for the gateway tests and benchmark-style checks: instance processes with a run-time step delay (see
tests/support/gateway_instance.py), a `python -m serving.gateway` process, and its clients."""
from __future__ import annotations

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
        with open(self.delay_file, "w") as f:
            f.write("0")
        super().__init__(model_dir, workdir, "--metrics_port=-1", *flags, module="tests.support.gateway_instance",
                         env={"MESHSERVE_DEBUG_STEP_DELAY_FILE": self.delay_file, **(env or {})})

    def set_delay(self, seconds: float) -> None:
        """Returns once the instance has re-read the delay (it polls every 0.1 s): until then its steps run at
        full speed, milliseconds each, which can finish work a test meant to be slow."""
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
