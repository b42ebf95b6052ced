"""The README's main job: meshserve generating text on the embedded default model.

    python -m serving.demo [--model=DIR]

Uses the shipped tiny model (models/tiny/target) when present; otherwise builds a small random-weight Llama
with a locally trained tokenizer under --workdir (its text is noise, but every part of the engine runs).
Prints each request's text as it streams, with time to first token and tokens/s.
"""
from __future__ import annotations

import os
import sys
import time

from absl import app, flags

_MODEL = flags.DEFINE_string("model", None, "HF or Orbax model directory (default: the embedded model)")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/meshserve-demo", "where a fallback model is built")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 48, "tokens to generate per request")

EMBEDDED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "tiny", "target")
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Request:\n    \"\"\"", "# Copyright"]


def default_model_dir(workdir: str) -> str:
    if os.path.exists(os.path.join(EMBEDDED, "config.json")):
        return EMBEDDED
    d = os.path.join(workdir, "random-llama")
    if not os.path.exists(os.path.join(d, "config.json")):
        import torch
        import transformers as tf

        from models.testing import make_test_tokenizer
        torch.manual_seed(0)
        tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
                                           pad_token_id=2)).save_pretrained(d)
        make_test_tokenizer(d, vocab_size=512)
    return d


def main(argv):
    del argv
    from serving.core.engine import Engine, EngineConfig
    from serving.core.sampling_params import SamplingParams

    model_dir = _MODEL.value or default_model_dir(_WORKDIR.value)
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=model_dir, page_size=16, num_pages=256, max_num_seqs=8,
                                 max_num_batched_tokens=128))
    engine.warmup()
    print(f"model {model_dir}: loaded in {engine.load_time_s:.1f}s, {engine.compile_count} programs compiled in "
          f"{engine.compile_time_s:.1f}s (ready {time.perf_counter() - t0:.1f}s after start)")
    params = SamplingParams(temperature=0.0, max_tokens=_MAX_TOKENS.value)
    texts: dict[str, str] = {}
    for i, prompt in enumerate(PROMPTS):
        req = engine.make_request(f"demo-{i}", prompt, params)
        engine.add_request(req)
        texts[req.request_id] = prompt
    done = []
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] += out.new_text
            if out.finished:
                m = out.request.metrics
                ttft = m.first_token_time - m.arrival_time
                n = out.request.num_output_tokens
                rate = (n - 1) / (m.finished_time - m.first_token_time) if n > 1 and m.finished_time and \
                    m.finished_time > m.first_token_time else float("nan")
                done.append(out.request_id)
                print(f"\n--- {out.request_id} ({out.finish_reason.value}; TTFT {ttft * 1e3:.0f} ms, "
                      f"{rate:.1f} tok/s, {n} tokens) ---\n{texts[out.request_id]}")
    if len(done) != len(PROMPTS):
        print(f"error: {len(PROMPTS) - len(done)} requests did not finish", file=sys.stderr)
        sys.exit(1)
    engine.scheduler.block_manager.check_idle()
    print(f"\nall {len(done)} requests completed; KV pages all free")


if __name__ == "__main__":
    app.run(main)
