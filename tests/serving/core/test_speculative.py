"""Speculative decoding: greedy output token-identical to plain decoding for both proposers (concurrency, chunked
prefill, prefix cache, preemption, stop strings, max_tokens), the rejection sampler's output distribution equals
the target's (chi-square on a small vocabulary), and no page leaks after rejections and aborts."""
import copy
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from scipy import stats

from serving.core import sampling
from serving.core.config import EngineConfig
from serving.core.engine import Engine
from serving.core.llm import LLM
from serving.core.request import FinishReason
from serving.core.sampling_params import SamplingParams
from serving.core.speculative import break_even_acceptance, ngram_propose, rejection_sample
from tests.support import hf_models
from serving.process import REPO_ROOT

K = 3
# Steps of under 8 tokens padded to 8: fewer programs to compile (which bucket a step takes is not tested here).
OPTIONS = dict(page_size=8, num_pages=256, max_num_seqs=8, max_num_batched_tokens=64, min_token_bucket=8)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A random 2-layer llama and its draft: the same weights cut to the first layer (partly right, so steps mix
    acceptances and rejections)."""
    root = tmp_path_factory.mktemp("spec")
    target = str(root / "target")
    hf = hf_models.save_hf_model("llama", target)
    cfg = copy.deepcopy(hf.config)
    cfg.num_hidden_layers = 1
    torch.manual_seed(0)
    draft_model = tf.AutoModelForCausalLM.from_config(cfg)
    draft_model.load_state_dict({k: v for k, v in hf.state_dict().items() if ".layers.1." not in k})
    draft = str(root / "draft")
    draft_model.save_pretrained(draft)
    return target, draft


@pytest.fixture(scope="module")
def workload():
    """12 requests: repetitive prompts (prompt lookup finds matches), some sharing a prefix, mixed lengths."""
    rng = np.random.default_rng(0)
    system = hf_models.random_prompt(16, 160, seed=99)
    prompts, params = [], []
    for i in range(12):
        p = hf_models.random_prompt(int(rng.integers(4, 20)), 160, seed=100 + i)
        p = p + p[:6] + p  # repeats: n-gram hits
        prompts.append(system + p if i % 2 else p)
        params.append(SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 24)), ignore_eos=True))
    return prompts, params


def _run_checked(engine: Engine, prompts, params, abort_after: dict | None = None):
    """Runs to completion, checking the scheduler's books after every step; aborts request i after
    abort_after[i] steps. Returns {request index: output token ids}."""
    requests = [engine.make_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    for r in requests:
        engine.add_request(r)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        engine.scheduler.check_invariants()
        for i, n in (abort_after or {}).items():
            if steps == n:
                engine.abort(f"r{i}")
    engine.scheduler.block_manager.check_idle()
    return {i: r.output_token_ids for i, r in enumerate(requests)}


@pytest.fixture(scope="module")
def reference(models, workload):
    engine = Engine(EngineConfig(model=models[0], **OPTIONS))
    return _run_checked(engine, *workload)


@pytest.mark.parametrize("method, options", [
    ("ngram", dict(max_prefill_chunk=16, num_pages=20)),  # chunked prefill + prefix cache + preemption
    ("draft", dict(num_pages=20)),  # prefix cache + preemption
    ("ngram", dict(num_pages=20, speculative_min_acceptance=1.0)),  # any rejection switches a request off
])
def test_greedy_identical_to_plain(models, workload, reference, method, options):
    extra = {"speculative_model": models[1]} if method == "draft" else {}
    options = {**OPTIONS, "speculative_min_acceptance": 0.0, **options}
    engine = Engine(EngineConfig(model=models[0], **options, speculative_method=method, num_speculative_tokens=K,
                                 **extra))
    got = _run_checked(engine, *workload)
    assert got == reference
    stats_ = engine.spec.stats()
    switched_off = [s for s in engine.spec._states.values() if s.off_until > 0]
    assert bool(switched_off) == (options["speculative_min_acceptance"] > 0)
    assert engine.scheduler.num_preemptions > 0
    assert stats_["spec_decode_num_drafts"] > 0
    # Both outcomes happened: some drafts accepted, some rejected (rolled back).
    assert 0 < stats_["spec_decode_num_accepted_tokens"] < stats_["spec_decode_num_draft_tokens"]
    assert sum(stats_["spec_decode_num_accepted_tokens_per_pos"]) == stats_["spec_decode_num_accepted_tokens"]


def test_tensor_parallel_draft(models, workload, reference):
    """tp=2: the target and the draft (and its KV pages) sharded over 'tensor'; greedy output unchanged."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    prompts, params = workload
    engine = Engine(EngineConfig(model=models[0], **OPTIONS, tp=2, speculative_method="draft",
                                 speculative_model=models[1], num_speculative_tokens=K, speculative_min_acceptance=0.0))
    got = _run_checked(engine, prompts[:4], params[:4])
    assert got == {i: reference[i] for i in range(4)}
    assert engine.spec.stats()["spec_decode_num_drafts"] > 0


def test_aborts_and_max_tokens_leave_no_pages(models, workload):
    prompts, params = workload
    engine = Engine(EngineConfig(model=models[0], **OPTIONS, speculative_method="draft",
                                 speculative_model=models[1], num_speculative_tokens=K,
                                 speculative_min_acceptance=0.0))
    long = [dataclasses.replace(p, max_tokens=p.max_tokens + 10) for p in params[:6]]
    out = _run_checked(engine, prompts[:6], long, abort_after={0: 2, 3: 4, 5: 6})
    for i, p in enumerate(long):
        assert len(out[i]) <= p.max_tokens  # max_tokens: never past it, even with k+1 tokens a step
        if i not in (0, 3, 5):
            assert len(out[i]) == p.max_tokens


def test_stop_strings_with_self_draft():
    """With a tokenizer: the shipped tiny target as its own draft (every draft accepted, k+1 tokens a step); a stop
    string in the middle of a step ends the text and the tokens exactly where plain decoding does."""
    target = os.path.join(REPO_ROOT, "models", "tiny", "target")
    if not os.path.exists(os.path.join(target, "tokenizer.json")):
        pytest.skip("models/tiny/target is not there")
    options = dict(page_size=8, num_pages=64, max_num_seqs=4, max_num_batched_tokens=32)
    plain = LLM(target, warmup=False, **options)
    prompt = "def main(argv):\n    "
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = plain.generate([prompt], greedy)[0]
    text = ref.text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    spec = LLM(target, warmup=False, **options, speculative_method="draft", speculative_model=target,
               num_speculative_tokens=K, speculative_min_acceptance=0.0)
    with_stop = dataclasses.replace(greedy, stop=(stop,))
    a = plain.generate([prompt], with_stop)[0]
    b = spec.generate([prompt], with_stop)[0]
    assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == (a.text, a.token_ids, a.finish_reason,
                                                                     a.stop_reason)
    assert a.finish_reason is FinishReason.STOP
    assert spec.generate([prompt], greedy)[0].token_ids == ref.token_ids
    assert spec.engine.spec.stats()["spec_decode_acceptance_rate"] > 0.9
    spec.engine.scheduler.block_manager.check_idle()


# ---------------------------------------------------------------------------------------------- unit level
def test_ngram_propose():
    assert ngram_propose([1, 2, 3, 4, 9, 1, 2, 3], 2, 1, 3) == [4, 9]
    assert ngram_propose([5, 1, 2, 7, 1, 2], 3, 1, 2) == [7, 1, 2]
    assert ngram_propose([1, 2, 3], 2, 1, 3) == []
    assert ngram_propose([4, 4], 5, 1, 3) == [4]
    assert ngram_propose([7, 7, 7, 7, 7, 7], 3, 1, 2) == [7, 7, 7]  # not the match right before the end
    assert break_even_acceptance(4, 0.0) == pytest.approx(0.0, abs=1e-6)
    assert 0.3 < break_even_acceptance(4, 0.25) < 0.6 and break_even_acceptance(2, 1.0) == 1.0


V = 5


def _tensors(n: int, temperature: float) -> sampling.SamplingTensors:
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(n)]
    st = sampling.build_sampling_tensors(params, vocab_size=V, token_ids=[[]] * n, num_prompt_tokens=[0] * n)
    return dataclasses.replace(st, token_ids=None, num_prompt_tokens=None)


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_rejection_sampling_keeps_target_distribution(proposer):
    """Two positions, context-dependent target p(x1) p(x2 | x1) and draft q(d1) q(d2 | d1) on V=5 tokens,
    40000 independent rounds: the emitted (x1, x2) (x2 completed from p(. | x1) when the round stops after x1,
    as the next round's first token would be) follow the target's joint distribution."""
    rng = np.random.default_rng(0)
    n = 40_000
    p0, p1 = rng.dirichlet(np.ones(V)), rng.dirichlet(np.ones(V), size=V)
    q0, q1 = rng.dirichlet(np.ones(V)), rng.dirichlet(np.ones(V), size=V)
    if proposer == "draft":
        d1 = rng.choice(V, n, p=q0)
        d2 = np.array([rng.choice(V, p=q1[a]) for a in d1])
        draft_probs = np.stack([q0[None].repeat(n, 0), q1[d1]], axis=1).astype(np.float32)
    else:  # deterministic proposals: a fixed guess
        d1 = np.full(n, 2)
        d2 = np.full(n, 4)
        draft_probs = None
    logits = np.stack([np.log(p0)[None].repeat(n, 0), np.log(p1[d1]), np.zeros((n, V))], axis=1)
    tokens, emitted = jax.jit(rejection_sample)(
        jnp.asarray(logits, jnp.float32), jnp.asarray(np.stack([d1, d2], 1), jnp.int32),
        None if draft_probs is None else jnp.asarray(draft_probs), jnp.full((n,), 2, jnp.int32), _tensors(n, 1.0))
    tokens, emitted = np.asarray(tokens), np.asarray(emitted)
    assert emitted.min() >= 1 and emitted.max() <= 3
    x1 = tokens[:, 0]
    x2 = np.where(emitted >= 2, tokens[:, 1], -1)
    fill = emitted < 2
    u = rng.random(fill.sum())
    x2[fill] = (u[:, None] > np.cumsum(p1[x1[fill]], axis=1)).sum(1)
    observed = np.bincount(x1 * V + x2, minlength=V * V)
    expected = (p0[:, None] * p1).reshape(-1) * n
    chi2 = stats.chisquare(observed, expected).pvalue
    tv = 0.5 * np.abs(observed / n - expected / n).sum()
    assert chi2 > 1e-3 and tv < 0.02, (chi2, tv)
    # Accepted drafts are the drafts; some rounds accept, some reject.
    accepted = emitted - 1
    assert np.all(tokens[accepted >= 1, 0] == d1[accepted >= 1])
    assert 0 < (accepted == 0).mean() < 1


def test_rejection_sampling_greedy_is_the_target_argmax():
    rng = np.random.default_rng(1)
    n, k = 64, 3
    logits = rng.normal(size=(n, k + 1, V)).astype(np.float32)
    argmax = logits.argmax(2)
    drafts = np.where(rng.random((n, k)) < 0.7, argmax[:, :k], (argmax[:, :k] + 1) % V)
    num_draft = rng.integers(0, k + 1, n)
    # One compiled program, read back to NumPy once (not op by op, element by element).
    tokens, emitted = jax.jit(rejection_sample)(jnp.asarray(logits), jnp.asarray(drafts, jnp.int32), None,
                                                jnp.asarray(num_draft, jnp.int32), _tensors(n, 0.0))
    tokens, emitted = np.asarray(tokens), np.asarray(emitted)
    for i in range(n):
        ok = 0
        while ok < num_draft[i] and drafts[i, ok] == argmax[i, ok]:
            ok += 1
        assert int(emitted[i]) == ok + 1
        assert list(tokens[i, :ok + 1]) == list(argmax[i, :ok + 1])


def test_server_flags_and_metrics():
    from absl import flags
    from prometheus_client import generate_latest

    from serving.server import __main__ as server_main
    from serving.telemetry.metrics import ServerMetrics
    fv = flags.FlagValues()
    server_main.define_flags(fv)
    fv(["serving.server", "--model=/m", "--speculative_method=ngram", "--num_speculative_tokens=3",
        "--prompt_lookup_max=5", "--speculative_disable_by_batch_size=32", "--speculative_min_acceptance=0.3"])
    config, _ = server_main.configs_from_flags(fv)
    spec = config.speculative_config()
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max, spec.disable_by_batch_size,
            spec.min_acceptance) == ("ngram", 3, 5, 32, 0.3)
    with pytest.raises(ValueError, match="speculative_model"):
        EngineConfig(model="/m", speculative_method="draft")
    stats_ = dict(spec_decode_num_drafts=4, spec_decode_num_draft_tokens=12, spec_decode_num_accepted_tokens=7,
                  spec_decode_num_accepted_tokens_per_pos=[4, 2, 1])
    metrics = ServerMetrics("m", lambda: stats_, num_speculative_tokens=3)
    metrics.refresh()
    text = generate_latest(metrics.registry).decode()
    assert 'meshserve:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0' in text
    assert 'meshserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0' in text
    assert "spec_decode" not in generate_latest(ServerMetrics("m", dict).registry).decode()
