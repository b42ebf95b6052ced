"""Reasoning parsers: the split per parser, streaming equal to the whole-text split for any split of the text, and
where reasoning ends."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.api.reasoning import REASONING_PARSERS, reasoning_parser

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]


@pytest.mark.parametrize("text, expected", [
    ("<think>\nLet me see.\n</think>\n\nIt is 4.", ("Let me see.", "It is 4.")),
    ("Let me see.</think>It is 4.", ("Let me see.", "It is 4.")),  # <think> was in the prompt
    ("Still thinking <thi", ("Still thinking <thi", None)),  # cut off inside reasoning
    ("<think>\n\n</think>\n\nHi", (None, "Hi")),
    ("a <think> b </think> c </think> d", ("a <think> b", "c </think> d")),
    ("", (None, None)),
])
def test_deepseek_r1(text, expected):
    assert R1.split(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("<think>\nLet me see.\n</think>\n\nIt is 4.", ("Let me see.", "It is 4.")),
    ("\n<think>x</think>y", ("x", "y")),
    ("It is 4.", (None, "It is 4.")),
    ("Not reasoning</think> after", (None, "Not reasoning</think> after")),
    ("<think>cut off", ("cut off", None)),
    ("<thi", (None, "<thi")),
    ("  ", (None, None)),
])
def test_qwen3(text, expected):
    assert QWEN3.split(text) == expected


def test_in_reasoning_overrides_the_default():
    assert QWEN3.split("x</think>y", in_reasoning=True) == ("x", "y")
    assert R1.split("<think>x</think>y", in_reasoning=False) == (None, "<think>x</think>y")
    assert QWEN3.reasoning_end_index("", in_reasoning=False) == 0


def test_reasoning_end_index():
    assert R1.reasoning_end_index("abc</think>\n") == len("abc</think>")
    assert R1.reasoning_end_index("abc</thi") is None
    assert QWEN3.reasoning_end_index("") is None and QWEN3.reasoning_end_index(" <th") is None
    assert QWEN3.reasoning_end_index("Hello") == 0
    assert QWEN3.reasoning_end_index("<think>a</think>{") == len("<think>a</think>")


def test_streaming_holds_a_partial_end_tag():
    p = R1()
    assert p.feed("<think>ab</th") == ("ab", None)
    assert p.feed("x") == ("</thx", None)
    assert p.feed("</think>  ") == (None, None)
    assert p.feed(" ok") == (None, "ok")
    assert p.finish() == (None, None) and p.content_start == len("<think>ab</thx</think>")


def test_unknown_name():
    with pytest.raises(ValueError, match="^reasoning_parser: unknown parser 'r2'"):
        reasoning_parser("r2")


FRAGMENTS = ["<think>", "</think>", "<think", "</th", "<", "/", ">", "think", "a", "bc", " ", "\n", "é", "\U0001F600"]


@st.composite
def split_text(draw):
    text = "".join(draw(st.lists(st.sampled_from(FRAGMENTS), max_size=12)))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=6)))
    return text, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("in_reasoning", [None, True, False])
@settings(derandomize=True, max_examples=150, deadline=None)
@given(case=split_text())
def test_streaming_equals_split(name, in_reasoning, case):
    text, pieces = case
    cls = REASONING_PARSERS[name]
    parser, reasoning, content, ends = cls(in_reasoning), [], [], []
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning.append(r or "")
        content.append(c or "")
        ends.append(parser.content_start)
    r, c = parser.finish()
    reasoning.append(r or "")
    content.append(c or "")
    whole = cls.split(text, in_reasoning)
    assert ("".join(reasoning) or None, "".join(content) or None) == whole == parser.result()
    end = cls.reasoning_end_index(text, in_reasoning)
    assert all(e is None or e == end for e in ends)  # once known, it never moves
    if end is not None:
        assert cls.split(text[end:], False)[1] == whole[1]


def test_the_parsers_follow_the_shared_table_of_reasoning_formats():
    from serving.params import CHANNEL_REASONING, REASONING_FORMATS
    assert set(REASONING_FORMATS) | set(CHANNEL_REASONING) == set(REASONING_PARSERS)
    for name, (start, end, inside) in REASONING_FORMATS.items():
        p = REASONING_PARSERS[name]
        assert (p.START, p.END, p.default_in_reasoning is True) == (start, end, inside)


# GPT-OSS's harmony format (openai/harmony's spec): what the model writes after the prompt's `<|start|>assistant`,
# its stop tokens <|return|> / <|call|> usually cut off by the engine (both forms here)
HARMONY = {
    "analysis then final": (
        "<|channel|>analysis<|message|>User asks 2+2. Simple.<|end|><|start|>assistant<|channel|>final"
        "<|message|>2 + 2 = 4.<|return|>", ("User asks 2+2. Simple.", "2 + 2 = 4."), []),
    "final only, no stop token": ("<|channel|>final<|message|>Hi there", (None, "Hi there"), []),
    "a tool call after analysis": (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.get_weather <|constrain|>json<|message|>{\"location\": \"Paris\"}",
        ("Need the weather.", None), [("get_weather", "{\"location\": \"Paris\"}")]),
    "the recipient in the role, a preamble, two calls": (
        "<|channel|>commentary<|message|>Checking both.<|end|><|start|>assistant to=functions.a<|channel|>commentary"
        " json<|message|>{}<|call|><|start|>assistant<|channel|>commentary to=functions.b <|constrain|>json"
        "<|message|>{\"x\": 1}<|call|>", (None, "Checking both."), [("a", "{}"), ("b", "{\"x\": 1}")]),
    "not harmony": ("plain text <think>", (None, "plain text <think>"), []),
}


@pytest.mark.parametrize("case", HARMONY)
def test_harmony_channels_and_tool_calls(case):
    from serving.api.tools import tool_parser
    text, (reasoning, content), calls = HARMONY[case]
    r, c = reasoning_parser("harmony").split(text)
    assert r == reasoning
    content_text, parsed = tool_parser("harmony").parse(c or "")
    assert content_text == content
    assert [(call.name, call.arguments) for call in parsed] == calls


@settings(derandomize=True, max_examples=100, deadline=None)
@given(case=st.sampled_from(sorted(HARMONY)), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_harmony_streaming_equals_split(case, cuts):
    """Any split of the text into deltas (markers cut anywhere) gives the whole text's split, through both parsers."""
    from serving.api.tools import tool_parser
    text = HARMONY[case][0]
    cuts = sorted(min(c, len(text)) for c in cuts)
    parser, tools, reasoning, events = reasoning_parser("harmony")(), tool_parser("harmony")(), [], []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        r, c = parser.feed(text[a:b])
        reasoning.append(r or "")
        events += tools.feed(c or "")
    r, c = parser.finish()
    reasoning.append(r or "")
    events += tools.feed(c or "") + tools.finish()
    whole = reasoning_parser("harmony").split(text)
    assert ("".join(reasoning) or None) == whole[0]
    content, calls = tool_parser("harmony").parse(whole[1] or "")
    assert ("".join(e.content or "" for e in events) or None) == content
    assert [c.name for c in tools.result()[1]] == [c.name for c in calls]
