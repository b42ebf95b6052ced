"""ResponseBuilder with the chat parsers: a choice's reasoning and tool calls, whole and streamed (any split of the
text gives chunks that add up to the whole response), finish_reason tool_calls, reasoning tokens in usage."""
import json

import pytest

from serving.api.responses import Delta, ResponseBuilder

THINK_ID, END_ID = 7, 8
OUTPUT = ("<think>\nthe user wants weather\n</think>\n\nLet me check.<tool_call>\n"
          '{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>')


class _Tokenizer:
    """Just enough of models.tokenizer.Tokenizer: `</think>` is one token."""

    def encode(self, text, add_special_tokens=True):
        return [END_ID] if text == "</think>" else [100 + ord(c) for c in text]


def builder(**kw):
    return ResponseBuilder(chat=True, response_id="chatcmpl-1", model="m", created=0, n=1, prompt_lengths=[5],
                           tokenizer=_Tokenizer(), logprobs=None, **kw)


def deltas(pieces):
    """The output split into `pieces`, with token ids: one per character, `</think>` one token."""
    out, done = [], 0
    for k, piece in enumerate(pieces):
        ids = []
        i = 0
        while i < len(piece):
            if piece.startswith("</think>", i):
                ids.append(END_ID)
                i += len("</think>")
            else:
                ids.append(100 + ord(piece[i]))
                i += 1
        done += len(ids)
        last = k == len(pieces) - 1
        out.append(Delta(0, piece, token_ids=ids, finish_reason="stop" if last else None,
                         completion_tokens=done if last else 0))
    return out


def splits(text):
    """Whole, a token at a time (`</think>` is one), in thirds."""
    yield [text]
    head, sep, tail = text.partition("</think>")
    yield [*head, sep, *tail]
    yield [text[:20], text[20:61], text[61:]]


@pytest.mark.parametrize("pieces", list(splits(OUTPUT)), ids=["whole", "tokens", "thirds"])
def test_reasoning_and_tool_calls_whole_and_streamed(pieces):
    whole = builder(reasoning_parser="qwen3", tool_parser="hermes")
    for d in deltas(pieces):
        whole.add(0, d)
    body = whole.response()
    message, choice = body["choices"][0]["message"], body["choices"][0]
    assert message["reasoning_content"] == "the user wants weather"
    assert message["content"] == "Let me check."
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": json.dumps({"city": "Paris"})}
    assert choice["finish_reason"] == "tool_calls"
    reasoning_tokens = len("<think>\nthe user wants weather\n") + 1
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": reasoning_tokens}

    stream = builder(reasoning_parser="qwen3", tool_parser="hermes")
    chunks = [c for d in deltas(pieces) for c in stream.chunks(0, d)]
    got = {"reasoning_content": "", "content": "", "arguments": "", "name": None}
    for c in chunks:
        delta = c["choices"][0]["delta"]
        got["reasoning_content"] += delta.get("reasoning_content", "")
        got["content"] += delta.get("content", "")
        for tc in delta.get("tool_calls", ()):
            assert tc["index"] == 0
            if "id" in tc:
                assert got["name"] is None
                got["name"] = tc["function"]["name"]
            got["arguments"] += tc["function"]["arguments"]
    assert got == {"reasoning_content": message["reasoning_content"], "content": message["content"],
                   "arguments": call["function"]["arguments"], "name": "weather"}
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert stream.usage()["completion_tokens_details"] == {"reasoning_tokens": reasoning_tokens}


def test_no_parsers_is_plain_content():
    b = builder()
    for d in deltas([OUTPUT]):
        b.add(0, d)
    body = b.response()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": OUTPUT, "refusal": None}
    assert body["choices"][0]["finish_reason"] == "stop" and "completion_tokens_details" not in body["usage"]


def test_reasoning_never_ended_counts_every_token():
    b = builder(reasoning_parser="deepseek_r1")
    for d in deltas(["still thinking", " about it"]):
        b.add(0, d)
    body = b.response()
    assert body["choices"][0]["message"]["reasoning_content"] == "still thinking about it"
    assert body["choices"][0]["message"]["content"] is None
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == len("still thinking about it")


def test_qwen3_without_reasoning_counts_none():
    b = builder(reasoning_parser="qwen3")
    for d in deltas(["Hello </think> there"]):
        b.add(0, d)
    body = b.response()
    assert body["choices"][0]["message"]["reasoning_content"] is None
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
