"""The gRPC server on parallel layouts: --ep with expert-load metrics, --pp with the bubble fraction, --dp
replicas (and --dp x --tp) serving the dp=1 server's outputs."""
import asyncio
import time
import urllib.request

import pytest
import torch
import transformers as tf
from prometheus_client.parser import text_string_to_metric_families

from models.synthetic import make_test_tokenizer
from serving.wire.client import AsyncClient, Client
from models.synthetic import shared_small_llama
from serving.process import ServerProcess, cpu_xla_flags

pytestmark = pytest.mark.e2e


def _metrics(server) -> dict:
    text = urllib.request.urlopen(server.metrics_url, timeout=30).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def _model(path, config):
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    make_test_tokenizer(path, vocab_size=512)
    return path


COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=2)


def test_expert_parallel_server_exports_expert_load(tmp_path):
    model = _model(str(tmp_path / "moe"), tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2))
    server = ServerProcess(model, str(tmp_path / "srv"), "--ep=2", "--spare_expert_slots=2",
                           "--enable_prefix_caching=false", env={"XLA_FLAGS": cpu_xla_flags(2)})
    try:
        server.wait_ready(600)
        fed = 0
        with Client(server.target) as client:
            for prompt in ("def f(x):", "import os", "hello"):
                c = client.complete(prompt, max_tokens=5, temperature=0.0, ignore_eos=True)
                fed += c.prompt_tokens + c.completion_tokens - 1  # the last token is never fed back
        m = _metrics(server)
        per_slot = m["meshserve:expert_tokens"]
        assert {int(labels["slot"]) for labels, _ in per_slot} == set(range(6))
        assert sum(v for _, v in per_slot) == 2 * 2 * fed  # 2 MoE layers x top-2
        assert m["meshserve:expert_load_variance"][0][1] >= 0
    finally:
        server.terminate()


def test_pipeline_server_exports_bubble_fraction(tmp_path):
    model = _model(str(tmp_path / "dense"), tf.LlamaConfig(**COMMON))
    server = ServerProcess(model, str(tmp_path / "srv"), "--pp=2", "--micro_batches=2",
                           env={"XLA_FLAGS": cpu_xla_flags(2)})
    try:
        server.wait_ready(600)
        with Client(server.target) as client:
            c = client.complete("def main():", max_tokens=4, temperature=0.0, ignore_eos=True)
            assert c.completion_tokens == 4
        assert _metrics(server)["meshserve:pipeline_bubble_fraction"][0][1] == pytest.approx(1 / 3)
    finally:
        server.terminate()


EIGHT_DEVICES = {"XLA_FLAGS": cpu_xla_flags(8)}
# The dp=1 reference and the --dp=2 --tp=2 server compile on first use only what their requests run (a forward and a
# few sampling variants, not the warm-up's eleven programs per replica: on CPU the compilation cache keys on the
# devices, so each replica compiles its own); the --dp=2 --tp=1 server warms up, which keeps the data-parallel
# engine's warm-up (every replica's programs) under test (a tensor-parallel warm-up: test_multihost.py's server).
LAZY = "--warmup=false"
DP_PROMPTS = [[3 + (37 * i + 11 * j) % 500 for j in range(3 + 4 * i)] for i in range(8)]


def _serve_and_measure(server) -> dict:
    """Greedy and seeded completions sent concurrently, then a stream cancelled mid-way; once idle: the load
    report (books checked), the model info and the metrics."""
    async def main():
        async with AsyncClient(server.target, timeout=600) as c:
            outs = await asyncio.gather(*[
                c.complete(p, max_tokens=8, ignore_eos=True, **(dict(temperature=0.0) if i % 2 == 0 else
                                                                 dict(temperature=1.0, top_p=0.9, seed=i)))
                for i, p in enumerate(DP_PROMPTS)])
            stream = c.generate([5] * 9, max_tokens=400, ignore_eos=True, request_id="to-abort")
            async for _ in stream:
                break
            await stream.aclose()  # the client goes away: the server aborts it in its replica
            return [list(o.token_ids) for o in outs]

    tokens = asyncio.run(main())
    with Client(server.target, timeout=60) as client:
        deadline = time.monotonic() + 60
        while True:
            load = client.get_load(check_invariants=True)
            if (load.num_running == 0 and load.num_waiting == 0 and load.kv_pages_free == load.kv_pages_total) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        info = client.model_info()
    return dict(tokens=tokens, load=load, info=info, metrics=_metrics(server))


@pytest.fixture(scope="module")
def dp1_reference(tmp_path_factory):
    server = ServerProcess(shared_small_llama(), str(tmp_path_factory.mktemp("dp1")), LAZY, env=EIGHT_DEVICES)
    try:
        yield _serve_and_measure(server.wait_ready(600))
    finally:
        assert server.terminate() == 0, server.log()[-4000:]


@pytest.mark.parametrize("dp, tp", [(2, 1), (2, 2)])
def test_data_parallel_server(tmp_path, dp1_reference, dp, tp):
    """--dp replicas behind one gRPC server: the dp=1 server's outputs, requests spread over every replica,
    aborts reach the right replica, KV pages summed in the load report and none leaked once idle."""
    server = ServerProcess(shared_small_llama(), str(tmp_path / "srv"), f"--dp={dp}", f"--tp={tp}",
                           *([LAZY] if tp > 1 else []), env=EIGHT_DEVICES)
    try:
        got = _serve_and_measure(server.wait_ready(600))
        assert got["tokens"] == dp1_reference["tokens"]
        load, info, m = got["load"], got["info"], got["metrics"]
        assert load.invariant_error == ""
        assert load.num_running == 0 and load.num_waiting == 0
        assert load.kv_pages_total == info.num_pages == 512  # --num_pages=512, split over the replicas
        assert load.kv_pages_free == load.kv_pages_total, "KV pages leaked"
        assert load.max_num_seqs == dp * 32
        assert len(info.devices) == len(set(info.devices)) == dp * tp
        # Every device of every replica ran steps: the requests were spread over both replicas.
        steps = {labels["device"]: v for labels, v in m["meshserve:step_time_seconds_count"]}
        assert set(steps) == set(info.devices) and min(steps.values()) > 0, steps
        aborted = {labels["finished_reason"]: v for labels, v in m["meshserve:request_success_total"]}
        assert aborted["abort"] == 1 and aborted["length"] == len(DP_PROMPTS)
        assert m["meshserve:kv_cache_usage_perc"][0][1] == 0.0
        (cache_config, value), = m["meshserve:cache_config_info"]  # the instance's pages, over every replica
        assert (cache_config["block_size"], cache_config["num_gpu_blocks"], value) == ("8", "512", 1.0)
        assert dp1_reference["load"].kv_pages_total == 512
    finally:
        assert server.terminate() == 0, server.log()[-4000:]
