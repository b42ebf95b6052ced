"""OpenAI response bodies and Server-Sent Event chunks for one request's choices (`ResponseBuilder`: prompt p's
sample j is choice p * n + j), built from `Delta`s (what one sample gained: the instance makes them from the
engine's step outputs, the gateway from meshserve.v1 responses); logprobs in OpenAI's two layouts (chat's `content`
list, completions' parallel lists); usage with the prefix-cache hits as `cached_tokens`; `sse` framing."""
from __future__ import annotations

import dataclasses
import json

DONE = b"data: [DONE]\n\n"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character each byte is written as in a token string -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _Choice:
    __slots__ = ("text", "logprobs", "finish_reason", "started", "offset", "completion_tokens")

    def __init__(self, echo: str | None):
        self.text: list[str] = [echo] if echo else []
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.started = False  # a streamed choice's first chunk went out (it carries the echo)
        self.offset = len(echo or "")  # completions' text_offset of the next token
        self.completion_tokens = 0


class ResponseBuilder:
    """The choices of one chat or completions request. `add` records a step output (for the final body);
    `chunk` records it and returns its stream chunk."""

    def __init__(self, *, chat: bool, response_id: str, model: str, created: int, n: int, prompt_lengths: list[int],
                 tokenizer, logprobs: int | None, echo_texts: list[str | None] | None = None,
                 include_usage: bool = False):
        """prompt_lengths: each prompt's tokens (0 where not known yet: a delta's prompt_tokens sets it)."""
        self.chat, self.id, self.model, self.created, self.n = chat, response_id, model, created, n
        self.tokenizer = tokenizer
        self.want_logprobs = logprobs is not None
        self.include_usage = include_usage
        self.prompt_lengths = list(prompt_lengths)
        self.cached_tokens = [0] * len(prompt_lengths)
        echoes = echo_texts or [None] * len(prompt_lengths)
        self.choices = [_Choice(echoes[p]) for p in range(len(prompt_lengths)) for _ in range(n)]
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
        if piece and all(c in _BYTE_LEVEL for c in piece):
            return [_BYTE_LEVEL[c] for c in piece]
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
        return i, choice

    def add(self, prompt_index: int, out: Delta) -> None:
        _, choice = self._record(prompt_index, out)
        choice.text.append(out.text)
        if self.want_logprobs and out.logprobs:
            choice.logprobs.extend(out.logprobs)

    def first_chunks(self) -> list[dict]:
        """Chat: each choice's first chunk, with the role; completions: none."""
        if not self.chat:
            return []
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for i in range(len(self.choices))]

    def chunk(self, prompt_index: int, out: Delta) -> dict | None:
        """The stream chunk of one delta; None when it carries nothing (text held back mid-character)."""
        i, choice = self._record(prompt_index, out)
        text = out.text
        if not choice.started:
            choice.started = True
            text = "".join(choice.text) + text  # the echo
        lps = out.logprobs if self.want_logprobs and out.logprobs else None
        if not text and lps is None and not out.finished:
            return None
        if self.chat:
            logprobs = {"content": self._chat_logprobs(lps), "refusal": None} if lps else None
            body = {"index": i, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                    "finish_reason": choice.finish_reason}
        else:
            logprobs = self._completion_logprobs(choice, lps) if lps else None
            body = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason}
        return self._chunk(body)

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
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)}}

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
                choices.append({"index": i, "message": {"role": "assistant", "content": text, "refusal": None},
                                "logprobs": logprobs, "finish_reason": c.finish_reason})
            else:
                logprobs = self._completion_logprobs(c, c.logprobs) if self.want_logprobs else None
                choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}
