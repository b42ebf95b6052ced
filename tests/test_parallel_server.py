"""The gRPC server on parallel layouts: --ep with expert-load metrics, --pp with the bubble fraction."""
import urllib.request

import pytest
import torch
import transformers as tf
from prometheus_client.parser import text_string_to_metric_families

from models.testing import make_test_tokenizer
from serving.server.client import Client
from serving.server.testing import ServerProcess


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
                           "--enable_prefix_caching=false", env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
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
                           env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    try:
        server.wait_ready(600)
        with Client(server.target) as client:
            c = client.complete("def main():", max_tokens=4, temperature=0.0, ignore_eos=True)
            assert c.completion_tokens == 4
        assert _metrics(server)["meshserve:pipeline_bubble_fraction"][0][1] == pytest.approx(1 / 3)
    finally:
        server.terminate()
