"""OpenAI response bodies and Server-Sent Event chunks for one request's choices (`ResponseBuilder`: prompt p's
sample j is choice p * n + j), built from `Delta`s (what one sample gained: the instance makes them from the
engine's step outputs, the gateway from meshserve.v1 responses); logprobs in OpenAI's two layouts (chat's `content`
list, completions' parallel lists); usage with the prefix-cache hits as `cached_tokens`; `sse` framing."""
from __future__ import annotations

import dataclasses
import json

from models.tokenizer import BYTE_LEVEL_ALPHABET
from serving.api import reasoning as reasoning_api
from serving.api import tools as tools_api

DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    """One Server-Sent Event: `data: <json>` and a blank line."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


@dataclasses.dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-n alternatives (token id, logprob), best first


@dataclasses.dataclass(slots=True)
class Delta:
    """What one sample of one prompt gained: its new text and tokens' logprobs; `finish_reason` ("stop", "length")
    on its last, with its totals. `prompt_tokens` / `cached_tokens`: the prompt's length and prefix-cache hits where
    known (0: not in this delta)."""
    index: int
    text: str
    logprobs: list | None = None  # TokenLogprob-shaped: token_id, logprob, top
    finish_reason: str | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    token_ids: list[int] | None = None  # the new tokens, where known (they count the reasoning tokens)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _Choice:
    __slots__ = ("text", "logprobs", "finish_reason", "started", "offset", "completion_tokens", "reasoning", "tools",
                 "tokens_seen", "reasoning_end")

    def __init__(self, echo: str | None, reasoning: reasoning_api.ReasoningParser | None = None,
                 tools: tools_api.ToolParser | None = None):
        self.text: list[str] = [echo] if echo else []
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.started = False  # a streamed choice's first chunk went out (it carries the echo)
        self.offset = len(echo or "")  # completions' text_offset of the next token
        self.completion_tokens = 0
        self.reasoning = reasoning  # chat with a reasoning parser: splits reasoning_content from content
        self.tools = tools  # chat with tools to parse: turns content into tool_calls
        self.tokens_seen = 0  # output tokens seen in deltas
        self.reasoning_end: int | None = None  # output tokens up to and including the reasoning's end marker


class ResponseBuilder:
    """The choices of one chat or completions request. `add` records a step output (for the final body);
    `chunk` records it and returns its stream chunk."""

    def __init__(self, *, chat: bool, response_id: str, model: str, created: int, n: int, prompt_lengths: list[int],
                 tokenizer, logprobs: int | None, echo_texts: list[str | None] | None = None,
                 include_usage: bool = False, reasoning_parser: str = "", tool_parser: str = ""):
        """prompt_lengths: each prompt's tokens (0 where not known yet: a delta's prompt_tokens sets it).
        Chat only: `reasoning_parser` (serving.api.reasoning) splits each choice's reasoning_content from its content;
        `tool_parser` (serving.api.tools) parses the content into tool_calls (a request with tools to call)."""
        self.chat, self.id, self.model, self.created, self.n = chat, response_id, model, created, n
        self.tokenizer = tokenizer
        self.want_logprobs = logprobs is not None
        self.include_usage = include_usage
        self.prompt_lengths = list(prompt_lengths)
        self.cached_tokens = [0] * len(prompt_lengths)
        echoes = echo_texts or [None] * len(prompt_lengths)
        reasoning_cls = reasoning_api.reasoning_parser(reasoning_parser) if chat and reasoning_parser else None
        tools_cls = tools_api.tool_parser(tool_parser) if chat and tool_parser else None
        self.reasoning = reasoning_cls is not None
        self.choices = [_Choice(echoes[p], reasoning_cls and reasoning_cls(), tools_cls and tools_cls())
                        for p in range(len(prompt_lengths)) for _ in range(n)]
        # The reasoning's end marker as one token id, when it is one: reasoning tokens are counted up to it.
        self._reasoning_end_id = None
        if reasoning_cls is not None and tokenizer is not None:
            ids = tokenizer.encode(reasoning_cls.END, add_special_tokens=False)
            self._reasoning_end_id = ids[0] if len(ids) == 1 else None
        self._token_text: dict[int, str] = {}
        decoder = getattr(getattr(tokenizer, "backend", None), "decoder", None)  # a `tokenizers` decoder
        self._byte_level = decoder is not None and b'"ByteLevel"' in decoder.__getstate__()

    # ------------------------------------------------------------------ tokens and logprobs
    def token_text(self, token_id: int) -> str:
        s = self._token_text.get(token_id)
        if s is None:
            s = (self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer is not None
                 else f"token_id:{token_id}")
            self._token_text[token_id] = s
        return s

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (a byte-level BPE token may hold part of a character), else its text's UTF-8."""
        piece = self.tokenizer.id_to_token(token_id) if self._byte_level else None
        if piece and all(c in BYTE_LEVEL_ALPHABET for c in piece):
            return [BYTE_LEVEL_ALPHABET[c] for c in piece]
        return list(self.token_text(token_id).encode("utf-8"))

    def _chat_logprobs(self, lps) -> list[dict]:
        def entry(t, lp):
            return {"token": self.token_text(t), "logprob": lp, "bytes": self.token_bytes(t)}
        return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]

    def _completion_logprobs(self, choice: _Choice, lps) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            s = self.token_text(lp.token_id)
            top = {self.token_text(t): v for t, v in lp.top}
            top.setdefault(s, lp.logprob)
            out["tokens"].append(s)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(choice.offset)
            choice.offset += len(s)
        return out

    # ------------------------------------------------------------------ outputs
    def _record(self, prompt_index: int, out: Delta) -> tuple[int, _Choice]:
        i = prompt_index * self.n + out.index
        choice = self.choices[i]
        if out.prompt_tokens:
            self.prompt_lengths[prompt_index] = out.prompt_tokens
        if out.finished:
            choice.finish_reason = out.finish_reason
            choice.completion_tokens = out.completion_tokens
            if out.index == 0:
                self.cached_tokens[prompt_index] = out.cached_tokens
        if choice.reasoning is not None and out.token_ids:
            if choice.reasoning_end is None and self._reasoning_end_id is not None:
                for j, t in enumerate(out.token_ids):
                    if t == self._reasoning_end_id:
                        choice.reasoning_end = choice.tokens_seen + j + 1
                        break
            choice.tokens_seen += len(out.token_ids)
        return i, choice

    def _parse(self, choice: _Choice, text: str, final: bool) -> list[tuple[str, object]]:
        """A chat choice's new text through its parsers, in order: ("reasoning_content" | "content", text) and
        ("tool_call", an entry of delta.tool_calls). At the last delta the parsers finish, and a choice that made
        tool calls finishes with "tool_calls"."""
        events: list[tuple[str, object]] = []
        if choice.reasoning is not None:
            reasoning, content = choice.reasoning.feed(text) if text else (None, None)
            if final:
                more_reasoning, more_content = choice.reasoning.finish()
                reasoning = (reasoning or "") + (more_reasoning or "") or None
                content = (content or "") + (more_content or "") or None
            if reasoning:
                events.append(("reasoning_content", reasoning))
            text = content or ""
        if choice.tools is None:
            if text:
                events.append(("content", text))
            return events
        pieces = choice.tools.feed(text) if text else []
        if final:
            pieces += choice.tools.finish()
            choice.finish_reason = tools_api.finish_reason(choice.finish_reason, choice.tools.result()[1])
        for e in pieces:
            events.append(("content", e.content) if e.content is not None else ("tool_call", e.tool_call))
        return events

    def add(self, prompt_index: int, out: Delta) -> None:
        _, choice = self._record(prompt_index, out)
        choice.text.append(out.text)
        if choice.reasoning is not None or choice.tools is not None:
            self._parse(choice, out.text, out.finished)
        if self.want_logprobs and out.logprobs:
            choice.logprobs.extend(out.logprobs)

    def first_chunks(self) -> list[dict]:
        """Chat: each choice's first chunk, with the role; completions: none."""
        if not self.chat:
            return []
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for i in range(len(self.choices))]

    def chunks(self, prompt_index: int, out: Delta) -> list[dict]:
        """The stream chunks of one delta: none when it carries nothing (text held back mid-character, or by a
        parser); one, or with parsers one per run of text and one per tool-call entry, the first with the logprobs
        and the last with the finish_reason."""
        i, choice = self._record(prompt_index, out)
        text = out.text
        if not choice.started:
            choice.started = True
            text = "".join(choice.text) + text  # the echo
        if choice.reasoning is not None or choice.tools is not None:
            choice.text.append(out.text)
            return self._parsed_chunks(i, choice, out)
        lps = out.logprobs if self.want_logprobs and out.logprobs else None
        if not text and lps is None and not out.finished:
            return []
        if self.chat:
            logprobs = {"content": self._chat_logprobs(lps), "refusal": None} if lps else None
            body = {"index": i, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                    "finish_reason": choice.finish_reason}
        else:
            logprobs = self._completion_logprobs(choice, lps) if lps else None
            body = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason}
        return [self._chunk(body)]

    def _parsed_chunks(self, i: int, choice: _Choice, out: Delta) -> list[dict]:
        deltas: list[dict] = []
        for kind, value in self._parse(choice, out.text, out.finished):
            if kind == "tool_call":
                deltas.append({"tool_calls": [value]})
            elif deltas and "tool_calls" not in deltas[-1]:
                deltas[-1][kind] = deltas[-1].get(kind, "") + value
            else:
                deltas.append({kind: value})
        lps = out.logprobs if self.want_logprobs and out.logprobs else None
        if not deltas and (lps is not None or out.finished):
            deltas.append({})
        bodies = [{"index": i, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
        if lps is not None:
            bodies[0]["logprobs"] = {"content": self._chat_logprobs(lps), "refusal": None}
        if out.finished:
            bodies[-1]["finish_reason"] = choice.finish_reason
        return [self._chunk(b) for b in bodies]

    def _chunk(self, choice: dict) -> dict:
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    # ------------------------------------------------------------------ totals
    def usage(self) -> dict:
        completion = sum(c.completion_tokens for c in self.choices)
        prompt = sum(self.prompt_lengths)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)}}
        if self.reasoning:
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(map(self._reasoning_tokens, self.choices))}
        return usage

    def _reasoning_tokens(self, c: _Choice) -> int:
        """A finished choice's reasoning tokens, its end marker included: counted up to the marker's token when the
        deltas carry token ids; all of them when the reasoning never ended; else the reasoning text re-tokenized."""
        start = c.reasoning.content_start
        if start == 0:  # no reasoning
            return 0
        if start is None:
            return c.completion_tokens
        if c.reasoning_end is not None:
            return c.reasoning_end
        if self.tokenizer is None:
            return 0
        return len(self.tokenizer.encode("".join(c.text)[:start], add_special_tokens=False))

    def usage_chunk(self) -> dict:
        """The stream's last chunk when stream_options.include_usage: no choices, the usage."""
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": self.usage()}

    def response(self) -> dict:
        choices = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            if self.chat:
                logprobs = ({"content": self._chat_logprobs(c.logprobs), "refusal": None} if self.want_logprobs
                            else None)
                message = {"role": "assistant", "content": text, "refusal": None}
                if c.reasoning is not None:
                    message["reasoning_content"], message["content"] = c.reasoning.result()
                if c.tools is not None:
                    message["content"], calls = c.tools.result()
                    if calls:
                        message["tool_calls"] = [call.to_openai() for call in calls]
                choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": c.finish_reason})
            else:
                logprobs = self._completion_logprobs(c, c.logprobs) if self.want_logprobs else None
                choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}
