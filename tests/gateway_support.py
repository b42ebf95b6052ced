"""Helpers for the gateway tests and benchmark-style checks: instance processes with a run-time step delay (see
tests/gateway_instance.py), a `python -m serving.gateway` process, and its clients."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc
import yaml

from serving.gateway.proto import gateway_pb2 as gpb
from serving.gateway.proto import gateway_pb2_grpc as gpb_grpc
from serving.server.testing import COMPILATION_CACHE_DIR, REPO_ROOT, SMALL_ENGINE_FLAGS, ServerProcess


class InstanceProcess(ServerProcess):
    """ServerProcess started through tests.gateway_instance: `set_delay(s)` slows every step at run time."""

    def __init__(self, model_dir: str, workdir: str, *flags: str):
        os.makedirs(workdir, exist_ok=True)
        self.delay_file = os.path.join(workdir, "step_delay")
        with open(self.delay_file, "w") as f:
            f.write("0")
        self.ready_file = os.path.join(workdir, "ready.json")
        if os.path.exists(self.ready_file):
            os.remove(self.ready_file)
        self.log_path = os.path.join(workdir, "server.log")
        args = [sys.executable, "-m", "tests.gateway_instance", f"--model={model_dir}", "--host=127.0.0.1",
                "--port=0", "--metrics_port=-1", f"--ready_file={self.ready_file}",
                f"--compilation_cache_dir={COMPILATION_CACHE_DIR}", *SMALL_ENGINE_FLAGS, *flags]
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO_ROOT,
               "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
               "MESHSERVE_DEBUG_STEP_DELAY_FILE": self.delay_file}
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.port = self.metrics_port = 0

    def set_delay(self, seconds: float) -> None:
        tmp = self.delay_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(seconds))
        os.replace(tmp, self.delay_file)


def write_config(path: str, config: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump(config, f)
    os.replace(tmp, path)


class GatewayProcess:
    def __init__(self, workdir: str, config: dict | None = None, *flags: str, jobs_db: str = ""):
        os.makedirs(workdir, exist_ok=True)
        self.workdir = workdir
        self.config_path = os.path.join(workdir, "gateway.yaml")
        if config is not None:
            write_config(self.config_path, config)
        self.ready_file = os.path.join(workdir, "gateway-ready.json")
        self.jobs_db = jobs_db or os.path.join(workdir, "jobs.sqlite")
        self.flags = flags
        self.proc = None
        self.port = 0
        self.start()

    def start(self) -> "GatewayProcess":
        if os.path.exists(self.ready_file):
            os.remove(self.ready_file)
        self.log_path = os.path.join(self.workdir, "gateway.log")
        self._log = open(self.log_path, "ab")
        args = [sys.executable, "-m", "serving.gateway", f"--config={self.config_path}", "--host=127.0.0.1",
                "--port=0", "--metrics_port=0", f"--jobs_db={self.jobs_db}", f"--ready_file={self.ready_file}",
                "--drain_grace_s=5", *self.flags]
        self.proc = subprocess.Popen(args, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT},
                                     stdout=self._log, stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        while not os.path.exists(self.ready_file):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the gateway exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            if time.monotonic() - t0 > 60:
                raise TimeoutError(f"the gateway did not start:\n{self.log()[-4000:]}")
            time.sleep(0.05)
        info = json.load(open(self.ready_file))
        self.port, self.metrics_port = info["port"], info["metrics_port"]
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self, kill: bool = False, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self._log.close()

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
