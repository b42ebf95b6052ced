"""A child process (instance server or gateway) that reports readiness by writing a ready file: JSON with the
ports it bound. Used by the demo, the benchmarks and the tests to start, wait for, query and stop them."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ReadyFileProcess:
    """`python <args> --ready_file=<workdir>/<name>.ready.json`, its output in <workdir>/<name>.log.

    `start()` (again after `stop()` for a restart) launches it; `wait_ready()` returns once the ready file
    exists, with `info` (the file's JSON), `port` and `metrics_port` set, and raises with the log's tail if the
    process exits first or the timeout passes."""

    def __init__(self, name: str, args: list[str], workdir: str, *, env: dict | None = None,
                 ready_timeout_s: float = 300.0):
        os.makedirs(workdir, exist_ok=True)
        self.name, self.args, self.workdir = name, list(args), workdir
        self.ready_file = os.path.join(workdir, f"{name}.ready.json")
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.env = {**os.environ, "PYTHONPATH": REPO_ROOT, **(env or {})}
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.info: dict = {}
        self.port = self.metrics_port = 0

    def start(self) -> "ReadyFileProcess":
        if os.path.exists(self.ready_file):  # from an earlier run in the same workdir
            os.remove(self.ready_file)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, *self.args, f"--ready_file={self.ready_file}"], cwd=REPO_ROOT,
                                     env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout: float | None = None) -> "ReadyFileProcess":
        timeout = self.ready_timeout_s if timeout is None else timeout
        t0 = time.monotonic()
        while not os.path.exists(self.ready_file):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} (log {self.log_path}):\n"
                                   f"{self.log()[-4000:]}")
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{self.name} not ready after {timeout}s (log {self.log_path}):\n"
                                   f"{self.log()[-4000:]}")
            time.sleep(0.05)
        with open(self.ready_file) as f:
            self.info = json.load(f)
        self.port, self.metrics_port = self.info.get("port", 0), self.info.get("metrics_port", 0)
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log(self) -> str:
        if self._log is not None and not self._log.closed:
            self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self, kill: bool = False, timeout: float = 60.0) -> int:
        """SIGTERM (SIGKILL with `kill`) and wait; a process still running after `timeout` is killed. Returns the
        exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self._log.close()


def cpu_xla_flags(devices: int) -> str:
    """XLA_FLAGS for a child process on `devices` CPU devices, keeping this process's other XLA flags (a test run's
    cheaper compiles, tests/conftest.py)."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([f"--xla_force_host_platform_device_count={devices}", *kept])


# Small engine settings that start fast: one token bucket of 32, so warm-up compiles 9 programs.
SMALL_ENGINE_FLAGS = ("--page_size=8", "--num_pages=512", "--max_num_seqs=32", "--max_num_batched_tokens=32",
                      "--min_token_bucket=32")


class ServerProcess(ReadyFileProcess):
    """`python -m serving.server` on 127.0.0.1 with the small engine settings (and `flags`), one CPU device unless
    `env` says otherwise; started at construction."""

    def __init__(self, model_dir: str, workdir: str, *flags: str, env: dict | None = None,
                 module: str = "serving.server"):
        args = ["-m", module, f"--model={model_dir}", "--host=127.0.0.1", "--port=0", "--metrics_port=0",
                *SMALL_ENGINE_FLAGS, *flags]
        super().__init__("server", args, workdir, env={"JAX_PLATFORMS": "cpu",
                                                       "XLA_FLAGS": cpu_xla_flags(1),
                                                       **(env or {})})
        self.start()

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit code (killed after `timeout`)."""
        return self.stop(timeout=timeout)


def start_process(name: str, args: list[str], workdir: str) -> ReadyFileProcess:
    """A started child process (`python <args>`) that writes <workdir>/<name>.ready.json when it serves."""
    return ReadyFileProcess(name, args, workdir, env={"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")},
                            ready_timeout_s=600.0).start()
