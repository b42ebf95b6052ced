"""Server flags: one per EngineConfig / ServerConfig field with the field's default, the rest listed as server-only;
a --flagfile becomes the engine and server configs; --kv_cache_memory_fraction is sized by the memory ledger and
refuses a fraction that holds no page; --dp refuses the layouts it does not combine with."""
import dataclasses
import subprocess
import sys

import pytest
from absl import app, flags

from serving.config_flags import flag_default, flag_fields
from serving.core.config import EngineConfig
from serving.server import __main__ as server_main
from serving.server.config import ServerConfig
from models.synthetic import shared_small_llama


def parse(*argv):
    fv = flags.FlagValues()
    server_main.define_flags(fv)
    fv(["serving.server", *argv])
    return fv


# Fields deliberately without a flag, and fields whose flag's default deliberately differs from the field's.
NOT_FLAGS = {"platform"}  # cross-lowering for another platform: a tool's setting (Engine.lower_programs), not a server's
OWN_FLAG_DEFAULTS = {}  # none: the command line listens on loopback too, as in-process servers do (docs/security.md)


def test_every_config_field_has_one_flag_with_its_default():
    fv = parse("--model=/m")
    fields = {f.name: f for cls in (EngineConfig, ServerConfig) for f in dataclasses.fields(cls)}
    assert len(fields) == len(dataclasses.fields(EngineConfig)) + len(dataclasses.fields(ServerConfig))  # no shared
    flagged = {f.name: f for cls in (EngineConfig, ServerConfig) for f in flag_fields(cls)}
    assert set(fields) - set(flagged) == NOT_FLAGS and not NOT_FLAGS & set(fv)
    for name, field in flagged.items():
        assert fv[name].help.endswith(field.metadata["help"]), name  # an enum's help starts with <its|values>
        assert getattr(fv[name].parser, "enum_values", None) == (list(field.metadata["choices"] or ()) or None)
        field_default = None if field.default is dataclasses.MISSING else field.default  # model: required
        shown = fv[name].default
        as_field = None if shown is not None and shown == field.metadata["none_as"] else shown
        if name in OWN_FLAG_DEFAULTS:
            assert (shown, flag_default(field)) == (OWN_FLAG_DEFAULTS[name],) * 2 and as_field != field_default
        else:
            assert as_field == field_default and type(as_field) is type(field_default), (name, shown, field_default)
    # The reverse: every flag is a field's or a server-only flag, never both.
    assert set(fv) == set(flagged) | set(server_main.SERVER_ONLY_FLAGS)
    assert not set(flagged) & set(server_main.SERVER_ONLY_FLAGS)
    # Flags left at their defaults build the dataclasses' defaults (0 -> None where the flag says "0: none").
    assert server_main.configs_from_flags(fv) == (EngineConfig("/m"), ServerConfig(**OWN_FLAG_DEFAULTS))


@pytest.mark.e2e
def test_help_defines_every_flag_without_importing_jax():
    """`python -m serving.server --help` lists the flags without importing JAX (seconds saved on every look at the
    flags): defining them reads only the configs and the JAX-free names they list (pallas_kernels.names)."""
    check = ("import sys\n"
             "from absl import flags\n"
             "from serving.server import __main__ as m\n"
             "fv = flags.FlagValues()\n"
             "m.define_flags(fv)\n"
             "assert 'jax' not in sys.modules, sorted(n for n in sys.modules if n.startswith(('jax', 'pallas', 'models')))\n"
             "print(len(list(fv)))\n")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    fv = flags.FlagValues()
    server_main.define_flags(fv)
    assert int(done.stdout.split()[-1]) == len(list(fv))


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
    assert server_config.http_port == -1 and server_config.served_model_name == ""  # HTTP off unless asked
    _, server_config = server_main.configs_from_flags(parse("--model=/m", "--http_port=0", "--served_model_name=m7"))
    assert (server_config.http_port, server_config.served_model_name) == (0, "m7")


def test_memory_fraction_is_sized_by_the_ledger():
    model = shared_small_llama()
    engine_config, _ = server_main.configs_from_flags(parse(f"--model={model}", "--kv_cache_memory_fraction=0.01",
                                                            "--page_size=16"))
    assert engine_config.num_pages > 100
    with pytest.raises(app.UsageError, match="kv_cache_memory_fraction"):
        server_main.configs_from_flags(parse(f"--model={model}", "--kv_cache_memory_fraction=1e-9"))


def test_memory_fraction_leaves_room_for_the_lm_head_screen(monkeypatch):
    """A single-device CPU engine builds the LM head's int8 screen: the fraction's KV pages are sized after it."""
    from pallas_kernels.matmul import head_screen_bytes
    from pallas_kernels import native
    from serving import ledger

    model = shared_small_llama()
    monkeypatch.setattr(ledger, "device_memory", lambda *a, **k: ledger.DeviceMemory(1 << 30, 1 << 30, "fixed"))
    args = (f"--model={model}", "--kv_cache_memory_fraction=0.01", "--page_size=16")
    native_here = native.unavailable_reason() is None
    assert server_main.screens_head(parse(*args)) is native_here
    assert not server_main.screens_head(parse(*args, "--nogreedy_head_screen"))
    assert not server_main.screens_head(parse(*args, "--tp=2"))
    with_screen = server_main.configs_from_flags(parse(*args))[0].num_pages
    without = server_main.configs_from_flags(parse(*args, "--nogreedy_head_screen"))[0].num_pages
    _, cfg = ledger.load_config(model=model)
    page = 16 * ledger.ModelMemory(cfg, "float32").stage_kv_bytes_per_token(ledger.Layout.of({}), 0)
    # The same budget less the screen's bytes: that many pages fewer, give or take the page the cut falls in.
    screen = head_screen_bytes(cfg.vocab_size, cfg.hidden_size) if native_here else 0
    assert without - with_screen in (screen // page, -(-screen // page)), (without, with_screen, screen, page)


def test_data_parallel_flags():
    engine_config, _ = server_main.configs_from_flags(parse("--model=/models/llama", "--dp=2", "--tp=2"))
    assert (engine_config.dp, engine_config.tp) == (2, 2)
    for other in ("--pp=2", "--speculative_method=ngram", "--num_processes=2"):
        with pytest.raises(app.UsageError, match="--dp=2 does not combine with"):
            server_main.configs_from_flags(parse("--model=/models/llama", "--dp=2", other))
    with pytest.raises(app.UsageError, match="--dp must be >= 1"):
        server_main.configs_from_flags(parse("--model=/models/llama", "--dp=0"))
