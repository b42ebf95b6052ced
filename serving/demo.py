"""The README's main job: a gateway and two instance servers on 127.0.0.1 serving the embedded default model, a few
streamed requests through them with their timings (gRPC), one through the gateway's OpenAI HTTP API with the `curl`
line that repeats it, then shutdown (--serve: keep serving). Details: docs/server.md.

    python -m serving.demo [--serve] [--http_port=8080] [--model=DIR]
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from absl import app, flags

from models.synthetic import random_llama
from serving.process import REPO_ROOT as REPO, ReadyFileProcess, start_process as Process

_MODEL = flags.DEFINE_string("model", None, "HF or Orbax model directory (default: the embedded model)")
_SERVE = flags.DEFINE_bool("serve", False, "keep serving after the demo requests (Ctrl-C stops)")
_WORKDIR = flags.DEFINE_string("workdir", "", "logs, configuration and fallback model (default: a temp dir)")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 48, "tokens to generate per request")
_HTTP_PORT = flags.DEFINE_integer("http_port", 0, "the gateway's OpenAI HTTP API port (0: any free port)")

EMBEDDED = os.path.join(REPO, "models", "tiny", "target")
SYSTEM = ("# A small utility module from the standard library.\n# It is careful about edge cases, documents every "
          "public function and raises ValueError with a clear message on bad input.\n\n")
REQUESTS = [  # (label, prompt, priority)
    ("interactive", "def fibonacci(n):\n    \"\"\"", "interactive"),
    ("shared prefix 1", SYSTEM + "def parse_header(line):\n", "interactive"),
    ("shared prefix 2", SYSTEM + "def format_size(num_bytes):\n", "interactive"),
    ("batch priority", "class LRUCache:\n    def __init__(self, capacity):\n", "batch"),
    ("imports", "import os\nimport sys\n\n\ndef main(argv):\n", "interactive"),
]


def default_model_dir(workdir: str) -> str:
    if os.path.exists(os.path.join(EMBEDDED, "config.json")):
        return EMBEDDED
    # No shipped model: a random one (its text is noise).
    return random_llama(os.path.join(workdir, "random-llama"), hidden_size=128, intermediate_size=256)


def stream_one(client, label: str, prompt: str, priority: str, max_tokens: int) -> tuple[bool, str]:
    print(f"\n=== {label} ({priority}) ===")
    print(prompt, end="", flush=True)
    t0 = time.perf_counter()
    first = None
    text, n, finish, cached = "", 0, None, 0
    # Seeded sampling with a repetition penalty: a small model's greedy output tends to loop. min_tokens: the
    # model may sample </s> first after a complete-looking prompt, and every request should show some text.
    for r in client.generate(prompt, max_tokens=max_tokens, min_tokens=min(4, max_tokens), temperature=0.7,
                             top_p=0.95, repetition_penalty=1.2, seed=1234, priority=priority):
        if r.token_ids and first is None:
            first = time.perf_counter()
        n += len(r.token_ids)
        text += r.text
        print(r.text, end="", flush=True)
        if r.finish_reason:
            finish = r.finish_reason
            cached = r.usage.cached_prompt_tokens
    end = time.perf_counter()
    ttft = (first - t0) * 1e3 if first else float("nan")
    rate = (n - 1) / (end - first) if first and n > 1 and end > first else float("nan")
    from serving.wire import meshserve_pb2 as pb
    reason = pb.FinishReason.Name(finish) if finish is not None else "none"
    print(f"\n--- {n} tokens, TTFT {ttft:.0f} ms, {rate:.1f} tok/s, finish {reason}, "
          f"{cached} prompt tokens from the prefix cache ---")
    return bool(text) and finish is not None, text


def http_chat(port: int, max_tokens: int) -> tuple[bool, str]:
    """One chat completion through the gateway's OpenAI HTTP API (what the printed curl line sends)."""
    import urllib.request
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Write a function that reverses a list."}],
            "max_tokens": max_tokens, "temperature": 0.7, "seed": 1234, "repetition_penalty": 1.2, "min_tokens": 4}
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    print(f"\n=== OpenAI HTTP API through the gateway ===\ncurl {url} -H 'Content-Type: application/json' "
          f"-d '{json.dumps(body)}'")
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        answer = json.loads(r.read())
    text = answer["choices"][0]["message"]["content"]
    print(text)
    print(f"--- finish {answer['choices'][0]['finish_reason']}, usage {answer['usage']} ---")
    return bool(text), text


def main(argv):
    del argv
    workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="meshserve-demo-")
    os.makedirs(workdir, exist_ok=True)
    model = _MODEL.value or default_model_dir(workdir)
    print(f"meshserve demo: model {model}\n  logs and configuration in {workdir}")
    t0 = time.perf_counter()

    def instance(i: int) -> ReadyFileProcess:
        return Process(f"instance{i}", ["-m", "serving.server", f"--model={model}", "--host=127.0.0.1", "--port=0",
                                        "--metrics_port=0", "--page_size=16", "--num_pages=512", "--max_num_seqs=16",
                                        "--max_num_batched_tokens=128", f"--instance_id=instance{i}",
                                        "--served_model_name=tiny"], workdir)

    # One instance first: the second then loads every program from the compilation cache the first filled,
    # instead of both compiling the same programs at once on the same cores.
    instances = [instance(0)]
    procs = list(instances)
    ok = False
    try:
        instances[0].wait_ready()
        instances.append(instance(1))
        procs.append(instances[1])
        instances[1].wait_ready()
        config = {"pools": [{"name": "local", "instances": [
            {"name": p.name, "target": f"127.0.0.1:{p.info['port']}"} for p in instances]}],
            "routing": {"policy": "load_aware"}}
        config_path = os.path.join(workdir, "gateway.json")
        with open(config_path, "w") as f:
            json.dump(config, f, indent=1)
        gateway = Process("gateway", ["-m", "serving.gateway", f"--config={config_path}", "--host=127.0.0.1",
                                      "--port=0", "--metrics_port=0", f"--http_port={_HTTP_PORT.value}",
                                      f"--jobs_db={os.path.join(workdir, 'jobs.db')}"], workdir)
        procs.append(gateway)
        gateway.wait_ready()
        target = f"127.0.0.1:{gateway.info['port']}"
        http_port = gateway.info["http_port"]
        print(f"ready in {time.perf_counter() - t0:.1f}s: gateway {target} (OpenAI HTTP API :{http_port}) -> "
              + ", ".join(f"{p.name} 127.0.0.1:{p.info['port']}" for p in instances))

        from serving.wire.client import Client
        results = []
        with Client(target) as client:
            for label, prompt, priority in REQUESTS:
                results.append(stream_one(client, label, prompt, priority, _MAX_TOKENS.value)[0])
        results.append(http_chat(http_port, _MAX_TOKENS.value)[0])
        ok = all(results)
        print(f"\n{sum(results)}/{len(results)} requests completed with text")
        print("metrics (Prometheus text):")
        for p in procs:
            print(f"  {p.name}: http://127.0.0.1:{p.info['metrics_port']}/metrics")
        print("traces: OpenTelemetry spans per request (gateway route, queue, prefill chunks, decode with per-token "
              "events); start with --otlp_endpoint=HOST:4317 on the servers and gateway to export them")
        if _SERVE.value:
            print(f"\nserving; query it with:\n  python -m serving.client --target={target} --temperature=0 "
                  f"'def main():'\n  curl http://127.0.0.1:{http_port}/v1/completions -H 'Content-Type: "
                  "application/json' -d '{\"model\": \"tiny\", \"prompt\": \"def main():\", \"max_tokens\": 32}'"
                  "\nCtrl-C stops.")
            try:
                while all(p.proc.poll() is None for p in procs):
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
    finally:
        codes = [p.stop() for p in reversed(procs)]
        print(f"shut down: exit codes {dict(zip([p.name for p in reversed(procs)], codes))}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
