"""Server flags: a --flagfile becomes the engine and server configs; --kv_cache_memory_fraction is sized by the
memory ledger and refuses a fraction that holds no page; --dp refuses the layouts it does not combine with."""
import pytest
from absl import app, flags

from serving.core.engine import EngineConfig
from serving.server import __main__ as server_main
from serving.server.testing import shared_test_model


def parse(*argv):
    fv = flags.FlagValues()
    server_main.define_flags(fv)
    fv(["serving.server", *argv])
    return fv


def test_flagfile_makes_the_configs(tmp_path):
    flagfile = tmp_path / "instance.flags"
    flagfile.write_text("--model=/models/llama\n--dtype=bfloat16\n--page_size=32\n--num_pages=1000\n"
                        "--max_num_seqs=8\n--max_num_batched_tokens=64\n--max_waiting_requests=7\n"
                        "--port=6000\n--metrics_port=-1\n--drain_grace_s=2.5\n--debug_step_delay_s=0.1\n"
                        "--log_format=json\n--max_prefill_chunk=0\n--tp=2\n--nogreedy_head_screen\n")
    engine_config, server_config = server_main.configs_from_flags(parse(f"--flagfile={flagfile}", "--port=6001"))
    assert (engine_config.model, engine_config.dtype, engine_config.page_size, engine_config.num_pages) == (
        "/models/llama", "bfloat16", 32, 1000)
    assert engine_config.max_num_seqs == 8 and engine_config.max_waiting_requests == 7
    assert engine_config.max_prefill_chunk is None and engine_config.debug_step_delay_s == 0.1
    assert engine_config.tp == 2 and engine_config.ep == 1
    assert engine_config.greedy_head_screen is False and EngineConfig("m").greedy_head_screen is True
    assert server_config.port == 6001 and server_config.metrics_port == -1 and server_config.drain_grace_s == 2.5


def test_memory_fraction_is_sized_by_the_ledger():
    model = shared_test_model()
    engine_config, _ = server_main.configs_from_flags(parse(f"--model={model}", "--kv_cache_memory_fraction=0.01",
                                                            "--page_size=16"))
    assert engine_config.num_pages > 100
    with pytest.raises(app.UsageError, match="kv_cache_memory_fraction"):
        server_main.configs_from_flags(parse(f"--model={model}", "--kv_cache_memory_fraction=1e-9"))


def test_data_parallel_flags():
    engine_config, _ = server_main.configs_from_flags(parse("--model=/models/llama", "--dp=2", "--tp=2"))
    assert (engine_config.dp, engine_config.tp) == (2, 2)
    for other in ("--pp=2", "--speculative_method=ngram", "--num_processes=2"):
        with pytest.raises(app.UsageError, match="--dp=2 does not combine with"):
            server_main.configs_from_flags(parse("--model=/models/llama", "--dp=2", other))
    with pytest.raises(app.UsageError, match="--dp must be >= 1"):
        server_main.configs_from_flags(parse("--model=/models/llama", "--dp=0"))
