"""models.tokenizer against transformers' AutoTokenizer on the local test tokenizer from models.synthetic."""
from __future__ import annotations

import json
import os
import time

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.synthetic import TEST_CHAT_TEMPLATE, make_test_tokenizer
from models.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# Any text UTF-8 can carry (no lone surrogates), weighted towards multi-byte characters.
_TEXT = st.text(
    alphabet=st.one_of(
        st.characters(blacklist_categories=("Cs",)),
        st.sampled_from(list("aé你好😀🦀👍🏽\u200d ÿ\n")),
    ),
    max_size=40,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_test_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


# ------------------------------------------------------------------------------------------- loading
def test_make_test_tokenizer_is_deterministic_and_fast(tmp_path):
    start = time.perf_counter()
    make_test_tokenizer(tmp_path / "a")
    assert time.perf_counter() - start < 2.0
    make_test_tokenizer(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_special_ids_and_vocab(tokenizer, hf_tokenizer):
    assert tokenizer.vocab_size == len(hf_tokenizer) == 512
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id == 0
    assert tokenizer.pad_token_id == hf_tokenizer.pad_token_id == 2
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id == 1
    # generation_config.json adds <|im_end|> as a second stop token.
    assert tokenizer.eos_token_ids == (1, tokenizer.token_to_id("<|im_end|>"))
    assert tokenizer.special_tokens == hf_tokenizer.special_tokens_map
    assert tokenizer.special_token_ids == frozenset(hf_tokenizer.all_special_ids) | {3, 4}


def test_generation_config_fills_missing_ids(tmp_path):
    model_dir = make_test_tokenizer(tmp_path)
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    del config["bos_token"], config["pad_token"], config["eos_token"]
    with open(config_path, "w") as f:
        json.dump(config, f)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    assert (tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.eos_token_ids) == (0, 2, (1, 4))


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json.*config\.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_no_chat_template_is_a_clear_error(tmp_path):
    model_dir = make_test_tokenizer(tmp_path)
    os.remove(os.path.join(model_dir, "chat_template.jinja"))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_pretrained(model_dir).apply_chat_template([{"role": "user", "content": "hi"}])


# ------------------------------------------------------------------------------------------- encode / decode
@_SETTINGS
@given(text=_TEXT)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


@_SETTINGS
@given(text=_TEXT, add_special_tokens=st.booleans())
def test_encode_matches_hf(tokenizer, hf_tokenizer, text, add_special_tokens):
    expected = hf_tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected


@pytest.mark.parametrize("text", [
    "", "Hello world", "<s>already has a bos", "a</s>b<|im_start|>user\nhi<|im_end|>", "中文 😀 café\n\n  x",
])
def test_encode_special_text_matches_hf(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer(text)["input_ids"]
    assert tokenizer.encode_batch([text, text]) == [hf_tokenizer(text)["input_ids"]] * 2
    assert tokenizer.encode(text)[:1] == [tokenizer.bos_token_id]  # the post-processor's BOS


@_SETTINGS
@given(ids=st.lists(st.integers(0, 511), max_size=30), skip=st.booleans())
def test_decode_matches_hf(tokenizer, hf_tokenizer, ids, skip):
    assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)


# ------------------------------------------------------------------------------------------- chat templates
_CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hi there! 你好 😀"}],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ],
    "tool": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "get_weather"}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
    ],
}
_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & here",
                                            "parameters": {"type": "object", "properties": {}}}}]

# Exercises what Hub templates use: namespace, loop controls, tojson options, dict(), {% generation %},
# reasoning fields, missing keys, extra variables and the special-token variables.
_FEATURE_TEMPLATE = """\
{%- set ns = namespace(system=none, n=0) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' %}{% set ns.system = m.content %}{% continue %}{% endif -%}
  {%- set ns.n = ns.n + 1 -%}
{%- endfor -%}
{{ bos_token }}[{{ ns.n }} turns]{% if ns.system %} SYS={{ ns.system }}{% endif %}
{% if tools %}TOOLS={{ tools | tojson(indent=2) }}
{% endif %}
{% for m in messages if m.role != 'system' %}
{{ m.role | upper }}:{% if m.content is defined %} {{ m.content }}{% endif %}
{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}
{% if m.tool_calls is defined %}{{ dict(calls=m.tool_calls) | tojson }}{% endif %}
{% if m.role == 'assistant' %}{% generation %}{{ eos_token }}{% endgeneration %}{% endif %}
{% if loop.index > 10 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}ASSISTANT:{% if enable_thinking is defined and not enable_thinking %} <think></think>{% endif %}{% endif %}
{{ pad_token }}|{{ unk_token | default('no-unk') }}"""


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("name", sorted(_CONVERSATIONS))
def test_chat_template_matches_hf(tokenizer, hf_tokenizer, name, add_generation_prompt):
    messages = _CONVERSATIONS[name]
    kwargs = dict(add_generation_prompt=add_generation_prompt, tools=_TOOLS if name == "tool" else None)
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    assert tokenizer.apply_chat_template(messages, **kwargs) == expected
    expected_ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    assert tokenizer.encode_chat(messages, **kwargs) == list(expected_ids)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("name", sorted(_CONVERSATIONS))
def test_feature_template_matches_hf(tokenizer, hf_tokenizer, name, add_generation_prompt):
    messages = [*_CONVERSATIONS[name], {"role": "assistant", "content": "ok", "reasoning": "because"}]
    kwargs = dict(add_generation_prompt=add_generation_prompt, tools=_TOOLS, chat_template=_FEATURE_TEMPLATE,
                  enable_thinking=False)
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    assert tokenizer.apply_chat_template(messages, **kwargs) == expected


def test_unknown_role_is_rejected_like_hf(tokenizer, hf_tokenizer):
    messages = [{"role": "narrator", "content": "Once upon a time"}]
    with pytest.raises(jinja2.TemplateError, match="Unknown role: narrator") as ours:
        tokenizer.apply_chat_template(messages)
    with pytest.raises(jinja2.TemplateError) as theirs:
        hf_tokenizer.apply_chat_template(messages, tokenize=False)
    assert str(ours.value) == str(theirs.value)


def test_template_in_config_and_named_templates(tmp_path):
    # Pre-transformers-5 layout: the template inside tokenizer_config.json.
    model_dir = make_test_tokenizer(tmp_path / "config", chat_template_in_config=True)
    assert not os.path.exists(os.path.join(model_dir, "chat_template.jinja"))
    assert Tokenizer.from_pretrained(model_dir).chat_template == TEST_CHAT_TEMPLATE
    # Named templates: additional_chat_templates/*.jinja, `tool_use` picked when tools are passed.
    model_dir = make_test_tokenizer(tmp_path / "named")
    os.makedirs(os.path.join(model_dir, "additional_chat_templates"))
    with open(os.path.join(model_dir, "additional_chat_templates", "tool_use.jinja"), "w") as f:
        f.write("TOOLS {{ tools | length }}{% for m in messages %} {{ m.content }}{% endfor %}")
    ours = Tokenizer.from_pretrained(model_dir)
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "hi"}]
    for tools in (None, _TOOLS):
        expected = hf.apply_chat_template(messages, tools=tools, tokenize=False)
        assert ours.apply_chat_template(messages, tools=tools) == expected
    assert ours.apply_chat_template(messages, tools=_TOOLS) == "TOOLS 1 hi"


# ------------------------------------------------------------------------------------------- streaming
def _stream(tokenizer, ids, skip_special_tokens=True, prompt_ids=()):
    detokenizer = tokenizer.detokenizer(prompt_ids, skip_special_tokens=skip_special_tokens)
    pieces = [detokenizer.add(i) for i in ids]
    return pieces, detokenizer.flush(), detokenizer


def test_multibyte_character_split_across_tokens(tokenizer):
    ids = tokenizer.encode("🦀x", add_special_tokens=False)
    assert len(ids) >= 3  # precondition: the crab's four bytes span several tokens
    pieces, tail, detokenizer = _stream(tokenizer, ids)
    assert pieces[:len(ids) - 2] == [""] * (len(ids) - 2)
    assert "".join(pieces) == "🦀x" and tail == ""
    assert detokenizer.text == "🦀x" and detokenizer.output_ids == ids


@_SETTINGS
@given(text=_TEXT.map(lambda s: s.replace("\ufffd", "")), skip=st.booleans())
def test_streaming_never_emits_partial_characters(tokenizer, text, skip):
    ids = tokenizer.encode(text + "<|im_end|>", add_special_tokens=True)
    pieces, tail, _ = _stream(tokenizer, ids, skip_special_tokens=skip)
    assert all("\ufffd" not in piece for piece in pieces)
    assert tail == ""
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip)


@_SETTINGS
@given(ids=st.lists(st.integers(0, 511), max_size=24), skip=st.booleans())
def test_stop_at_any_point(tokenizer, ids, skip):
    # Arbitrary ids, invalid UTF-8 included: wherever the stream stops, pieces + flush == the full decode.
    for stop in range(len(ids) + 1):
        pieces, tail, detokenizer = _stream(tokenizer, ids[:stop], skip_special_tokens=skip)
        assert "".join(pieces) + tail == tokenizer.decode(ids[:stop], skip_special_tokens=skip)
        assert detokenizer.text == "".join(pieces) + tail


@_SETTINGS
@given(prompt=_TEXT, output=_TEXT.map(lambda s: s.replace("\ufffd", "")))
def test_streaming_with_prompt_context(tokenizer, prompt, output):
    prompt_ids = tokenizer.encode(prompt)
    output_ids = tokenizer.encode(output, add_special_tokens=False)
    pieces, tail, _ = _stream(tokenizer, output_ids, prompt_ids=prompt_ids)
    assert "".join(pieces) + tail == tokenizer.decode(output_ids)  # == output unless it spells "<s>" etc.
    assert all("\ufffd" not in piece for piece in pieces)


def test_streaming_several_tokens_per_step(tokenizer):
    text = "speculative 解码 emits 🚀 several tokens per step"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.add(ids[i:i + 3]) for i in range(0, len(ids), 3)]
    assert "".join(pieces) + detokenizer.flush() == text


def test_streaming_decodes_a_bounded_window(tokenizer, monkeypatch):
    text = "Streaming 长文本 with emoji 🎉 and accents é. " * 60
    ids = tokenizer.encode(text, add_special_tokens=False)
    window_lengths = []
    decode = Tokenizer.decode

    def recording_decode(self, token_ids, skip_special_tokens=True):
        window_lengths.append(len(token_ids))
        return decode(self, token_ids, skip_special_tokens)

    monkeypatch.setattr(Tokenizer, "decode", recording_decode)
    pieces, tail, detokenizer = _stream(tokenizer, ids)
    monkeypatch.undo()
    assert "".join(pieces) + tail == text
    assert len(ids) > 1000 and max(window_lengths) <= 16  # O(1) per token, not O(sequence length)
    assert len(detokenizer._ids) < 300  # ids behind the window are dropped


def _sentencepiece_style_tokenizer() -> Tokenizer:
    # Llama-2/Mistral layout: Metaspace pre-tokenizer, <0xNN> byte-fallback tokens, a decoder that strips the
    # leading space. Its decode is not local: one invalid byte turns the whole byte run into U+FFFDs.
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from models.synthetic import _BUILTIN_CORPUS

    backend = Backend(models.BPE(byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    backend.train_from_iterator(list(_BUILTIN_CORPUS) * 4, trainer=trainer)
    serialized = json.loads(backend.to_str())
    vocab = serialized["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return Tokenizer(Backend.from_str(json.dumps(serialized)),
                     special_tokens={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    return _sentencepiece_style_tokenizer()


@_SETTINGS
@given(ids=st.lists(st.integers(0, 655), max_size=24), skip=st.booleans())
def test_stop_at_any_point_byte_fallback(sentencepiece_tokenizer, ids, skip):
    tokenizer = sentencepiece_tokenizer
    assert len(tokenizer.byte_fallback_ids) == 256 and tokenizer.vocab_size == 656
    for stop in range(len(ids) + 1):
        pieces, tail, _ = _stream(tokenizer, ids[:stop], skip_special_tokens=skip)
        assert "".join(pieces) + tail == tokenizer.decode(ids[:stop], skip_special_tokens=skip)


@pytest.mark.parametrize("skip", [True, False])
def test_skipped_special_token_inside_a_byte_run(sentencepiece_tokenizer, skip):
    # Found by the property test above: with special tokens skipped, `<0x00> <unk> <0x80>` decodes as one byte
    # run (invalid UTF-8: one U+FFFD per byte), so "\x00" must not be emitted when <unk> arrives.
    tokenizer = sentencepiece_tokenizer
    ids = [tokenizer.token_to_id(t) for t in ("<0x00>", "<unk>", "<0x80>")]
    assert ids[1] in tokenizer.special_token_ids
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    assert full == ("\ufffd\ufffd" if skip else "\x00<unk>\ufffd")
    pieces, tail, _ = _stream(tokenizer, ids, skip_special_tokens=skip)
    assert "".join(pieces) + tail == full
    assert pieces == ["", "", ""] if skip else pieces[1] == "\x00<unk>"


@_SETTINGS
@given(text=_TEXT.map(lambda s: s.replace("\ufffd", "")))
def test_streaming_byte_fallback_text(sentencepiece_tokenizer, text):
    tokenizer = sentencepiece_tokenizer
    ids = tokenizer.encode(text)
    pieces, tail, _ = _stream(tokenizer, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + tail == tokenizer.decode(ids)
    # In context the first word keeps the space that decoding the output alone strips.
    prompt_ids = tokenizer.encode("Say:")
    pieces, tail, _ = _stream(tokenizer, ids, prompt_ids=prompt_ids)
    assert "".join(pieces) + tail == tokenizer.decode(prompt_ids + ids)[len("Say:"):]
