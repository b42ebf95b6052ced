"""The tiny models' training text and tokenizer: the Python standard library's own source, selected, split and hashed
reproducibly (`load_corpus`, `Corpus`), the tokenizer trained on it (`train_tokenizer`, `save_tokenizer`) and the
encoded documents (`encode_documents`). Details: docs/models.md."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import sysconfig

from tokenizers import Tokenizer as _BackendTokenizer

from models.tokenizer import CHATML_TURNS, train_byte_level_bpe

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<s>", "</s>", "<pad>"
CHAT_START_TOKEN, CHAT_END_TOKEN = "<|im_start|>", "<|im_end|>"
# Ids 0..4 in this order (the BPE trainer puts special tokens first).
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, CHAT_START_TOKEN, CHAT_END_TOKEN)
BOS_ID, EOS_ID, PAD_ID, CHAT_END_ID = 0, 1, 2, 4

# ChatML with a BOS in front (the models are not chat-tuned; the template lets chat requests run).
CHAT_TEMPLATE = "{{ bos_token }}" + CHATML_TURNS

# Directories left out: tests (huge, repetitive), codec tables, third-party packages, build configuration.
EXCLUDED_DIRS = ("test", "tests", "idle_test", "site-packages", "encodings", "__pycache__")
EXCLUDED_PREFIXES = ("_sysconfigdata", "config-")  # machine-specific build data
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@dataclasses.dataclass(frozen=True)
class Document:
    path: str  # relative to the stdlib directory, '/'-separated
    text: str


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: list[Document]
    heldout: list[Document]
    description: dict  # what went in, for the training report

    @property
    def heldout_text(self) -> str:
        """The held-out documents as one text, each wrapped in <s> ... </s> (the training stream's layout)."""
        return "".join(f"{d.text}{EOS_TOKEN}{BOS_TOKEN}" for d in self.heldout)[:-len(BOS_TOKEN)]


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str) -> list[str]:
    """Sorted relative paths of the standard library's .py files, without the excluded directories."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith(EXCLUDED_PREFIXES)]
        for name in filenames:
            if name.endswith(".py") and not name.startswith(EXCLUDED_PREFIXES):
                found.append(os.path.normpath(os.path.join(rel_dir, name)).replace(os.sep, "/"))
    return sorted(found)


def is_heldout(path: str, heldout_every: int) -> bool:
    """A file is held out when the hash of its path says so: stable across machines and file-list changes."""
    return int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "little") % heldout_every == 0


def load_corpus(*, max_bytes: int, heldout_every: int, max_heldout_bytes: int, root: str | None = None) -> Corpus:
    """Reads the standard library into train / held-out documents.

    Files are taken in sorted path order until `max_bytes` of text; a file that is not UTF-8 or that contains a
    special-token string is skipped. Held-out files (by path hash) beyond `max_heldout_bytes` are dropped from
    both sets, so the shipped held-out text stays small.
    """
    root = root or stdlib_dir()
    train, heldout, skipped = [], [], []
    total = heldout_bytes = 0
    digest = hashlib.sha256()
    for path in stdlib_files(root):
        try:
            with open(os.path.join(root, path), encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            skipped.append(path)
            continue
        text = text.replace("\r\n", "\n")
        if not text.strip() or any(tok in text for tok in SPECIAL_TOKENS):
            skipped.append(path)
            continue
        size = len(text.encode())
        if total + size > max_bytes:
            break
        total += size
        if is_heldout(path, heldout_every):
            if heldout_bytes + size > max_heldout_bytes:
                skipped.append(path)
                continue
            heldout_bytes += size
            heldout.append(Document(path, text))
        else:
            train.append(Document(path, text))
        digest.update(path.encode() + b"\0" + text.encode() + b"\0")
    if not train or not heldout:
        raise ValueError(f"corpus under {root!r} has {len(train)} train and {len(heldout)} held-out files; "
                         f"check max_bytes={max_bytes} and heldout_every={heldout_every}")
    description = {
        "source": "CPython standard library .py files (code, comments, docstrings)",
        "python_version": platform.python_version(),
        "stdlib_dir": root,
        "excluded_dirs": list(EXCLUDED_DIRS),
        "excluded_prefixes": list(EXCLUDED_PREFIXES),
        "selection": "sorted relative paths, until max_bytes; skip non-UTF-8 files and files containing a "
                     "special-token string; held out when sha256(path) % heldout_every == 0",
        "max_bytes": max_bytes,
        "heldout_every": heldout_every,
        "max_heldout_bytes": max_heldout_bytes,
        "train_files": len(train),
        "heldout_files": len(heldout),
        "skipped_files": skipped,
        "train_bytes": sum(len(d.text.encode()) for d in train),
        "heldout_bytes": heldout_bytes,
        "sha256": digest.hexdigest(),
        "heldout_paths": [d.path for d in heldout],
    }
    return Corpus(train, heldout, description)


def train_tokenizer(texts: list[str], vocab_size: int) -> _BackendTokenizer:
    """Byte-level BPE (GPT-2 pre-tokenisation) with <s> prepended by the post-processor. Deterministic."""
    backend = train_byte_level_bpe(texts, vocab_size, SPECIAL_TOKENS, bos_token=BOS_TOKEN)
    for token, expected in zip(SPECIAL_TOKENS, range(len(SPECIAL_TOKENS))):
        if backend.token_to_id(token) != expected:
            raise AssertionError(f"special token {token!r} got id {backend.token_to_id(token)}, expected {expected}")
    return backend


def save_tokenizer(backend: _BackendTokenizer, out_dir: str) -> None:
    """tokenizer.json, tokenizer_config.json, chat_template.jinja and generation_config.json, HF-style."""
    os.makedirs(out_dir, exist_ok=True)
    backend.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "added_tokens_decoder": {
            str(backend.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True}
            for t in SPECIAL_TOKENS
        },
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
    }
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), config)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(CHAT_TEMPLATE)
    _write_json(os.path.join(out_dir, "generation_config.json"), {
        "bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, CHAT_END_ID], "pad_token_id": PAD_ID})


def encode_documents(backend: _BackendTokenizer, docs: list[Document]) -> list[int]:
    """The token stream <s> doc </s> <s> doc </s> ... (special-token strings never occur inside a doc)."""
    ids: list[int] = []
    for enc in backend.encode_batch([d.text for d in docs], add_special_tokens=False):
        ids.append(BOS_ID)
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return ids


def encode_heldout_text(backend: _BackendTokenizer, text: str) -> list[int]:
    """Token ids of a shipped heldout.txt: the same stream `encode_documents` gives for its documents."""
    return backend.encode(text, add_special_tokens=True).ids


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
