"""The shipped tiny models (models/tiny/target, models/tiny/draft): they load in meshserve and in transformers with
the same logits, their perplexity on the shipped held-out text is the reported one, they share one tokenizer,
and training from a seed is deterministic."""
import dataclasses
import json
import math
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from models.training import corpus as tiny_corpus, train as train_tiny
from serving.core.batch import SeqChunk
from models.training.tiny_llama import TinyLlamaConfig, forward
from models.tokenizer import Tokenizer
from models.weights import load_hf_model
from tests.support.paged_runner import PagedRunner
from tests.support.tiny import MODELS, heldout_ids, heldout_perplexity, heldout_windows, model_dir, report

PARAMETER_RANGES = {"target": (10e6, 20e6), "draft": (1e6, 3e6)}


@pytest.mark.parametrize("which", MODELS)
def test_shipped_directory_is_complete_and_small(which):
    names = set(os.listdir(model_dir(which)))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "generation_config.json", "heldout.txt", "training_report.json"} <= names
    low, high = PARAMETER_RANGES[which]
    assert low <= report(which)["parameters"] <= high
    total = sum(os.path.getsize(os.path.join(model_dir(m), n)) for m in MODELS for n in os.listdir(model_dir(m)))
    assert total < 40e6, f"models/tiny holds {total / 1e6:.1f} MB"


def test_draft_and_target_share_the_tokenizer():
    files = {m: open(os.path.join(model_dir(m), "tokenizer.json"), "rb").read() for m in MODELS}
    assert files["target"] == files["draft"]
    configs = [json.load(open(os.path.join(model_dir(m), "config.json"))) for m in MODELS]
    assert configs[0]["vocab_size"] == configs[1]["vocab_size"] == train_tiny.VOCAB_SIZE
    assert heldout_ids("target") == heldout_ids("draft")


def test_tokenizer_loads_in_meshserve_and_transformers_alike():
    import transformers as tf
    ours = Tokenizer.from_pretrained(model_dir("target"))
    hf = tf.AutoTokenizer.from_pretrained(model_dir("target"))
    text = "import os\n\ndef main(argv):\n    return os.path.join(*argv)  # café ✓\n"
    assert ours.encode(text) == hf(text)["input_ids"]
    assert ours.encode(text)[0] == ours.bos_token_id == tiny_corpus.BOS_ID
    assert ours.decode(ours.encode(text)) == text
    messages = [{"role": "user", "content": "Write a function."}]
    rendered = ours.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert set(ours.eos_token_ids) == {tiny_corpus.EOS_ID, tiny_corpus.CHAT_END_ID}


@pytest.mark.parametrize("which", MODELS)
def test_logits_match_transformers_and_training_forward(which):
    import torch
    import transformers as tf
    ids = heldout_ids(which)[:96]
    hf = tf.AutoModelForCausalLM.from_pretrained(model_dir(which), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    runner = PagedRunner(load_hf_model(model_dir(which)), page_size=16, num_pages=16, max_pages=8)
    ours = runner.token_logits([SeqChunk(ids, 0, runner.alloc(len(ids)))])
    cfg = train_tiny.MODEL_CONFIGS[which]
    params = {k: jnp.asarray(v.astype(np.float32)) for k, v in load_file(
        os.path.join(model_dir(which), "model.safetensors")).items()}
    # Jitted, as training runs it: one program instead of dispatching op by op.
    training = np.asarray(jax.jit(forward, static_argnums=1)(params, cfg, jnp.asarray([ids]))[0])
    print(f"TINY {which}: max |logit| {np.abs(ref).max():.1f}, serving vs HF {np.abs(ours - ref).max():.1e}, "
          f"training forward vs HF {np.abs(training - ref).max():.1e}")
    assert np.abs(ours - ref).max() < 1e-3
    assert np.abs(training - ref).max() < 1e-3


@pytest.mark.parametrize("which", MODELS)
def test_heldout_perplexity_matches_report(which):
    """The serving model's perplexity on the fixed slice of the shipped heldout.txt is the reported one."""
    reported = report(which)["results"]["heldout_slice"]
    windows, seq_len = heldout_windows(which)
    runner = PagedRunner(load_hf_model(model_dir(which)), page_size=16, num_pages=seq_len // 16,
                         max_pages=seq_len // 16)
    ppl = heldout_perplexity(runner, windows)
    print(f"TINY {which}: held-out slice ppl {ppl:.3f}, reported {reported['ppl']:.3f}, "
          f"full held-out reported {report(which)['results']['val_ppl']:.3f}")
    assert abs(ppl / reported["ppl"] - 1) < 0.05
    # The slice is a fair sample of the held-out set, not a lucky one.
    assert abs(math.log(reported["ppl"]) / report(which)["results"]["val_loss"] - 1) < 0.25


def test_training_from_a_seed_is_deterministic():
    cfg = TinyLlamaConfig(vocab_size=train_tiny.VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_layers=2,
                          num_heads=4, num_kv_heads=2, max_position_embeddings=64)
    data = np.asarray(heldout_ids("draft")[:4096], np.int32)
    run = train_tiny.TrainConfig(steps=4, batch_size=2, seq_len=64, warmup_steps=1, seed=3, attention_block=32)
    params_a, hist_a = train_tiny.train(cfg, run, data)
    params_b, hist_b = train_tiny.train(cfg, run, data)
    assert hist_a["loss"] == hist_b["loss"]
    for name in params_a:
        np.testing.assert_array_equal(np.asarray(params_a[name]), np.asarray(params_b[name]), err_msg=name)
    assert hist_a["loss"][-1] < hist_a["loss"][0]  # it learns
    other = train_tiny.batch_starts(dataclasses.replace(run, seed=4), len(data))
    assert not np.array_equal(other, train_tiny.batch_starts(run, len(data)))


def test_corpus_reproduces_on_the_same_python():
    """On the Python release the models were trained with, the corpus selection gives the recorded hash and the
    shipped held-out text (other releases carry slightly different sources: the hash says so)."""
    corpus_info = report("target")["corpus"]
    if platform.python_version() != corpus_info["python_version"]:
        pytest.skip(f"trained on Python {corpus_info['python_version']}, this is {platform.python_version()}")
    corpus = tiny_corpus.load_corpus(max_bytes=corpus_info["max_bytes"], heldout_every=corpus_info["heldout_every"],
                                     max_heldout_bytes=corpus_info["max_heldout_bytes"])
    assert corpus.description["sha256"] == corpus_info["sha256"]
    with open(os.path.join(model_dir("target"), "heldout.txt"), encoding="utf-8", newline="") as f:
        assert corpus.heldout_text == f.read()
