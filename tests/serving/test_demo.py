"""The README's main job, non-interactive: gateway + two instances on the embedded model, every request (five over
gRPC, one over the gateway's OpenAI HTTP API) completes with text, everything shuts down cleanly."""
import os
import re
import subprocess
import sys

import pytest

from serving.process import REPO_ROOT

pytestmark = pytest.mark.e2e


def test_demo_end_to_end(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-m", "serving.demo", "--max_tokens=8", f"--workdir={tmp_path}"],
                          cwd=REPO_ROOT, env={**env, "PYTHONPATH": REPO_ROOT}, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "6/6 requests completed with text" in out
    assert "=== OpenAI HTTP API through the gateway ===\ncurl http://127.0.0.1:" in out and "finish length" in out
    assert "shut down: exit codes {'gateway': 0, 'instance1': 0, 'instance0': 0}" in out
    assert len(re.findall(r"--- [1-8] tokens, TTFT \d+ ms", out)) == 5
