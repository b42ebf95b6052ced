"""Reasoning on the host: splits a model's generated text into `reasoning_content` and `content` at `<think>` /
`</think>`, whole (`split`) or streamed (`feed`/`finish`), for the --reasoning_parser names `deepseek_r1` and
`qwen3`, and by the harmony format's channels for `harmony` (GPT-OSS); and where reasoning ends in the text
(`reasoning_end_index`), so a grammar can start after it. Pure Python: no engine, no tokenizer."""
from __future__ import annotations

import re
from typing import ClassVar

Deltas = tuple[str | None, str | None]


def held(buf: str, marker: str) -> int:
    """Length of the longest end of `buf` that could begin `marker`: streamed text to hold back until the next delta
    (the reasoning and tool-call parsers' markers)."""
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


class ReasoningParser:
    """Streaming split of one request's output: `feed` each text delta for its (reasoning, content) deltas, then
    `finish`. Any split of the text gives the same concatenations as `split` of the whole.

    Reasoning is the text inside `<think>`...`</think>` (to the end if `</think>` never comes), stripped; content is
    the rest, its leading whitespace stripped; empty is None. `in_reasoning` says where the output starts: True
    inside reasoning (the prompt opened `<think>`; a leading `<think>` is skipped anyway), False in content with no
    reasoning at all (thinking turned off), None the parser's own rule."""
    name: ClassVar[str]
    default_in_reasoning: ClassVar[bool | None]
    START, END = "<think>", "</think>"
    markers: ClassVar[tuple[str, ...]] = (START, END)  # what decoded text must keep, even where special tokens

    def __init__(self, in_reasoning: bool | None = None):
        in_reasoning = self.default_in_reasoning if in_reasoning is None else in_reasoning
        self._mode = {None: "start", True: "start_reasoning", False: "content"}[in_reasoning]
        self._buf = ""
        self._offset = 0  # index of _buf[0] in the text fed so far
        # Where content begins in the text fed so far (just after `</think>`; 0 without reasoning), None until known.
        self.content_start: int | None = 0 if in_reasoning is False else None
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._pending_ws = ""  # trailing whitespace of reasoning: dropped if reasoning ends there
        self._reasoning_started = self._content_started = self._finished = False

    @classmethod
    def split(cls, text: str, in_reasoning: bool | None = None) -> Deltas:
        """(reasoning, content) of a whole output."""
        parser = cls(in_reasoning)
        parser.feed(text)
        parser.finish()
        return parser.result()

    @classmethod
    def reasoning_end_index(cls, text: str, in_reasoning: bool | None = None) -> int | None:
        """Where content begins in `text` (0 if there is no reasoning), or None while `text` is still reasoning or
        could still open it. Once known for a prefix of an output, it holds for the whole output."""
        parser = cls(in_reasoning)
        parser.feed(text)
        return parser.content_start

    def feed(self, text: str) -> Deltas:
        if self._finished:
            raise RuntimeError(f"{self.name} reasoning parser: feed after finish")
        self._buf += text
        mark = len(self._reasoning), len(self._content)
        while self._step(final=False):
            pass
        return self._since(mark)

    def finish(self) -> Deltas:
        mark = len(self._reasoning), len(self._content)
        if not self._finished:
            while self._step(final=True):
                pass
            assert not self._buf, f"{self.name} reasoning parser left {self._buf!r} unparsed"
            self._pending_ws, self._finished = "", True
        return self._since(mark)

    def result(self) -> Deltas:
        """(reasoning, content) so far; the whole answer once finished."""
        return "".join(self._reasoning) or None, "".join(self._content) or None

    def _step(self, final: bool) -> bool:
        """Consume what can be decided from the front of `_buf`; True if it should run again."""
        buf = self._buf
        if self._mode in ("start", "start_reasoning"):
            head = buf.lstrip()
            if head.startswith(self.START):
                self._consume(len(buf) - len(head) + len(self.START))
                self._mode = "reasoning"
            elif self.START.startswith(head) and not final:
                return False
            elif self._mode == "start_reasoning":
                self._mode = "reasoning"
            else:
                self._mode, self.content_start = "content", self._offset
            return True
        if self._mode == "reasoning":
            end = buf.find(self.END)
            if end >= 0:
                self._add_reasoning(buf[:end])
                self._consume(end + len(self.END))
                self._pending_ws, self._mode, self.content_start = "", "content", self._offset
                return True
            keep = 0 if final else held(buf, self.END)
            self._add_reasoning(buf[:len(buf) - keep])
            self._consume(len(buf) - keep)
            return False
        text = buf if self._content_started else buf.lstrip()
        if text:
            self._content_started = True
            self._content.append(text)
        self._consume(len(buf))
        return False

    def _consume(self, n: int) -> None:
        self._buf = self._buf[n:]
        self._offset += n

    def _add_reasoning(self, text: str) -> None:
        text = self._pending_ws + text
        if not self._reasoning_started:
            text = text.lstrip()
        head = text.rstrip()
        self._pending_ws = text[len(head):]
        if head:
            self._reasoning_started = True
            self._reasoning.append(head)

    def _since(self, mark: tuple[int, int]) -> Deltas:
        return "".join(self._reasoning[mark[0]:]) or None, "".join(self._content[mark[1]:]) or None


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and its distills: the chat template opens `<think>` in the prompt, so the output starts inside
    reasoning (a leading `<think>` is skipped); no `</think>` means all of it is reasoning."""
    name = "deepseek_r1"
    default_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: the output is content unless it opens with `<think>` (after whitespace); with thinking turned off the
    template closes an empty `<think></think>` in the prompt, so the output is content."""
    name = "qwen3"
    default_in_reasoning = None


# The harmony format's special tokens (GPT-OSS; openai/harmony's spec)
H_START, H_END, H_MESSAGE, H_CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
H_CONSTRAIN, H_RETURN, H_CALL = "<|constrain|>", "<|return|>", "<|call|>"
HARMONY_MARKERS = (H_START, H_END, H_MESSAGE, H_CHANNEL, H_CONSTRAIN, H_RETURN, H_CALL)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(H_CHANNEL) + r"(\w+)")


class HarmonyReasoningParser(ReasoningParser):
    """GPT-OSS's harmony format: the output is messages `[<|start|>assistant]<|channel|>CH[ to=R][ <|constrain|>T]
    <|message|>BODY` each ended by `<|end|>` (or `<|call|>` / `<|return|>`, the stop tokens, usually not in the
    text). The `analysis` channel is reasoning; `final` and a `commentary` message to no one (a preamble) are content;
    a message to `functions.NAME` is a tool call, passed on in content as `<|channel|>commentary to=functions.NAME
    <|constrain|>json<|message|>ARGS<|call|>` for the `harmony` tool parser (serving.api.tools). An output that does
    not open with a header is content. Text between messages (none in the format) is dropped."""
    name = "harmony"
    default_in_reasoning = None
    START, END = H_CHANNEL + "analysis" + H_MESSAGE, H_END  # END: reasoning tokens are counted up to it
    markers = HARMONY_MARKERS
    _TERMINATORS = (H_END, H_CALL, H_RETURN, H_START)

    def __init__(self, in_reasoning: bool | None = None):
        super().__init__(in_reasoning)
        self._mode = "content" if in_reasoning is False else "header"
        self._kind = ""  # the current message's: "reasoning", "content" or "call"
        self._seen_header = False

    def _step(self, final: bool) -> bool:
        buf = self._buf
        if self._mode == "content":  # not harmony: all content
            if buf:
                self._content.append(buf)
                self._consume(len(buf))
            return False
        if self._mode == "header":
            head = buf.lstrip()
            if not head:  # whitespace: kept until what follows it decides
                if final:
                    self._consume(len(buf))
                return False
            if not head.startswith((H_START, H_CHANNEL)):
                if not final and (H_START.startswith(head) or H_CHANNEL.startswith(head)):
                    return False
                if not self._seen_header:  # not harmony: all content
                    self._mode, self.content_start = "content", self._offset
                    return True
                self._consume(len(buf) - len(head) + 1)  # stray text between messages
                return True
            self._seen_header = True
            end = head.find(H_MESSAGE)
            if end < 0:
                if final:
                    self._consume(len(buf))
                return False
            header = head[:end]
            self._consume(len(buf) - len(head) + end + len(H_MESSAGE))
            recipient = _RECIPIENT.search(header)
            channel = _CHANNEL.search(header)
            channel = channel.group(1) if channel else ""
            if recipient and recipient.group(1).startswith("functions."):
                self._kind = "call"
                self._content.append(f"{H_CHANNEL}commentary to={recipient.group(1)} {H_CONSTRAIN}json{H_MESSAGE}")
            else:
                self._kind = "reasoning" if channel == "analysis" else "content"
            if self._kind != "reasoning" and self.content_start is None:
                self.content_start = self._offset
            self._mode = "body"
            return True
        ends = [(i, t) for t in self._TERMINATORS if (i := buf.find(t)) >= 0]
        if ends:
            i, terminator = min(ends)
            self._body(buf[:i])
            self._consume(i if terminator == H_START else i + len(terminator))
            self._end_message()
            return True
        keep = 0 if final else max(held(buf, t) for t in self._TERMINATORS)
        self._body(buf[:len(buf) - keep])
        self._consume(len(buf) - keep)
        if final:
            self._end_message()
        return False

    def _body(self, text: str) -> None:
        if text:
            (self._reasoning if self._kind == "reasoning" else self._content).append(text)

    def _end_message(self) -> None:
        if self._kind == "call":
            self._content.append(H_CALL)
        self._mode, self._kind = "header", ""


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, HarmonyReasoningParser)}


def reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class for a --reasoning_parser name."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: unknown parser {name!r}; expected one of {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]
