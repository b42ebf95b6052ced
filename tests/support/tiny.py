"""The shipped tiny models (models/tiny): their directories, training reports and held-out text."""
from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from models.tokenizer import Tokenizer
from models.training import train as train_tiny
from serving.core.batch import SeqChunk
from serving.process import REPO_ROOT

TINY_DIR = os.path.join(REPO_ROOT, "models", "tiny")
MODELS = ("target", "draft")


def model_dir(which: str) -> str:
    return os.path.join(TINY_DIR, which)


def report(which: str) -> dict:
    with open(os.path.join(model_dir(which), "training_report.json"), encoding="utf-8") as f:
        return json.load(f)


def heldout_ids(which: str) -> list[int]:
    with open(os.path.join(model_dir(which), "heldout.txt"), encoding="utf-8", newline="") as f:
        return Tokenizer.from_pretrained(model_dir(which)).encode(f.read())


def heldout_windows(which: str):
    """The fixed slice of the held-out text the training report's `heldout_slice` perplexity is measured on:
    (windows [n, seq_len + 1] int, seq_len)."""
    reported = report(which)["results"]["heldout_slice"]
    seq_len = reported["seq_len"]
    windows = train_tiny.make_windows(heldout_ids(which), seq_len)[:reported["windows"]]
    assert len(windows) == reported["windows"]
    return windows, seq_len


def heldout_perplexity(runner, windows, predictions: list | None = None) -> float:
    """Perplexity of `runner` (a PagedRunner with seq_len tokens of pages) over `windows`, each from position 0;
    `predictions`, if given, gets each window's argmax next tokens."""
    nll = 0.0
    for window in windows:
        runner.next_free = 0  # every window starts at position 0 and rewrites the same pages
        logits = runner.token_logits([SeqChunk(window[:-1].tolist(), 0, runner.alloc(len(window) - 1))])
        if predictions is not None:
            predictions.append(np.argmax(logits, axis=-1))
        logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
        nll -= float(jnp.sum(jnp.take_along_axis(logp, jnp.asarray(window[1:, None]), axis=-1)))
    return math.exp(nll / windows[:, 1:].size)
