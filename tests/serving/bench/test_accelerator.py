"""The accelerator acceptance command (serving/bench/accelerator.py): its smoke mode passes every stage on this CPU
in a process that sees only the device image's packages (an import hook refuses the others; the greedy parity's CPU
side in a subprocess, as on an accelerator host), writing every figure to its JSON; the structured stage in-process;
a broken check or a raising stage is a FAIL line, the run goes on and exits non-zero; the time budgets cut a stage at
its checkpoints, leave later stages unstarted and, at the run's end, the watchdog writes the report; JAX's GPU paged
attention agrees with ours on the converted KV layout (interpret mode); and every program the command times lowers
for cuda and tpu from this host."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers as tf

import jax_compat
import pallas_kernels
from pallas_kernels import reference
from pallas_kernels.target import lowering_platform, tracing_for
from serving.bench import accelerator, accelerator_run
from serving.core.config import EngineConfig
from serving.core.engine import Engine
from serving.core.model_runner import Program
from tests.support import device_image, hf_models

REPO_ROOT = accelerator.REPO_ROOT


def _lines(capsys) -> list[str]:
    return capsys.readouterr().out.splitlines()


# Runtime dependencies the device image lacks, imported only by the server and API layers: the acceptance path must
# not import them (the hook logs any attempt).
SERVER_ONLY = ("fastapi", "starlette", "pydantic", "uvicorn", "httptools", "llguidance", "opentelemetry", "grpc_health")


@pytest.mark.e2e
def test_smoke_run_on_the_device_image(tmp_path):
    """`python -m serving.bench accelerator --smoke --parity_subprocess` in a process (and its CPU subprocess: the
    path an accelerator host's greedy parity takes) whose import hook refuses every installed package the device
    image lacks: every stage passes but structured, which skips naming llguidance; nothing of the server layers is
    imported; accelerator.json holds every stage's figures."""
    refused = device_image.write_refusing_hook(tmp_path / "hook")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path / "hook"), REPO_ROOT,
                                                                     os.environ.get("PYTHONPATH")])))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "serving.bench", "accelerator", "--smoke", f"--out={out}",
                           f"--workdir={tmp_path / 'models'}", "--parity_subprocess"], capture_output=True, text=True,
                          cwd=REPO_ROOT, env=env, timeout=900)
    lines = proc.stdout.splitlines()
    results = [line for line in lines if line.split(" ")[0] in ("PASS", "FAIL", "SKIP", "TIMEOUT", "NOT", "KILLED")]
    assert proc.returncode == 0, "\n".join(results) + "\n" + proc.stderr[-2000:]
    for stage in accelerator.STAGES:
        word = "SKIP" if stage == "structured" else "PASS"
        assert sum(line.startswith(f"{word} {stage}: ") for line in lines) == 1, (stage, proc.stdout[-3000:])
    assert any(line.startswith("SKIP structured: llguidance is not installed") for line in lines)
    assert lines[-1].startswith(f"accelerator acceptance: {len(accelerator.STAGES) - 1} passed, 0 failed, 1 skipped")
    parity = next(line for line in lines if line.startswith("PASS greedy_parity: "))
    assert "vs CPU subprocess" in parity, parity
    bandwidth = next(line for line in lines if line.startswith("PASS attention_bandwidth: "))
    assert "skipped in smoke mode" in bandwidth
    log = [json.loads(line) for line in refused.read_text().splitlines()]
    assert any(e[1:] == ["probe", "llguidance", "llguidance"] for e in log), log  # the hook was in force
    imported = sorted({e[2] for e in log if e[1] == "import" and e[2].split(".")[0] in SERVER_ONLY})
    assert not imported, f"the acceptance path imported {imported}, which the device image lacks"
    report = json.loads((out / "accelerator.json").read_text())
    assert report["meta"]["smoke"] and report["summary"] == lines[-1]
    stages = report["stages"]
    assert {k: v["status"] for k, v in stages.items()} == {s: "skip" if s == "structured" else "pass"
                                                           for s in accelerator.STAGES}
    figures = {k: v["figures"] for k, v in stages.items()}
    assert figures["environment"]["packages"]["jax"] == jax.__version__
    assert figures["attention"] and all(f["within_tolerance"] for f in figures["attention"].values())
    for stage, label in (("decode_roofline", "bf16"), ("moe", "moe"), ("quantized", "int8")):
        for batch in accelerator.SMOKE.decode_batches:
            assert figures[stage][f"{label}_b{batch}"]["step_ms"] > 0, (stage, batch)
    assert figures["greedy_parity"]["agreeing_prefix"]["per_prompt"] == [accelerator.SMOKE.parity_tokens] * 4
    assert (out / "accelerator_summary.txt").read_text().splitlines()[-1] == lines[-1]


def test_structured_stage(tmp_path, capsys):
    """The stage the device-image run skips (llguidance comes in the bundle there): constrained outputs on the tiny
    model are the schema's JSON, with both cells' rates in the report."""
    results = accelerator.run(smoke=True, stages=["structured"], workdir=str(tmp_path), out_dir=str(tmp_path / "o"))
    assert results[0].passed, results[0].line
    figures = json.loads((tmp_path / "o" / "accelerator.json").read_text())["stages"]["structured"]["figures"]
    assert figures["invalid_outputs"] == 0 and figures["free_tok_s"] > 0 and figures["constrained_tok_s"] > 0


def test_budgets_cut_a_stage_at_its_checkpoint_and_leave_later_stages_unstarted(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(accelerator_run, "MIN_STAGE_S", 0.2)

    def slow(ctx):
        for i in range(100):
            ctx.check_time(i, 100, "units")
            ctx.figure(f"unit{i}", i)
            time.sleep(0.05)
        return "all units"

    def quick_then_spend(ctx):
        time.sleep(0.4)  # what is left of the run's budget
        return "quick"
    monkeypatch.setitem(accelerator.STAGE_FUNCTIONS, "attention", slow)
    monkeypatch.setitem(accelerator.STAGE_FUNCTIONS, "kv_write", quick_then_spend)
    monkeypatch.setitem(accelerator.STAGE_FUNCTIONS, "greedy_parity", lambda ctx: pytest.fail("started"))
    results = accelerator.run(smoke=True, stages=["attention", "kv_write", "greedy_parity"], workdir=str(tmp_path),
                              out_dir=str(tmp_path), budget_s=0.9, stage_budgets={"attention": 0.3})
    assert [r.status for r in results] == ["timeout", "pass", "not_reached"]
    assert accelerator.exit_status(results) == 1
    lines = _lines(capsys)
    assert any(line.startswith("TIMEOUT attention: its budget of 0s ran out after ") for line in lines), lines
    assert any(line.startswith("NOT REACHED greedy_parity: the run's budget of 1s was spent") for line in lines)
    assert lines[-1].startswith("accelerator acceptance: 1 passed, 0 failed, 1 out of time, 1 not reached")
    report = json.loads((tmp_path / "accelerator.json").read_text())
    attention = report["stages"]["attention"]
    done = len(attention["figures"])
    assert 2 <= done < 100 and attention["status"] == "timeout" and f"after {done} of 100 units" in attention["detail"]
    assert report["stages"]["greedy_parity"]["status"] == "not_reached"


def test_watchdog_writes_the_report_and_ends_a_run_stuck_in_a_stage(tmp_path):
    """A stage that does not return (a compile that hangs) past the run's budget: the watchdog marks it killed,
    writes the report and the summary, prints them and exits with status 3."""
    printed, exits = [], []
    report = accelerator_run.Report(str(tmp_path), dict(smoke=False))
    budget = accelerator_run.Budget(0.1)
    done = accelerator_run.StageResult("attention", "pass", "fine", 0.05)
    report.result(done, 0.05)
    report.figure("moe", "moe_b1", dict(step_ms=1.5))
    dog = accelerator_run.Watchdog(report, budget, printed.append, grace_s=0.05,
                                   exit=lambda code: exits.append((code, (tmp_path / "accelerator.json").read_text())))
    dog.results, dog.current = [done], ("moe", budget.clock())
    dog.start()
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.02)
    assert exits and exits[0][0] == 3
    written = json.loads(exits[0][1])
    assert written["stages"]["moe"]["status"] == "killed" and written["stages"]["moe"]["figures"]["moe_b1"]
    assert written["summary"].startswith("accelerator acceptance: 1 passed, 0 failed, 1 killed")
    assert printed[0].startswith("KILLED moe: the run's budget of 0s ran out inside this stage")
    assert (tmp_path / "accelerator_summary.txt").read_text().splitlines()[-1] == written["summary"]


def test_wrong_tolerance_fails_the_attention_stage_only(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(accelerator, "TOLERANCES", {"float32": (0.0, 0.0), "bfloat16": (0.0, 0.0)})
    monkeypatch.setattr(accelerator, "SMOKE", dataclasses.replace(accelerator.SMOKE, named_cases=("decode_only",),
                                                                  engine_cases={}))
    results = accelerator.run(smoke=True, stages=["attention", "kv_write"], workdir=str(tmp_path))
    lines = _lines(capsys)
    assert [(r.stage, r.passed) for r in results] == [("attention", False), ("kv_write", True)]
    fail = next(line for line in lines if line.startswith("FAIL attention: "))
    assert "decode_only" in fail and "> tol 0" in fail
    assert any(line.startswith("PASS kv_write: ") for line in lines)
    assert lines[-1].startswith("accelerator acceptance: 1 passed, 1 failed")
    assert accelerator.exit_status(results) == 1


def test_broken_kv_write_expectation_fails(monkeypatch, tmp_path, capsys):
    right = accelerator.expected_kv_write

    def off_by_one(cache, k, v, slots):
        return right(cache, k, v, [s + 1 if s >= 0 else s for s in slots])
    monkeypatch.setattr(accelerator, "expected_kv_write", off_by_one)
    results = accelerator.run(smoke=True, stages=["kv_write"], workdir=str(tmp_path))
    assert not results[0].passed and "slots wrong" in results[0].detail
    assert any(line.startswith("FAIL kv_write: ") for line in _lines(capsys))


def test_raising_stage_is_a_fail_with_its_first_line_and_the_run_goes_on(monkeypatch, tmp_path, capsys):
    def boom(ctx):
        raise RuntimeError("device lost\nsecond line of the message")
    monkeypatch.setitem(accelerator.STAGE_FUNCTIONS, "environment", boom)
    results = accelerator.run(smoke=True, stages=["environment", "kv_write"], workdir=str(tmp_path))
    lines = _lines(capsys)
    assert [r.passed for r in results] == [False, True]
    fail = next(line for line in lines if line.startswith("FAIL environment: "))
    assert "RuntimeError: device lost" in fail and "second line" not in fail


def test_main_exits_non_zero_when_a_stage_fails(monkeypatch, tmp_path):
    monkeypatch.setitem(accelerator.STAGE_FUNCTIONS, "environment",
                        lambda ctx: (_ for _ in ()).throw(accelerator.StageFailure("broken on purpose")))
    # main() reads its absl flags; these stand in for parsed ones (no global flag state touched)
    for holder, value in (("_SMOKE", True), ("_STAGES", ["environment"]), ("_WORKDIR", str(tmp_path)),
                          ("_OUT", ""), ("_BUDGET", None), ("_PARITY_SUBPROCESS", None)):
        monkeypatch.setattr(accelerator, holder, types.SimpleNamespace(value=value))
    with pytest.raises(SystemExit) as e:
        accelerator.main()
    assert e.value.code == 1
    monkeypatch.setitem(accelerator.STAGE_FUNCTIONS, "environment", lambda ctx: "fine")
    accelerator.main()  # no SystemExit: every stage passed


def test_unknown_stage_is_refused():
    with pytest.raises(ValueError, match="unknown stage"):
        accelerator.run(smoke=True, stages=["nope"])


def test_jax_gpu_paged_attention_agrees_on_the_converted_layout():
    """The bandwidth stage feeds JAX's kernel our KV converted once: the same attention (its interpret mode)."""
    shape = accelerator.DecodeShape(batch=2, context=40, q_heads=8, kv_heads=2, head_dim=64, page_size=16,
                                    dtype="float32")
    ragged = accelerator.decode_inputs(jax.random.PRNGKey(0), shape)
    want = reference.ragged_paged_attention_reference(*ragged, sm_scale=64 ** -0.5)
    q, k_pages, v_pages, lengths, tables = accelerator.to_jax_layout(*ragged, sm_scale=64 ** -0.5)
    got = jax_compat.jax_gpu_paged_attention(q, k_pages, v_pages, tables, lengths,
                                             k_splits=min(16, shape.pages_per_seq), interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


KERNEL_MARK = {"gpu": "ragged_paged_attention_triton", "tpu": "tpu_custom_call"}
JAX_MARK = {"gpu": "paged_attention", "tpu": "tpu_custom_call"}


def _lower(fn, args, platform: str) -> str:
    with tracing_for(platform):
        return fn.trace(*args).lower(lowering_platforms=(lowering_platform(platform),)).as_text()


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_timed_attention_programs_lower_for_the_platform(platform):
    hq, hkv, d, ps = accelerator.FULL.bandwidth_heads
    for batch, context in accelerator.FULL.bandwidth_shapes:
        shape = accelerator.DecodeShape(batch, context, hq, hkv, d, ps)
        ragged = jax.eval_shape(functools.partial(accelerator.decode_inputs, shape=shape), jax.random.PRNGKey(0))
        jax_args = jax.eval_shape(functools.partial(accelerator.to_jax_layout, sm_scale=0.1), *ragged)
        impls = accelerator.decode_attention_impls(platform, shape)
        assert set(impls) == {"ours", "xla-reference", f"jax-pallas-{platform}"}
        for name, (fn, layout) in impls.items():
            text = _lower(fn, ragged if layout == "ragged" else jax_args, platform)
            if name == "ours":
                assert KERNEL_MARK[platform] in text, (batch, context)
            elif name.startswith("jax-pallas"):
                assert JAX_MARK[platform] in text, (batch, context)
    copy = jax.ShapeDtypeStruct((accelerator.FULL.copy_bytes // 2,), jnp.bfloat16)
    _lower(jax.jit(jnp.copy), [copy], platform)


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_checked_kv_write_lowers_for_the_platform(platform):
    for spec in accelerator.FULL.kv_write_cases:
        dt = jnp.dtype(spec["dtype"])
        args = (jax.ShapeDtypeStruct((spec["pages"], spec["ps"], 2 * spec["hkv"], spec["d"]), dt),
                jax.ShapeDtypeStruct((spec["t"], spec["hkv"], spec["d"]), dt),
                jax.ShapeDtypeStruct((spec["t"], spec["hkv"], spec["d"]), dt),
                jax.ShapeDtypeStruct((spec["t"],), jnp.int32))
        # a fresh partial: a fresh trace (the platform a trace is for is not part of jit's cache key)
        text = _lower(jax.jit(functools.partial(pallas_kernels.write_kv), donate_argnums=0), args, platform)
        if platform == "tpu":
            assert "tpu_custom_call" in text


@pytest.fixture(scope="module")
def llama_1b_heads(tmp_path_factory):
    """The 1B-shaped model's attention (32 heads of 64, 8 KV heads, tied embeddings) on a 2-layer, small-vocab
    body: the decode-roofline engine's programs, small enough to lower here."""
    cfg = dict(accelerator.LLAMA_1B, num_hidden_layers=2, vocab_size=512, intermediate_size=256)
    return hf_models.save_config(tf.LlamaConfig(**cfg), tmp_path_factory.mktemp("accel") / "llama")


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_decode_roofline_programs_lower_for_the_platform(llama_1b_heads, platform):
    engine = Engine(EngineConfig(model=llama_1b_heads, platform=platform, dtype="bfloat16", page_size=16,
                                 num_pages=64, max_num_seqs=64, max_num_batched_tokens=accelerator.TOKEN_BUDGET,
                                 compilation_cache_dir=""))
    buckets = engine.runner.buckets
    for batch in accelerator.FULL.decode_batches:  # the decode steps' buckets, and the prefill's
        tokens = next(t for t in buckets if t >= batch)
        text = engine.runner.lower(engine.runner.trace_program(
            Program("forward", tokens, engine.runner.seq_bucket(tokens)))).as_text()
        assert KERNEL_MARK[platform] in text
    text = engine.runner.lower(engine.runner.trace_program(
        Program("forward", buckets[-1], engine.runner.seq_bucket(buckets[-1])))).as_text()
    assert KERNEL_MARK[platform] in text


@pytest.mark.e2e
def test_command_line(tmp_path):
    """`python -m serving.bench accelerator` is registered, takes its flags, and its exit status says whether every
    stage passed."""
    cmd = [sys.executable, "-m", "serving.bench", "accelerator", "--smoke", f"--workdir={tmp_path}"]
    ok = subprocess.run(cmd + ["--stages=environment,kv_write"], capture_output=True, text=True, cwd=REPO_ROOT,
                        timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "PASS environment: " in ok.stdout and "PASS kv_write: " in ok.stdout
    assert "accelerator acceptance: 2 passed, 0 failed" in ok.stdout
    bad = subprocess.run(cmd + ["--stages=nope"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert bad.returncode != 0 and "unknown" in bad.stderr
    listed = subprocess.run([sys.executable, "-m", "serving.bench", "--help"], capture_output=True, text=True,
                            cwd=REPO_ROOT, timeout=60)
    assert "accelerator" in listed.stdout
