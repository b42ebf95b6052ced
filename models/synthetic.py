"""Small deterministic models built locally (no hub downloads, no accelerator) for benchmarks and tests:
`make_test_tokenizer` (an HF-format tokenizer directory), `random_llama` (a random-weight Llama with it) and
`shared_small_llama` (the 2-layer one, built once per machine). Details: docs/models.md."""
from __future__ import annotations

import json
import os
import shutil
import tempfile

from models.tokenizer import CHATML_TURNS, train_byte_level_bpe

TEST_BOS_TOKEN = "<s>"
TEST_EOS_TOKEN = "</s>"
TEST_PAD_TOKEN = "<pad>"
TEST_CHAT_START_TOKEN = "<|im_start|>"
TEST_CHAT_END_TOKEN = "<|im_end|>"
# Ids 0..4, in this order; the trainer puts special tokens first.
TEST_SPECIAL_TOKENS = (TEST_BOS_TOKEN, TEST_EOS_TOKEN, TEST_PAD_TOKEN, TEST_CHAT_START_TOKEN, TEST_CHAT_END_TOKEN)
_MIN_VOCAB_SIZE = 256 + len(TEST_SPECIAL_TOKENS)

# ChatML with a BOS in front; unknown roles are rejected, as many Hub templates do.
TEST_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    + CHATML_TURNS
)

_BUILTIN_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello, world! How are you today?",
    "Serving large language models needs paged attention, continuous batching and a tokenizer.",
    "def main():\n    print('hello')\n    return 0\n\nif __name__ == '__main__':\n    main()\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000 3.14159 -7 1e-6",
    "Café, naïve, résumé, façade, jalapeño, Zürich, São Paulo, Ångström, smörgåsbord, crème brûlée.",
    "Ελληνικά γράμματα: αβγδε. Русский текст: привет, мир! עברית: שלום. العربية: مرحبا بالعالم.",
    "中文：你好，世界！今天天气很好。我们在测试分词器。机器学习和自然语言处理。",
    "日本語：こんにちは世界。カタカナとひらがな。한국어: 안녕하세요 세계.",
    "Emoji: 😀 😂 🚀 🎉 👍🏽 👨‍👩‍👧 ❤️ 🇫🇷 ✨ 🤖 — and symbols: € £ ¥ © ® ™ → ≤ ≥ ∞ ∑ √ π.",
    "Tabs\tand  double  spaces, newlines\n\nand trailing spaces   ",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n2 + 2 = 4.<|im_end|>\n",
)


def make_test_tokenizer(
    out_dir: str | os.PathLike,
    vocab_size: int = 512,
    corpus: list[str] | tuple[str, ...] | None = None,
    chat_template_in_config: bool = False,
    extra_special_tokens: tuple[str, ...] | list[str] = (),
    chat_template: str | None = None,
) -> str:
    """Train a small byte-level BPE and save it HF-style into `out_dir`; returns `out_dir` as a str.

    Special tokens (ids 0..4): <s> (BOS, prepended by the post-processor), </s> (EOS), <pad>, <|im_start|>,
    <|im_end|>; generation_config.json lists both </s> and <|im_end|> as EOS. The trained vocabulary holds at
    most `vocab_size` tokens (fewer if the corpus has too few merges). Deterministic; takes milliseconds.
    `chat_template_in_config` puts the template in tokenizer_config.json (the pre-transformers-5 layout)
    instead of chat_template.jinja. `extra_special_tokens` (e.g. `<tool_call>`, `[TOOL_CALLS]`, `<think>`) follow
    as special tokens with ids 5, 6, ...; `chat_template` replaces the default template.
    """
    special_tokens = TEST_SPECIAL_TOKENS + tuple(t for t in extra_special_tokens if t not in TEST_SPECIAL_TOKENS)
    if vocab_size < 256 + len(special_tokens):
        raise ValueError(f"vocab_size={vocab_size} is below {256 + len(special_tokens)} (256 bytes + special tokens)")
    template = TEST_CHAT_TEMPLATE if chat_template is None else chat_template
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    texts = list(_BUILTIN_CORPUS if corpus is None else corpus)

    # Repetition gives multi-byte sequences enough counts to be merged into whole-character tokens.
    backend = train_byte_level_bpe(texts * 4, vocab_size, special_tokens, bos_token=TEST_BOS_TOKEN)
    bos_id = backend.token_to_id(TEST_BOS_TOKEN)
    backend.save(os.path.join(out_dir, "tokenizer.json"))

    added_tokens_decoder = {
        str(backend.token_to_id(token)): {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True,
        }
        for token in special_tokens
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": TEST_BOS_TOKEN,
        "eos_token": TEST_EOS_TOKEN,
        "pad_token": TEST_PAD_TOKEN,
        "added_tokens_decoder": added_tokens_decoder,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
    }
    template_path = os.path.join(out_dir, "chat_template.jinja")
    if chat_template_in_config:
        config["chat_template"] = template
        if os.path.exists(template_path):
            os.remove(template_path)  # it would take priority over the config's template
    else:
        with open(template_path, "w", encoding="utf-8") as f:
            f.write(template)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)

    generation_config_path = os.path.join(out_dir, "generation_config.json")
    if not os.path.exists(generation_config_path):  # a model helper may have written a fuller one
        with open(generation_config_path, "w", encoding="utf-8") as f:
            json.dump({
                "bos_token_id": bos_id,
                "eos_token_id": [backend.token_to_id(TEST_EOS_TOKEN), backend.token_to_id(TEST_CHAT_END_TOKEN)],
                "pad_token_id": backend.token_to_id(TEST_PAD_TOKEN),
            }, f, indent=2)
    return out_dir


def random_llama(out_dir: str, *, hidden_size: int = 64, intermediate_size: int = 96, seed: int = 0,
                 extra_special_tokens: tuple[str, ...] | list[str] = (), chat_template: str | None = None) -> str:
    """A 2-layer random Llama (vocab 512, context 512) with the test BPE tokenizer and chat template, written to
    `out_dir` (kept if it is there already). `extra_special_tokens`, `chat_template`: as `make_test_tokenizer`."""
    if os.path.exists(os.path.join(out_dir, "tokenizer.json")):
        return out_dir
    import torch  # the test extras: not needed to serve
    import transformers as tf
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.08, bos_token_id=0,
                         eos_token_id=1, pad_token_id=2)
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out_dir)
    make_test_tokenizer(out_dir, vocab_size=512, extra_special_tokens=extra_special_tokens,
                        chat_template=chat_template)
    return out_dir


def shared_small_llama() -> str:
    """`random_llama()` once per machine and user (kept between runs; built atomically)."""
    path = os.path.join(tempfile.gettempdir(), f"meshserve-test-llama512-v1-{os.getuid()}")
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        tmp = tempfile.mkdtemp(prefix="meshserve-test-llama512-", dir=tempfile.gettempdir())
        random_llama(tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # built concurrently by another process: use theirs
            shutil.rmtree(tmp, ignore_errors=True)
    return path
