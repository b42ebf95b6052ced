"""`Tokenizer`: an HF tokenizer directory, or the tokenizer a GGUF file describes (`tokenizer_from_gguf`), behind
encode / decode / chat-template rendering, as transformers 5 does them; `IncrementalDetokenizer` for streaming text
that never emits half a UTF-8 character; `train_byte_level_bpe`. Details: docs/models.md."""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _BackendTokenizer
from tokenizers.models import BPE

from models.chat_template import render_chat_template
from models.gguf_files import gguf_files

# The named special tokens transformers passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# ChatML turns (any of the four roles, else an error) and the assistant prompt: the body of the templates the
# shipped tiny models and the test tokenizer carry.
CHATML_TURNS = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_REPLACEMENT_CHAR = "\ufffd"


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


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()  # what a ByteLevel decoder undoes: token-string character -> byte
# Prompt tokens kept as left context for the first decoded output token (vLLM uses the same number).
_DETOKENIZER_PROMPT_CONTEXT = 5


class Tokenizer:
    """Encode, decode and chat-format text for one model; built with `Tokenizer.from_pretrained(model_dir)`."""

    def __init__(
        self,
        backend: _BackendTokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_template: str | Mapping[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        pad_token_id: int | None = None,
    ):
        self.backend = backend
        # Only named tokens whose value is set, as strings: what transformers' `special_tokens_map` holds.
        self.special_tokens = {k: str(v) for k, v in (special_tokens or {}).items() if v is not None}
        self.chat_template = dict(chat_template) if isinstance(chat_template, Mapping) else chat_template
        self.bos_token_id = bos_token_id if bos_token_id is not None else self._token_id("bos_token")
        self.pad_token_id = pad_token_id if pad_token_id is not None else self._token_id("pad_token")
        # The tokenizer's own EOS first, then any extra stop tokens (e.g. from generation_config.json).
        eos = [self._token_id("eos_token"), *eos_token_ids]
        self.eos_token_ids = tuple(dict.fromkeys(i for i in eos if i is not None))
        self._special_ids = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self._shown_ids: frozenset[int] = frozenset()  # special tokens decoded even when skipping special tokens
        self._byte_fallback_ids = _byte_fallback_ids(backend)

    # ----------------------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> "Tokenizer":
        """The tokenizer of an HF directory, or of a GGUF model (file, split parts, or a directory holding one) from
        its metadata (`tokenizer_from_gguf`); a directory's own tokenizer.json wins over a GGUF's, with the GGUF's
        chat template when the directory has none."""
        model_dir = os.fspath(model_dir)
        tokenizer_path = os.path.join(model_dir, "tokenizer.json")
        if not (os.path.isdir(model_dir) and os.path.exists(tokenizer_path)) and gguf_files(model_dir):
            from models.gguf import GGUFModel  # the gguf package only for GGUF models
            return tokenizer_from_gguf(GGUFModel.open(model_dir).metadata, model_dir)
        if not os.path.isdir(model_dir):
            raise FileNotFoundError(f"tokenizer directory {model_dir!r} does not exist")
        if not os.path.exists(tokenizer_path):
            present = ", ".join(sorted(os.listdir(model_dir))) or "nothing"
            raise FileNotFoundError(
                f"no tokenizer.json in {model_dir!r} (found: {present}); meshserve needs the HF fast-tokenizer file, "
                "convert a sentencepiece/tiktoken tokenizer with transformers' save_pretrained first")
        backend = _BackendTokenizer.from_file(tokenizer_path)
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json")) or {}
        generation_config = _read_json(os.path.join(model_dir, "generation_config.json")) or {}

        if "added_tokens_decoder" not in config:
            # Legacy layout: transformers only reads special_tokens_map.json when the config has no token table.
            legacy_map = _read_json(os.path.join(model_dir, "special_tokens_map.json")) or {}
            config = {**config, **legacy_map}
        special_tokens = _named_special_tokens(config)
        _add_missing_tokens(backend, config, special_tokens)
        # A tokenizer saved with split_special_tokens encodes "<s>" in text as plain characters.
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))

        eos_from_generation = generation_config.get("eos_token_id")
        if isinstance(eos_from_generation, int):
            eos_from_generation = [eos_from_generation]
        chat_template = _load_chat_template(model_dir, config)
        if chat_template is None and gguf_files(model_dir):
            from models.gguf import GGUFModel
            chat_template = gguf_chat_templates(GGUFModel.open(model_dir).metadata)
        return cls(
            backend,
            special_tokens=special_tokens,
            chat_template=chat_template,
            eos_token_ids=tuple(eos_from_generation or ()),
            bos_token_id=None if special_tokens["bos_token"] else generation_config.get("bos_token_id"),
            pad_token_id=None if special_tokens["pad_token"] else generation_config.get("pad_token_id"),
        )

    def save_pretrained(self, out_dir: str | os.PathLike) -> None:
        """Writes this tokenizer as an HF directory (tokenizer.json, tokenizer_config.json, chat templates,
        generation_config.json) that `from_pretrained` reads back the same: how a GGUF's tokenizer travels with the
        Orbax checkpoint `models.convert` makes of it."""
        out_dir = os.fspath(out_dir)
        os.makedirs(out_dir, exist_ok=True)
        self.backend.save(os.path.join(out_dir, "tokenizer.json"))
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(dict(self.special_tokens), f, indent=1, ensure_ascii=False)
        with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump({"bos_token_id": self.bos_token_id, "eos_token_id": list(self.eos_token_ids),
                       "pad_token_id": self.pad_token_id}, f, indent=1)
        templates = self.chat_template if isinstance(self.chat_template, dict) else {"default": self.chat_template}
        for name, source in templates.items():
            if source is None:
                continue
            path = os.path.join(out_dir, CHAT_TEMPLATE_FILE) if name == "default" else \
                os.path.join(out_dir, CHAT_TEMPLATE_DIR, f"{name}.jinja")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(source)

    # ----------------------------------------------------------------------------------------- ids
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (what the embedding table must cover at least)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that `decode(..., skip_special_tokens=True)` drops."""
        return self._special_ids - self._shown_ids

    def special_token_id(self, token: str) -> int | None:
        """The id of `token` when it is a special token (shown or not), else None."""
        i = self.backend.token_to_id(token)
        return i if i in self._special_ids else None

    def show_special_tokens(self, tokens: Iterable[str]) -> list[str]:
        """Keeps these special tokens in decoded text even with `skip_special_tokens` (markers a tool-call or
        reasoning parser reads: `[TOOL_CALLS]`, `<|python_tag|>`, `<think>`); returns those that are special tokens
        here (the others decode as text anyway)."""
        shown = [t for t in tokens if self.backend.token_to_id(t) in self._special_ids]
        self._shown_ids = self._shown_ids | frozenset(self.backend.token_to_id(t) for t in shown)
        return shown

    @property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of sentencepiece byte tokens `<0x00>`..`<0xFF>` when the decoder falls back to bytes, else empty."""
        return self._byte_fallback_ids

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def _token_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    # ----------------------------------------------------------------------------------------- text
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens` the post-processor in tokenizer.json adds BOS/EOS.

        tokenizer_config.json's `add_bos_token` is not consulted: transformers 5 ignores it whenever a
        tokenizer.json exists, and matching `AutoTokenizer` token for token is the point.
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens and self._shown_ids:  # drop the skipped ones here: the backend would drop all
            skipped = self.special_token_ids
            return self.backend.decode([t for t in token_ids if t not in skipped], skip_special_tokens=False)
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
                    ) -> "IncrementalDetokenizer":
        """A streaming decoder for one request's output tokens; see `IncrementalDetokenizer`."""
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------------------------------------- chat
    def get_chat_template(self, chat_template: str | None = None, tools: Sequence[Any] | None = None) -> str:
        """The template source to render, chosen as transformers does (named templates, `tool_use` with tools)."""
        if isinstance(self.chat_template, dict):
            if chat_template is not None and chat_template in self.chat_template:
                return self.chat_template[chat_template]
            if chat_template is not None:
                return chat_template
            if tools is not None and "tool_use" in self.chat_template:
                return self.chat_template["tool_use"]
            if "default" in self.chat_template:
                return self.chat_template["default"]
            raise ValueError(f"the model has several chat templates and none is 'default'; pass one of "
                             f"{sorted(self.chat_template)} as chat_template")
        if chat_template is not None:
            return chat_template
        if self.chat_template is None:
            raise ValueError("the tokenizer has no chat template (none in tokenizer_config.json or "
                             f"{CHAT_TEMPLATE_FILE}); pass chat_template explicitly")
        return self.chat_template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` to the prompt string, equal to transformers' `apply_chat_template(tokenize=False)`.

        Extra keyword arguments reach the template as variables (e.g. `enable_thinking=False`); they override
        the special-token variables (`bos_token`, `eos_token`, ...) as in transformers. A template's
        `raise_exception(...)` surfaces as `jinja2.TemplateError`.
        """
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        if tools is not None:
            for tool in tools:
                if not isinstance(tool, Mapping):
                    raise TypeError(f"tools must be JSON-schema dicts, got {type(tool).__name__}: {tool!r}")
        if documents is not None:
            for document in documents:
                if not isinstance(document, Mapping):
                    raise TypeError(f"documents must be dicts with 'title' and 'text', got {document!r}")
        source = self.get_chat_template(chat_template, tools)
        return render_chat_template(source, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                    documents=documents, variables={**self.special_tokens, **template_kwargs})

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
        """Token ids of the rendered chat; the template supplies BOS itself, so no special tokens are added."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


def train_byte_level_bpe(texts, vocab_size: int, special_tokens, bos_token: str | None = None) -> _BackendTokenizer:
    """A byte-level BPE (GPT-2 pre-tokenisation) trained on `texts`, special tokens first (ids 0..n-1).
    Deterministic. With `bos_token` (one of the special tokens) the post-processor puts it in front of each
    sequence. Used by the test tokenizer and the tiny models' trainer."""
    from tokenizers import trainers
    backend = _BackendTokenizer(BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    if bos_token is not None:
        backend.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B:1",
                                          special_tokens=[(bos_token, backend.token_to_id(bos_token))]),
        ])
    return backend


class IncrementalDetokenizer:
    """Turns one request's output tokens into text pieces as they arrive.

    Text that ends in U+FFFD (a multi-byte character whose remaining bytes are still to come) is held back;
    `flush()` at the end releases whatever is left. The pieces concatenated equal `tokenizer.decode(output_ids)`
    (given the same `skip_special_tokens`), wherever the stream stops. Each step decodes only the tokens since the
    last emission plus the window before it (vLLM's prefix/read offsets), so the cost per token is O(1)
    amortised. `prompt_ids` give left context, so a first output token like sentencepiece's "▁Hello" keeps the
    space that decoding the output alone would strip (byte-level BPE decodes the same either way).

    Sentencepiece byte-fallback decoders turn a whole run of `<0xNN>` tokens into one U+FFFD per byte when
    any byte in the run is invalid, so text is also held while the output ends in a byte token (special tokens
    that are skipped do not end a run); otherwise an emitted character could later become U+FFFD in the full
    decode.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-_DETOKENIZER_PROMPT_CONTEXT:]) if len(prompt_ids) else []
        self._ids = context  # context + output ids not yet behind prefix_offset
        self._prefix_offset = 0  # start of the window decoded for context
        self._read_offset = len(context)  # end of what has already been emitted
        self.output_ids: list[int] = []
        self.text = ""  # everything emitted so far

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Append output token(s); returns the newly complete text (possibly "")."""
        new_ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        self.output_ids.extend(new_ids)
        self._ids.extend(new_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        new_text = decode(self._ids[self._prefix_offset:], self.skip_special_tokens)
        if (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR)
                or self._ends_in_byte_token()):
            return ""  # nothing new, or the last character (or byte run) may still change
        piece = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self._prefix_offset > 256:  # drop ids no window will look at again
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self.text += piece
        return piece

    def _ends_in_byte_token(self) -> bool:
        """Whether the last token decoding sees is a byte token. Skipped special tokens are invisible to the
        decoder, so bytes on both sides of one join the same run."""
        byte_ids = self.tokenizer.byte_fallback_ids
        if not byte_ids:
            return False
        skipped = self.tokenizer.special_token_ids if self.skip_special_tokens else ()
        for i in reversed(self._ids):
            if i not in skipped:
                return i in byte_ids
        return False

    def flush(self) -> str:
        """The text still held back (a trailing U+FFFD if the output really ends mid-character)."""
        decode = self.tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        new_text = decode(self._ids[self._prefix_offset:], self.skip_special_tokens)
        piece = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += piece
        return piece


# --------------------------------------------------------------------------------------------- helpers
def _read_json(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _byte_fallback_ids(backend: _BackendTokenizer) -> frozenset[int]:
    decoder = backend.decoder
    if decoder is None or b'"ByteFallback"' not in decoder.__getstate__():
        return frozenset()
    ids = (backend.token_to_id(f"<0x{byte:02X}>") for byte in range(256))
    return frozenset(i for i in ids if i is not None)


def _token_content(value: Any) -> str | None:
    # Configs store tokens as strings or as serialised AddedToken dicts ({"content": ..., "__type": "AddedToken"}).
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _named_special_tokens(config: Mapping[str, Any]) -> dict[str, str | None]:
    """The token variables transformers hands chat templates: the standard names, plus any other `*_token`
    string entry and the entries of a dict-valued `extra_special_tokens` (e.g. `image_token`)."""
    named: dict[str, str | None] = {name: _token_content(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    for key, value in config.items():
        if key.endswith("_token") and key not in named and (
                isinstance(value, str) or (isinstance(value, Mapping) and value.get("__type") == "AddedToken")):
            named[key] = _token_content(value)
    extra = config.get("extra_special_tokens")
    if isinstance(extra, Mapping):
        named.update({key: _token_content(value) for key, value in extra.items()})
    return named


def _add_missing_tokens(backend: _BackendTokenizer, config: Mapping[str, Any], special_tokens: Mapping[str, Any]):
    """Add tokens that tokenizer_config.json declares but tokenizer.json lacks, as transformers does on load."""
    vocab = backend.get_vocab(with_added_tokens=True)
    extra: list[AddedToken] = []
    for entry in (config.get("added_tokens_decoder") or {}).values():
        if isinstance(entry, Mapping) and entry.get("content") not in vocab:
            extra.append(AddedToken(
                entry["content"], single_word=entry.get("single_word", False), lstrip=entry.get("lstrip", False),
                rstrip=entry.get("rstrip", False), normalized=entry.get("normalized", True),
                special=entry.get("special", False)))
    named = [t for t in special_tokens.values() if t is not None]
    listed = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    listed = listed.values() if isinstance(listed, Mapping) else listed
    for token in [*named, *(_token_content(t) for t in listed)]:
        if token is not None and token not in vocab and all(token != e.content for e in extra):
            extra.append(AddedToken(token, special=True, normalized=False))
    if extra:
        backend.add_special_tokens([t for t in extra if t.special])
        backend.add_tokens([t for t in extra if not t.special])


def _load_chat_template(model_dir: str, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """Template files (transformers >= 4.50 layout) take priority over the config's `chat_template` entry."""
    templates: dict[str, str] = {}
    path = os.path.join(model_dir, CHAT_TEMPLATE_FILE)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            templates["default"] = f.read()
    extra_dir = os.path.join(model_dir, CHAT_TEMPLATE_DIR)
    if os.path.isdir(extra_dir):
        for name in sorted(os.listdir(extra_dir)):
            if name.endswith(".jinja"):
                with open(os.path.join(extra_dir, name), encoding="utf-8") as f:
                    templates[name.removesuffix(".jinja")] = f.read()
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    entry = config.get("chat_template")
    if isinstance(entry, list):  # [{"name": ..., "template": ...}, ...]
        return {item["name"]: item["template"] for item in entry}
    return entry


# --------------------------------------------------------------------------------------------- GGUF
# tokenizer.ggml.token_type values (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The splitting regexes of the original tokenizers, by the name llama.cpp's converter gives them in
# tokenizer.ggml.pre; applied one after another (each splits the pieces of the one before), as llama.cpp does.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    **{name: (_GPT2,) for name in ("gpt-2", "phi-2", "mpt", "olmo", "jais")},
    **{name: (r"\p{N}", _GPT2) for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")},
    **{name: (_LLAMA3,) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe")},
    **{name: (_QWEN2,) for name in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez")},
}
# Pre-tokenizers whose BPE looks a whole piece up in the vocabulary before merging (llama.cpp's ignore_merges)
_IGNORE_MERGES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")
_NAMED_IDS = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "sep_token": "seperator",
              "pad_token": "padding", "cls_token": "cls", "mask_token": "mask"}


def tokenizer_from_gguf(metadata: Mapping[str, Any], where: str) -> Tokenizer:
    """The Tokenizer of a GGUF model's metadata (`models.gguf.GGUFModel.metadata`); `where` names it in errors."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise FileNotFoundError(f"{where} carries no tokenizer (tokenizer.ggml.model / tokens); put the model's "
                                "tokenizer.json beside it")
    types = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if kind == "gpt2":
        backend = _byte_level_bpe(metadata, tokens, types, where)
    elif kind == "llama":
        backend = _sentencepiece_bpe(metadata, tokens, types)
    else:
        raise ValueError(f"{where}: tokenizer.ggml.model {kind!r} is not rebuilt (supported: gpt2, llama); put the "
                         "model's tokenizer.json beside the GGUF file")
    # Control tokens are special (skipped when decoding); user-defined ones match whole but decode as text.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == USER_DEFINED])
    named = {name: tokens[i] for name, key in _NAMED_IDS.items()
             if isinstance(i := metadata.get(f"tokenizer.ggml.{key}_token_id"), int) and 0 <= i < len(tokens)}
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    # BOS in front when the file says so; llama.cpp's defaults otherwise (SentencePiece and Llama 3 vocabularies)
    add_bos = metadata.get("tokenizer.ggml.add_bos_token",
                           kind == "llama" or metadata.get("tokenizer.ggml.pre") in _IGNORE_MERGES)
    add_eos = metadata.get("tokenizer.ggml.add_eos_token", False)
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    ends = [(tokens[i], i) for i, wanted in ((bos, add_bos), (eos, add_eos)) if wanted and i is not None]
    first = [tokens[bos]] if add_bos and bos is not None else []
    last = [tokens[eos]] if add_eos and eos is not None else []

    def sequence(piece: str, type_id: int) -> list[str]:
        return [f"{t}:{type_id}" for t in (*first, piece, *last)]

    backend.post_processor = processors.TemplateProcessing(
        single=sequence("$A", 0), pair=sequence("$A", 0) + sequence("$B", 1), special_tokens=ends)
    stop = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    return Tokenizer(backend, special_tokens=named, chat_template=gguf_chat_templates(metadata),
                     eos_token_ids=tuple(i for i in stop if i is not None), bos_token_id=bos,
                     pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"))


def gguf_chat_templates(metadata: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The embedded chat template (`tokenizer.chat_template`), with named ones (`tokenizer.chat_template.<name>`)
    as a dict whose 'default' is the plain one."""
    default = metadata.get("tokenizer.chat_template")
    named = {name: metadata[f"tokenizer.chat_template.{name}"] for name in metadata.get("tokenizer.chat_templates", [])
             if f"tokenizer.chat_template.{name}" in metadata}
    if not named:
        return default
    return {**({"default": default} if default is not None else {}), **named}


def _byte_level_bpe(metadata: Mapping[str, Any], tokens: list[str], types: list[int], where: str) -> _BackendTokenizer:
    pre = metadata.get("tokenizer.ggml.pre", "default")
    splits = PRE_TOKENIZERS.get(pre)
    if splits is None and pre != "default":
        raise ValueError(f"{where}: pre-tokenizer {pre!r} is not rebuilt (known: {', '.join(sorted(PRE_TOKENIZERS))}"
                         "); put the model's tokenizer.json beside the GGUF file")
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        raise ValueError(f"{where}: a byte-level BPE vocabulary without tokenizer.ggml.merges")
    # Normal tokens are spelled in GPT-2's byte alphabet; added ones (control, user-defined) as their raw text.
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if kind == NORMAL and not set(token) <= BYTE_LEVEL_ALPHABET.keys():
            token = "".join(_BYTE_CHARS[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, i)
    bpe = BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], ignore_merges=pre in _IGNORE_MERGES)
    backend = _BackendTokenizer(bpe)
    if splits is None:  # "default": what GPT-2's byte-level pre-tokenizer does
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


_BYTE_CHARS = {b: c for c, b in BYTE_LEVEL_ALPHABET.items()}


def _sentencepiece_bpe(metadata: Mapping[str, Any], tokens: list[str], types: list[int]) -> _BackendTokenizer:
    """SentencePiece BPE as Llama 2's tokenizer.json has it: spaces as U+2581 (and one in front of each piece of
    text, as llama.cpp puts one after every special token), unknown characters as byte tokens <0xNN>."""
    vocab = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    merges = metadata.get("tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in merges] if merges is not None else _merges_from_scores(
        tokens, types, metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    bpe = BPE(vocab, merges, unk_token=tokens[unk] if unk is not None else None, fuse_unk=True,
                     byte_fallback=True)
    backend = _BackendTokenizer(bpe)
    space_prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    backend.normalizer = normalizers.Sequence(
        ([normalizers.Prepend("\u2581")] if space_prefix else []) + [normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    return backend


def _merges_from_scores(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges for a SentencePiece vocabulary without them: every split of a normal token into two tokens,
    best-scoring merged token first (what SentencePiece's BPE prefers), then by the parts' ids."""
    ids = {t: i for i, t in reversed(list(enumerate(tokens)))}
    found = []
    for token, kind, score in zip(tokens, types, scores):
        if kind not in (NORMAL, USER_DEFINED):
            continue
        for k in range(1, len(token)):
            left, right = token[:k], token[k:]
            if left in ids and right in ids:
                found.append((-score, ids[left], ids[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]
