"""LoRA serving end to end on small random Llama and Qwen2 models with random PEFT adapters (built with `peft`; ranks 4
and 16, different target modules, alpha != r, one rsLoRA): a step mixing three adapters and the base model gives HF
transformers + PEFT's logits and greedy tokens (also at tp=2, with int8 base weights, chunked prefill, preemption,
n > 1 and n-gram speculation); adapters load and unload while requests run on them (those finish on the adapter
they started with, nothing leaks); the prefix cache never serves one adapter's pages to another; an unknown adapter
is an error naming it, a mismatched one is refused naming why."""
import re

import jax.numpy as jnp
import numpy as np
import pytest

from models.lora import AdapterError
from models.synthetic import shared_small_llama
from models.quant import WeightQuant
from pallas_kernels import lora as lora_kernels
from pallas_kernels import native
from serving.core.batch import SeqChunk
from serving.core.config import EngineConfig
from serving.core.engine import Engine
from serving.core.lora import UnknownAdapterError
from serving.params import SamplingParams, StructuredOutput
from tests.support import hf_models, quant
from tests.support import lora as peft_support

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> PEFT LoraConfig
    "a": dict(r=4, alpha=8, targets=["q_proj", "v_proj"], seed=1),
    "b": dict(r=16, alpha=24, targets=ALL, rslora=True, seed=2),
    "c": dict(r=16, alpha=8, targets=["k_proj", "o_proj", "gate_proj", "down_proj"], seed=3),
    "d": dict(r=8, alpha=32, targets=["up_proj", "q_proj"], seed=4),  # loaded at run time
}
VOCAB = 160  # prompts' token ids: below both models' vocabularies
OPTIONS = dict(page_size=8, num_pages=32, max_num_seqs=8, max_num_batched_tokens=32, min_token_bucket=8,
               max_prefill_chunk=16, enable_lora=True, max_loras=3, max_lora_rank=16)


class Family:
    """A small HF model, its adapters and HF + PEFT's answers (computed once per (adapter, prompt))."""

    def __init__(self, root, family: str):
        self.root, self.family = root, family
        if family == "llama":  # the shared 2-layer Llama with the test tokenizer (structured outputs need one)
            self.dir = shared_small_llama()
        else:
            self.dir = str(root / family)
            hf_models.save_hf_model(family, self.dir)
        self._adapters, self._models, self._greedy = {}, {}, {}

    def adapter(self, name: str) -> str:
        """Adapter `name`'s directory (built on first use)."""
        if name not in self._adapters:
            self._adapters[name] = peft_support.save_peft_adapter(self.dir, str(self.root / f"{self.family}-{name}"),
                                                                  **ADAPTERS[name])
        return self._adapters[name]

    def modules(self, names="abc") -> str:
        return ",".join(f"{n}={self.adapter(n)}" for n in names)

    def reference(self, adapter: str | None):
        if adapter not in self._models:
            self._models[adapter] = peft_support.reference_model(self.dir, adapter and self.adapter(adapter))
        return self._models[adapter]

    def greedy(self, adapter: str | None, prompt: list[int], steps: int) -> list[int]:
        key = (adapter, tuple(prompt), steps)
        if key not in self._greedy:
            self._greedy[key] = peft_support.greedy(self.reference(adapter), prompt, steps)
        return self._greedy[key]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {f: Family(root, f) for f in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def engines(families):
    """One engine per family (Qwen2's with n-gram speculation), built on first use."""
    made = {}

    def get(family: str) -> Engine:
        if family not in made:
            extra = dict(speculative_method="ngram", num_speculative_tokens=3) if family == "qwen2" else {}
            made[family] = Engine(EngineConfig(model=families[family].dir, lora_modules=families[family].modules(),
                                               **OPTIONS, **extra))
        return made[family]
    return get


def prompt(n: int, seed: int) -> list[int]:
    return hf_models.random_prompt(n, VOCAB, seed=seed)


def run(engine: Engine, requests) -> list[set]:
    """Adds the requests, steps until idle (checking the scheduler's books each step); returns each step's set of
    adapters (None: the base model)."""
    for r in requests:
        engine.add_request(r)
    mixes = []
    while engine.has_unfinished():
        engine.step()
        engine.scheduler.check_invariants()
        if engine.last_step is not None:
            mixes.append({s.request.adapter.name if s.request.adapter else None for s in engine.last_step.scheduled})
    engine.scheduler.block_manager.check_idle()
    assert engine.lora.pins == [0] * engine.lora.max_loras
    return mixes


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)


def wait_resident(engine: Engine, names) -> dict[str, int]:
    for _ in range(200):
        engine.step()
        resident = engine.lora.resident()
        if all(n in resident for n in names):
            return resident
    raise AssertionError(f"adapters {names} never reached the device: {engine.lora.resident()}")


def mixed_logits(engine: Engine, prompts, names) -> np.ndarray:
    """The last-token logits of `prompts` (adapter `names[i]`, None: the base model) from one forward step."""
    resident = wait_resident(engine, [n for n in names if n])
    bm, runner = engine.scheduler.block_manager, engine.runner
    holders = [engine.make_request(f"logits-{i}", p) for i, p in enumerate(prompts)]
    for h, p in zip(holders, prompts):
        assert bm.allocate(h, len(p))
    try:
        chunks = [SeqChunk(p, 0, h.block_table) for p, h in zip(prompts, holders)]
        t, s = runner.bucket_for(sum(map(len, prompts)))
        batch = runner.step_batch(chunks, t, s, [resident[n] if n else -1 for n in names])
        logits, _ = runner.run_forward(batch)
        return np.asarray(logits)[:len(prompts)]
    finally:
        for h in holders:
            bm.free(h)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_mixed_batch_matches_hf_peft(families, engines, family):
    """Three adapters and the base model in one step: HF + PEFT's logits and greedy tokens (chunked prefill; Qwen2
    through n-gram speculation on a repetitive prompt)."""
    fam, engine = families[family], engines(family)
    names = [None, "a", "b", "c"]
    prompts = [prompt(n, seed) for n, seed in ((7, 1), (10, 2), (5, 3), (10, 4))]  # one 32-token step
    got = mixed_logits(engine, prompts, names)
    for row, name, p in zip(got, names, prompts):
        want = peft_support.last_logits(fam.reference(name), p)
        np.testing.assert_allclose(row, want, rtol=0, atol=2e-4 * np.abs(want).max(), err_msg=f"adapter {name}")
    prompts[3] = prompt(20, 4) if family == "llama" else (prompt(5, 9) * 4)[:20]  # Qwen2: n-grams continue it
    requests = [engine.make_request(f"{family}-mixed-{i}", p, greedy(7), adapter=n)
                for i, (p, n) in enumerate(zip(prompts, names))]
    mixes = run(engine, requests)
    assert set(names) in mixes  # one step ran all four
    for r, name, p in zip(requests, names, prompts):
        assert r.output_token_ids == fam.greedy(name, p, 7), f"adapter {name}"
    if family == "qwen2":
        assert engine.spec.num_spec_steps > 0


def test_mixed_batch_matches_hf_peft_at_tp2(families):
    """The same mixed step on 2 devices: A and B split as the weights they modify (the XLA paths of the update)."""
    fam = families["llama"]
    engine = Engine(EngineConfig(model=fam.dir, lora_modules=fam.modules(), **OPTIONS, tp=2))
    stacks = engine.runner.state["layers"][0]["self_attn"]["lora"]
    q_b, o_a = stacks["q_proj"]["b"].get_value(), stacks["o_proj"]["a"].get_value()
    assert q_b.sharding.spec[2] == "tensor" and o_a.sharding.spec[2] == "tensor"  # heads split, as q_proj / o_proj
    names = [None, "a", "b", "c"]
    prompts = [prompt(n, seed) for n, seed in ((7, 1), (10, 2), (5, 3), (10, 4))]
    got = mixed_logits(engine, prompts, names)
    for row, name, p in zip(got, names, prompts):
        want = peft_support.last_logits(fam.reference(name), p)
        np.testing.assert_allclose(row, want, rtol=0, atol=2e-4 * np.abs(want).max(), err_msg=f"adapter {name}")
    requests = [engine.make_request(f"tp-{i}", p, greedy(5), adapter=n) for i, (p, n) in enumerate(zip(prompts, names))]
    assert set(names) in run(engine, requests)
    for r, name, p in zip(requests, names, prompts):
        assert r.output_token_ids == fam.greedy(name, p, 5), f"adapter {name}"


def test_bfloat16_stacks_in_the_kernels_forms(families, monkeypatch):
    """bfloat16 where the native kernels run: the B stacks hold each slot in the kernel's strips, the A stacks in its
    blocks on a path with pair dot products, in pairs on one that widens bfloat16 (`pallas_kernels.lora.to_layout`);
    the slot writes put them so, and a mixed step's logits are those of the XLA path, which reads the same stacks
    row-major again (`from_layout`). On the XLA kernels (MESHSERVE_CPU_KERNELS=xla) the stacks stay row-major."""
    fam = families["llama"]
    names = [None, "a", "b", "c"]
    prompts = [prompt(n, seed) for n, seed in ((7, 1), (10, 2), (5, 3), (10, 4))]
    engine = Engine(EngineConfig(model=fam.dir, lora_modules=fam.modules(), **{**OPTIONS, "dtype": "bfloat16"}))
    runner = engine.runner
    on = runner.choices.native_kernels
    layout = ((lora_kernels.BLOCKS if native.pair_dot(native.isa()) else lora_kernels.PAIRS), lora_kernels.STRIPS) \
        if on else (lora_kernels.ROWS, lora_kernels.ROWS)
    assert {entry[4:6] for entry in runner.lora_layout} == {layout}  # (the model's K: 64 and 96; N: 32, 64, 96)
    got = mixed_logits(engine, prompts, names)
    slot = engine.lora.resident()["b"]
    stacks = runner.state["layers"][1]["mlp"]["lora"]["up_proj"]
    peft_ab = engine.adapters.get("b").peft.weights(runner.model_config)[1, "up_proj"]  # (A, B), scaling in B
    for stack, want_w, form in zip((stacks["a"], stacks["b"]), peft_ab, layout):
        w = stack.get_value()[slot]
        stored = np.asarray(lora_kernels.from_layout(w, form), np.float32)
        np.testing.assert_array_equal(stored[:16], np.asarray(jnp.asarray(want_w, jnp.bfloat16), np.float32))
    monkeypatch.setenv(lora_kernels.LORA_ENV_VAR, "loop")
    xla = Engine(EngineConfig(model=fam.dir, lora_modules=fam.modules(), **{**OPTIONS, "dtype": "bfloat16"}))
    want = mixed_logits(xla, prompts, names)
    # The XLA path rounds x @ A^T to bfloat16 before B (the kernel keeps it in float32 where it widens): 1-4% of the
    # logits' range here, against the 130-160% by which the adapters move them.
    for row, ref in zip(got, want):
        np.testing.assert_allclose(row, ref, rtol=0, atol=6e-2 * np.abs(ref).max())
    assert all(np.abs(ref - want[0]).max() > 0.5 * np.abs(ref).max() for ref in want[1:])


def test_int8_adapter_stacks(families):
    """--lora_dtype=int8: the slots hold each adapter's A and B as `quantize_adapter` gives them (PEFT's weights within
    half a step of their per-row scales), and a step mixing three adapters and the base model gives HF + PEFT's
    logits to within the quantization (~1-2% of the logits' range here, against the 60-160% by which the adapters
    move them). Refused: a max_lora_rank that is not a multiple of 32, and a mesh of more than one device."""
    fam = families["llama"]
    int8 = {**OPTIONS, "max_lora_rank": 32, "lora_dtype": "int8"}
    engine = Engine(EngineConfig(model=fam.dir, lora_modules=fam.modules(), **int8))
    runner = engine.runner
    assert all(entry[6] for entry in runner.lora_layout)
    names = [None, "a", "b", "c"]
    prompts = [prompt(n, seed) for n, seed in ((7, 1), (10, 2), (5, 3), (10, 4))]
    got = mixed_logits(engine, prompts, names)
    slot = engine.lora.resident()["b"]
    stacks = runner.state["layers"][1]["mlp"]["lora"]["up_proj"]
    assert stacks["a"].get_value().dtype == np.int8 and stacks["b"].get_value().dtype == np.int8
    wa, wb = engine.adapters.get("b").peft.weights(runner.model_config)[1, "up_proj"]
    a, b = (np.asarray(v) for v in lora_kernels.dequantize_adapter(
        stacks["a"].get_value()[slot], stacks["b"].get_value()[slot], stacks["scale"].get_value()[slot], wa.shape[1]))
    sb = np.abs(wb).max(-1, keepdims=True) / 127
    np.testing.assert_allclose(b[:16] * sb, wb, rtol=0, atol=0.51 * sb.max())
    np.testing.assert_allclose(a[:16] / sb, wa, rtol=0, atol=0.51 * np.abs(wa).max() / 127)
    want = [peft_support.last_logits(fam.reference(name), p) for name, p in zip(names, prompts)]
    for row, ref, name in zip(got, want, names):
        np.testing.assert_allclose(row, ref, rtol=0, atol=5e-2 * np.abs(ref).max(), err_msg=f"adapter {name}")
    base = [peft_support.last_logits(fam.reference(None), p) for p in prompts[1:]]
    assert all(np.abs(ref - b0).max() > 0.3 * np.abs(ref).max() for ref, b0 in zip(want[1:], base))
    with pytest.raises(ValueError, match="max_lora_rank must be a multiple of 32"):
        EngineConfig(model=fam.dir, **{**int8, "max_lora_rank": 16})
    with pytest.raises(ValueError, match="lora_dtype=int8 runs on one device"):
        Engine(EngineConfig(model=fam.dir, **int8, tp=2))


def test_int8_base_weights_with_adapters(families):
    """int8 base weights: the adapters' update stays in the activation dtype; logits are HF + PEFT's over the int8
    round trip of the base weights."""
    fam = families["llama"]
    engine = Engine(EngineConfig(model=fam.dir, lora_modules=fam.modules("b"), quantization="int8", **OPTIONS))
    assert engine.runner.state["layers"][0]["mlp"]["lora"]["up_proj"]["b"].get_value().dtype == np.float32
    prompts = [prompt(13, 5), prompt(13, 5)]
    got = mixed_logits(engine, prompts, [None, "b"])
    for row, name in zip(got, [None, "b"]):
        ref = peft_support.reference_model(fam.dir, name and fam.adapter(name),
                                           quantize=lambda m: quant.fake_quantize_hf(m, WeightQuant("int8")))
        want = peft_support.last_logits(ref, prompts[0])
        np.testing.assert_allclose(row, want, rtol=0, atol=2e-4 * np.abs(want).max(), err_msg=f"adapter {name}")
    assert not np.allclose(got[0], got[1], atol=1e-3)  # the adapter matters


def test_load_and_unload_while_requests_run(families, engines):
    """More adapters than slots, loaded and unloaded at run time under load with preemption: every request
    finishes on the adapter it started with (HF + PEFT's tokens), an unloaded adapter is refused for new requests,
    slots are reused (LRU), no page or pin leaks; n = 2 samples share their adapter."""
    fam, engine = families["llama"], engines("llama")
    wait_resident(engine, "abc")
    loads0, evictions0 = engine.lora.num_loads, engine.lora.num_evictions
    started = [(f"run-{n}-{i}", prompt(33, 40 + i), n) for i, n in enumerate("aabbcc")]
    requests = [engine.make_request(rid, p, greedy(9), adapter=n) for rid, p, n in started]
    for r in requests:
        engine.add_request(r)
    for _ in range(3):
        engine.step()
    info = engine.load_adapter("d", fam.adapter("d"))  # a fourth adapter, three slots
    assert info["rank"] == 8 and sorted(info["target_modules"]) == ["q_proj", "up_proj"]
    late = [engine.make_request("late-d", prompt(19, 60), greedy(6), adapter="d"),
            engine.make_request("late-base", prompt(22, 61), greedy(6)),
            engine.make_request("late-c", prompt(21, 62), greedy(6, n=2), adapter="c")]
    gone = engine.unload_adapter("a")  # two requests still run on it
    assert gone["requests_in_flight"] == 2
    with pytest.raises(UnknownAdapterError, match="'a' is not loaded"):
        engine.make_request("after-unload", prompt(5, 1), greedy(2), adapter="a")
    run(engine, late)
    for r, (_, p, n) in zip(requests, started):
        assert r.output_token_ids == fam.greedy(n, p, 9), f"{r.request_id} on adapter {n}"
    for r, n in zip(late, ["d", None, "c"]):
        for sample in r.samples:
            assert sample.output_token_ids == fam.greedy(n, r.prompt_token_ids, 6), sample.request_id
    assert sum(r.metrics.num_preemptions for r in requests + late) > 0  # 32 pages; the six need 36 (41 KV tokens)
    assert "a" not in engine.lora.resident() and {a["name"] for a in engine.list_adapters()} == {"b", "c", "d"}
    assert engine.lora.num_loads == loads0 + 1  # d, into the slot a left when its last request finished
    engine.load_adapter("a", fam.adapter("a"))  # again: three slots hold b, c, d, idle
    again = engine.make_request("again-a", prompt(9, 63), greedy(4), adapter="a")
    run(engine, [again])
    assert again.output_token_ids == fam.greedy("a", again.prompt_token_ids, 4)
    assert engine.lora.num_evictions == evictions0 + 1 and "b" not in engine.lora.resident()  # the least recent
    engine.unload_adapter("d")


def test_prefix_cache_is_keyed_by_adapter(families, engines):
    """A page computed under one adapter (or the base model) never serves another; the same adapter reuses it; an
    adapter loaded again under its name starts a new cache."""
    fam, engine = families["llama"], engines("llama")
    p = prompt(25, 77)  # three full pages before the last token

    def one(rid, adapter):
        r = engine.make_request(rid, p, greedy(3), adapter=adapter)
        run(engine, [r])
        assert r.output_token_ids == fam.greedy(adapter, p, 3), rid
        return r.metrics.num_cached_prompt_tokens

    assert one("pc-base", None) == 0
    assert one("pc-b", "b") == 0  # the base model's pages are not the adapter's
    assert one("pc-c", "c") == 0
    assert one("pc-b-again", "b") == 24
    assert one("pc-base-again", None) == 24
    engine.unload_adapter("b")
    engine.load_adapter("b", fam.adapter("b"))
    assert one("pc-b-reloaded", "b") == 0


def test_structured_output_on_an_adapter(families, engines):
    """A constrained request on an adapter (the masked sampling program after the LoRA forward) beside an
    unconstrained one on another: the first matches its regex, the second gives HF + PEFT's greedy tokens."""
    fam, engine = families["llama"], engines("llama")
    regex = r"[a-f]{3}-[0-9]{2}"
    constrained = engine.make_request("so-b", "Give me a code:", SamplingParams(
        temperature=0.0, max_tokens=16, structured=StructuredOutput(regex=regex)), adapter="b")
    free = engine.make_request("so-c", prompt(12, 5), greedy(6), adapter="c")
    assert {"b", "c"} in run(engine, [constrained, free])
    text = engine.tokenizer.decode([t for t in constrained.output_token_ids if t not in engine.eos_token_ids])
    assert re.fullmatch(regex, text), text
    assert free.output_token_ids == fam.greedy("c", free.prompt_token_ids, 6)


def test_unknown_and_mismatched_adapters(families, engines, tmp_path):
    """An unknown adapter is an error naming it (and what is loaded); adapters that do not fit are refused naming
    why (rank above max_lora_rank, another model's shapes, DoRA, a module meshserve does not adapt, a taken name);
    the engine keeps serving."""
    fam, engine = families["llama"], engines("llama")
    with pytest.raises(UnknownAdapterError, match=r"adapter 'nope' is not loaded \(loaded: 'a', 'b', 'c'\)"):
        engine.make_request("x", prompt(4, 1), greedy(1), adapter="nope")
    with pytest.raises(UnknownAdapterError, match="nope"):
        engine.unload_adapter("nope")
    big = peft_support.save_peft_adapter(fam.dir, str(tmp_path / "big"), r=32, alpha=8, targets=["q_proj"])
    with pytest.raises(AdapterError, match="rank 32; this engine's max_lora_rank is 16"):
        engine.load_adapter("big", big)
    other = families["qwen2"].adapter("c")  # Qwen2's k_proj has 1 KV head, Llama's 2
    with pytest.raises(AdapterError, match=r"k_proj: lora_A \[16, 64\] and lora_B \[16, 16\] do not fit the base "
                                           r"projection \[32, 64\]"):
        engine.load_adapter("other", other)
    dora = peft_support.save_peft_adapter(fam.dir, str(tmp_path / "dora"), r=4, alpha=8, targets=["q_proj"],
                                          use_dora=True)
    with pytest.raises(AdapterError, match="uses DoRA"):
        engine.load_adapter("dora", dora)
    head = peft_support.save_peft_adapter(fam.dir, str(tmp_path / "head"), r=4, alpha=8, targets=["q_proj", "lm_head"])
    with pytest.raises(AdapterError, match="lm_head"):
        engine.load_adapter("head", head)
    with pytest.raises(ValueError, match="'c' is already loaded"):
        engine.load_adapter("c", fam.adapter("c"))
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        engine.load_adapter("empty", str(tmp_path))
    assert {a["name"] for a in engine.list_adapters()} == {"a", "b", "c"}
    plain = Engine(EngineConfig(model=fam.dir, page_size=8, num_pages=16, max_num_seqs=8, max_num_batched_tokens=16))
    with pytest.raises(UnknownAdapterError, match="serves no LoRA adapters"):
        plain.make_request("x", prompt(4, 1), greedy(1), adapter="a")
    r = engine.make_request("still-serving", prompt(6, 2), greedy(3), adapter="c")
    run(engine, [r])
    assert r.output_token_ids == fam.greedy("c", r.prompt_token_ids, 3)


def test_data_parallel_replicas_share_the_adapters(families):
    """dp=2: one registry, slots per replica; requests on any replica run their adapter (HF + PEFT's tokens), an
    adapter loaded at run time serves both."""
    from serving.core.data_parallel import DataParallelEngine
    fam = families["llama"]
    engine = DataParallelEngine(EngineConfig(model=fam.dir, lora_modules=fam.modules("ab"), **OPTIONS, dp=2))
    assert engine.replicas[0].adapters is engine.replicas[1].adapters
    engine.load_adapter("d", fam.adapter("d"))
    names = [None, "a", "b", "d", "d", "a"]
    requests = [engine.make_request(f"dp-{i}", prompt(9, 90 + i), greedy(4), adapter=n) for i, n in enumerate(names)]
    for r in requests:
        engine.add_request(r)
    assert {engine.replica_of(r.request_id) for r in requests} == {0, 1}
    engine.run_until_idle()
    for r, n in zip(requests, names):
        assert r.output_token_ids == fam.greedy(n, r.prompt_token_ids, 4), f"{r.request_id} on adapter {n}"
    assert engine.unload_adapter("d")["requests_in_flight"] == 0
    assert [a["name"] for a in engine.list_adapters()] == ["a", "b"]
    for replica in engine.replicas:
        replica.scheduler.block_manager.check_idle()
