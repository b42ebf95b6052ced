"""A server with --quantization=int8 --kv_cache_dtype=int8 (the shipped tiny model): ModelInfo and the metrics say
what is in use, it answers with the offline engine's tokens under the same settings, and a bad flag is refused at
start with the allowed values named."""
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.core.llm import LLM
from serving.core.sampling_params import SamplingParams
from serving.process import REPO_ROOT, SMALL_ENGINE_FLAGS, ServerProcess
from serving.wire.client import Client
from tests.support.tiny import model_dir

pytestmark = pytest.mark.e2e

PROMPTS = ["def main(argv):\n", "import os\n\nclass Config:\n"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(model_dir("target"), str(tmp_path_factory.mktemp("quant_server")), "--quantization=int8",
                         "--kv_cache_dtype=int8")
    try:
        yield proc.wait_ready()
    finally:
        assert proc.terminate() == 0, proc.log()[-4000:]


def test_quantized_server_reports_and_serves_the_offline_engines_tokens(server):
    with Client(server.target, timeout=120) as client:
        info = client.model_info()
        assert (info.quantization, info.kv_cache_dtype) == ("int8", "int8")
        got = [client.complete(p, max_tokens=16, temperature=0.0, ignore_eos=True).token_ids for p in PROMPTS]
    flags = dict(f.lstrip("-").split("=") for f in SMALL_ENGINE_FLAGS)
    # no warm-up: the two greedy requests compile only the programs they run (the same programs' results)
    llm = LLM(model_dir("target"), warmup=False, quantization="int8", kv_cache_dtype="int8",
              page_size=int(flags["page_size"]), num_pages=int(flags["num_pages"]),
              max_num_seqs=int(flags["max_num_seqs"]),
              max_num_batched_tokens=int(flags["max_num_batched_tokens"]),
              min_token_bucket=int(flags["min_token_bucket"]))
    want = [list(o.token_ids) for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16,
                                                                          ignore_eos=True))]
    assert [list(t) for t in got] == want
    families = {f.name: f for f in text_string_to_metric_families(
        urllib.request.urlopen(server.metrics_url, timeout=10).read().decode())}
    (cache,) = families["meshserve:cache_config_info"].samples
    (model,) = families["meshserve:model_config_info"].samples
    assert cache.labels["cache_dtype"] == "int8" and model.labels["quantization"] == "int8"


def test_unknown_quantization_flag_is_refused_with_the_choices():
    proc = subprocess.run([sys.executable, "-m", "serving.server", f"--model={model_dir('target')}",
                           "--quantization=int4"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--quantization" in proc.stderr and "int8" in proc.stderr and "fp8" in proc.stderr
