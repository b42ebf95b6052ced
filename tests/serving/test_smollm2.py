"""Real weights end to end: SmolLM2-135M-Instruct's GGUF (Q4_1, the demo's model) served by the engine against HF
transformers reading the same file. Greedy chats where every emitted token is HF's argmax given our prefix (a token
within TOLERANCE of HF's best counts: float32 kernels that sum in another order may swap a near-tie), the perplexity
of a public-domain text within 0.1% of HF's (the int8-quantised engine's reported beside it), and the same at tp=3
(9 heads, 3 KV heads) on the fake devices; the tokenizer rebuilt from the GGUF as transformers rebuilds it."""
from __future__ import annotations

import numpy as np
import pytest

from models.tokenizer import Tokenizer
from serving.core.config import EngineConfig
from serving.core.engine import Engine
from serving.core.sampling_params import SamplingParams
from tests.support import smollm2

# Our float32 logits differ from HF's by ~1e-4 on this model (max |diff| over a chat's positions); a token is HF's
# choice if its HF logit is within this of HF's best.
TOLERANCE = 2e-3
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three planets of the solar system, as a numbered list."}],
    [{"role": "system", "content": "You are a helpful travel assistant."},
     {"role": "user", "content": "Which city is famous for its canals and gondolas?"}],
]
MAX_TOKENS = 12


def _engine(**kw) -> Engine:
    return Engine(EngineConfig(model=smollm2.gguf_path(), page_size=16, num_pages=96, max_num_seqs=4,
                               max_num_batched_tokens=64, min_token_bucket=16, **kw))


@pytest.fixture(scope="module")
def hf():
    return smollm2.hf_reference()


@pytest.fixture(scope="module")
def text_ids(engine):
    with open(smollm2.TEXT, encoding="utf-8") as f:
        return engine.tokenizer.encode(f.read())


@pytest.fixture(scope="module")
def hf_perplexity(text_ids):
    return smollm2.hf_perplexity(text_ids)


@pytest.fixture(scope="module")
def engine():
    return _engine()


def _greedy_chats(engine) -> list[tuple[list[int], list[int]]]:
    """(prompt, greedy tokens) of every chat, run together; no KV page left behind."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    prompts = [engine.tokenizer.encode_chat(c, add_generation_prompt=True) for c in CHATS]
    for i, p in enumerate(prompts):
        engine.add_request(engine.make_request(f"chat{i}", p, params))
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    engine.scheduler.block_manager.check_idle()
    return [(p, outs[f"chat{i}"]) for i, p in enumerate(prompts)]


def _check_hf_argmax(hf, chats) -> int:
    """Every emitted token is HF's argmax given our prefix, within TOLERANCE; returns how many were exact."""
    exact = total = 0
    for prompt, tokens in chats:
        rows = smollm2.hf_logits(hf, prompt + tokens)[len(prompt) - 1:-1]
        for step, (row, token) in enumerate(zip(rows, tokens)):
            best = int(np.argmax(row))
            assert row[token] >= row[best] - TOLERANCE, \
                f"step {step}: we emitted {token} ({row[token]:.4f}), HF's argmax is {best} ({row[best]:.4f})"
            exact += token == best
            total += 1
    assert total >= len(chats) * 6  # the chats really generated
    return exact


def test_greedy_chats_are_hf_argmax(engine, hf):
    chats = _greedy_chats(engine)
    _check_hf_argmax(hf, chats)
    assert engine.tokenizer.decode(chats[0][1]).startswith("The capital of France is Paris")


def test_perplexity_within_a_thousandth_of_hf(engine, hf_perplexity, text_ids, record_property):
    ours = smollm2.perplexity(smollm2.engine_logits(engine, text_ids), text_ids)
    record_property("perplexity", {"meshserve": ours, "hf": hf_perplexity, "tokens": len(text_ids)})
    print(f"\nSmolLM2-135M-Instruct Q4_1, {len(text_ids)} tokens: perplexity {ours:.4f} (HF {hf_perplexity:.4f})")
    assert len(text_ids) > 500
    assert abs(ours / hf_perplexity - 1) < 1e-3


def test_int8_perplexity_reported(hf_perplexity, text_ids, record_property):
    """--quantization=int8 after dequantizing: per-channel int8 on top of Q4_1 costs a little perplexity."""
    ours = smollm2.perplexity(smollm2.engine_logits(_engine(quantization="int8"), text_ids), text_ids)
    record_property("perplexity_int8", {"meshserve_int8": ours, "hf_float32": hf_perplexity})
    print(f"\nint8 serving: perplexity {ours:.4f} (float32 HF {hf_perplexity:.4f}, {ours / hf_perplexity - 1:+.2%})")
    assert abs(ours / hf_perplexity - 1) < 0.02


def test_tensor_parallel_3(hf, hf_perplexity, text_ids):
    """tp=3: the 9 query and 3 KV heads split three ways; the same checks."""
    engine = _engine(tp=3)
    q = engine.runner.state["layers"][0]["self_attn"]["q_proj"].get_value()
    assert q.sharding.spec[1] == "tensor" and len(q.sharding.device_set) == 3
    _check_hf_argmax(hf, _greedy_chats(engine))
    ours = smollm2.perplexity(smollm2.engine_logits(engine, text_ids), text_ids)
    print(f"\ntp=3: perplexity {ours:.4f} (HF {hf_perplexity:.4f})")
    assert abs(ours / hf_perplexity - 1) < 1e-3


def test_tokenizer_is_transformers_gguf_tokenizer(engine):
    """The tokenizer rebuilt from tokenizer.ggml.* (byte-level BPE, SmolLM's digit-by-digit pre-tokenizer, control
    tokens special, the embedded ChatML template) encodes and renders as transformers' own GGUF tokenizer; saved as
    HF files it reads back the same."""
    ours, theirs = engine.tokenizer, smollm2.hf_tokenizer()
    with open(smollm2.TEXT, encoding="utf-8") as f:
        text = f.read()
    samples = [text, "It's 2024: the café costs 3.50€ -- naïve?", "def f(x):\n\treturn x**2  # 你好",
               "<|im_start|>user\nhi<|im_end|>\n"]
    for s in samples:
        assert ours.encode(s) == theirs.encode(s), s
        assert ours.decode(ours.encode(s), skip_special_tokens=False) == s
    for chat in CHATS:
        assert ours.apply_chat_template(chat, add_generation_prompt=True) == \
            theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ours.eos_token_ids == (2,) and ours.bos_token_id == 1
    assert ours.special_tokens["eos_token"] == "<|im_end|>" and 2 in ours.special_token_ids
    assert ours.encode("2024") == [ours.token_to_id(d) for d in "2024"]  # one token per digit


def test_tokenizer_saved_as_hf_files_reads_back(engine, tmp_path):
    engine.tokenizer.save_pretrained(tmp_path)
    again = Tokenizer.from_pretrained(str(tmp_path))
    chat = CHATS[2]
    assert again.encode_chat(chat, add_generation_prompt=True) == \
        engine.tokenizer.encode_chat(chat, add_generation_prompt=True)
    assert (again.eos_token_ids, again.bos_token_id, again.special_token_ids) == \
        (engine.tokenizer.eos_token_ids, engine.tokenizer.bos_token_id, engine.tokenizer.special_token_ids)


def test_directory_tokenizer_json_wins_over_the_gguf(engine, tmp_path):
    """A directory holding the GGUF and a tokenizer.json uses that tokenizer; with no chat template of its own it
    renders with the GGUF's."""
    from models.synthetic import make_test_tokenizer
    make_test_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    (tmp_path / "model.gguf").symlink_to(smollm2.gguf_path())
    ours = Tokenizer.from_pretrained(str(tmp_path))
    own = Tokenizer.from_pretrained(str(tmp_path / "model.gguf"))
    text = "The capital of France is Paris."
    assert ours.vocab_size < 1000 and ours.encode(text) != own.encode(text)
    assert ours.chat_template == own.chat_template == engine.tokenizer.chat_template
