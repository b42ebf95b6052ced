"""Helpers for tests that drive an instance server through the client library."""
import contextlib
import time

from serving.wire.client import Client


def wait_idle(client: Client, timeout: float = 10.0):
    """The load report once nothing runs or waits; its books checked (no page leaked)."""
    t0 = time.monotonic()
    while True:
        load = client.get_load(check_invariants=True)
        if (load.num_running == 0 and load.num_waiting == 0 and load.kv_pages_free == load.kv_pages_total) \
                or time.monotonic() - t0 > timeout:
            return load
        time.sleep(0.05)


@contextlib.contextmanager
def running(proc):
    """A started ServerProcess, ready; on exit SIGTERM, and its exit code must be 0 (the log's tail if not)."""
    try:
        yield proc.wait_ready()
    finally:
        rc = proc.terminate()
        assert rc == 0, f"the server exited with {rc}:\n{proc.log()[-4000:]}"
