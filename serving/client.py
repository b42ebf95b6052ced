"""`python -m serving.client [--target=HOST:PORT] [sampling flags] PROMPT`: streams a completion to the terminal.

`--chat` sends PROMPT as one user message through the model's chat template; `--token_ids=1,2,3` sends ids.
The text goes to stdout as it arrives; the finish reason and usage go to stderr.
"""
from __future__ import annotations

import sys

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defined when the entry point runs, so importing this module defines nothing."""
    flags.DEFINE_string("target", "127.0.0.1:50051", "Instance server or gateway address.")
    flags.DEFINE_boolean("chat", False, "Send the prompt as a user message through the chat template.")
    flags.DEFINE_string("system", "", "With --chat: a system message first.")
    flags.DEFINE_list("token_ids", [], "Send these token ids instead of text.")
    flags.DEFINE_integer("max_tokens", 64, "Tokens to generate at most.")
    flags.DEFINE_float("temperature", 1.0, "0 = greedy.")
    flags.DEFINE_float("top_p", 1.0, "Nucleus sampling.")
    flags.DEFINE_integer("top_k", -1, "Top-k sampling; -1 = off.")
    flags.DEFINE_integer("seed", None, "Sampling seed.")
    flags.DEFINE_multi_string("stop", [], "Stop string (repeatable).")
    flags.DEFINE_enum("priority", "interactive", ["interactive", "batch"], "Priority class.")
    flags.DEFINE_string("tenant", "", "Tenant name.")
    flags.DEFINE_float("timeout", None, "Deadline of the call in seconds.")


def main(argv):
    from serving.wire.client import Client, ClientError
    prompt = " ".join(argv[1:])
    kw = dict(max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature, top_p=FLAGS.top_p, top_k=FLAGS.top_k,
              seed=FLAGS.seed, stop=FLAGS.stop or None, priority=FLAGS.priority, tenant=FLAGS.tenant)
    if FLAGS.token_ids:
        kw["prompt"] = [int(t) for t in FLAGS.token_ids]
    elif FLAGS.chat:
        kw["messages"] = ([{"role": "system", "content": FLAGS.system}] if FLAGS.system else []) + [
            {"role": "user", "content": prompt}]
    else:
        kw["prompt"] = prompt
    last = None
    with Client(FLAGS.target, timeout=FLAGS.timeout) as client:
        try:
            for r in client.generate(**kw):
                sys.stdout.write(r.text)
                sys.stdout.flush()
                last = r
        except ClientError as e:
            sys.stdout.write("\n")
            print(f"error: {e.code.name}: {e.details}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    sys.stdout.write("\n")
    from serving.wire.client import FINISH_REASON_NAMES
    print(f"[finish_reason={FINISH_REASON_NAMES[last.finish_reason]} prompt_tokens={last.usage.prompt_tokens} "
          f"completion_tokens={last.usage.completion_tokens} ttft={last.timing.time_to_first_token_s * 1e3:.1f}ms "
          f"e2e={last.timing.e2e_latency_s * 1e3:.1f}ms]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(lambda argv: sys.exit(main(argv)))
