"""Test helpers: a small random Llama with a real tokenizer (needs torch + transformers, the test extras), and
`ServerProcess`, a `python -m serving.server` child process on 127.0.0.1 with free ports."""
from __future__ import annotations

import os
import tempfile

from serving.process import REPO_ROOT, ReadyFileProcess

__all__ = ["REPO_ROOT", "SMALL_ENGINE_FLAGS", "ServerProcess", "build_test_model", "shared_test_model"]
# Small engine settings that start fast: one token bucket of 32, so warm-up compiles 9 programs.
SMALL_ENGINE_FLAGS = ("--page_size=8", "--num_pages=512", "--max_num_seqs=32", "--max_num_batched_tokens=32",
                      "--min_token_bucket=32")


def build_test_model(out_dir: str, seed: int = 0) -> str:
    """A 2-layer random Llama (vocab 512, context 512) with the test BPE tokenizer and chat template."""
    if os.path.exists(os.path.join(out_dir, "tokenizer.json")):
        return out_dir
    import torch
    import transformers as tf

    from models.testing import make_test_tokenizer
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-6, initializer_range=0.08, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out_dir)
    make_test_tokenizer(out_dir, vocab_size=512)
    return out_dir


def shared_test_model() -> str:
    """build_test_model() once per machine and user (kept between test runs; built atomically)."""
    path = os.path.join(tempfile.gettempdir(), f"meshserve-test-llama512-v1-{os.getuid()}")
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        tmp = tempfile.mkdtemp(prefix="meshserve-test-llama512-", dir=tempfile.gettempdir())
        build_test_model(tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # built concurrently by another process: use theirs
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    return path


class ServerProcess(ReadyFileProcess):
    """`python -m serving.server` on 127.0.0.1 with the small engine settings (and `flags`), one CPU device unless
    `env` says otherwise; started at construction."""

    def __init__(self, model_dir: str, workdir: str, *flags: str, env: dict | None = None,
                 module: str = "serving.server"):
        args = ["-m", module, f"--model={model_dir}", "--host=127.0.0.1", "--port=0", "--metrics_port=0",
                *SMALL_ENGINE_FLAGS, *flags]
        super().__init__("server", args, workdir, env={"JAX_PLATFORMS": "cpu",
                                                       "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
                                                       **(env or {})})
        self.start()

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit code (killed after `timeout`)."""
        return self.stop(timeout=timeout)
