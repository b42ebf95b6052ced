"""`python -m serving.bench gateway`: the gateway's routing policies under one request stream, one run: N instances
of a small model, one slow or stuck, a gateway per policy in front; p50/p99 of TTFT and end-to-end latency, and how
many requests each policy sent to the bad instance. Details: docs/benchmarks.md; results: docs/gateway.md."""
from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import tempfile
import time

from absl import flags

from serving.bench.harness import table
from serving.process import ReadyFileProcess

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "", "Model directory; empty: the 2-layer test Llama (built once, needs the test extras).")
flags.DEFINE_integer("num_instances", 4, "Instance processes.")
flags.DEFINE_enum("scenario", "slow", ["slow", "stuck"], "slow: one instance's every step is delayed; stuck: one "
                  "instance is kept full of very long requests sent straight to it.")
flags.DEFINE_float("slow_delay_s", 0.1, "scenario=slow: seconds added to each step of the bad instance.")
flags.DEFINE_integer("stuck_requests", 32, "scenario=stuck: long requests kept running on the bad instance.")
flags.DEFINE_integer("num_requests", 200, "Measured requests per policy.")
flags.DEFINE_integer("warmup_requests", 20, "Requests per policy before measuring (the gateway learns the fleet).")
flags.DEFINE_float("rate", 8.0, "Arrivals per second (Poisson).")
flags.DEFINE_integer("max_tokens", 24, "Tokens generated per request.")
flags.DEFINE_integer("min_prompt", 16, "Shortest prompt (tokens).")
flags.DEFINE_integer("max_prompt", 64, "Longest prompt (tokens).")
flags.DEFINE_list("policies", ["round_robin", "least_requests", "load_aware", "load_aware+isolation"],
                  "Policies to compare.")
flags.DEFINE_integer("seed", 0, "Request stream seed.")
flags.DEFINE_string("json_out", "", "Also write the results here as JSON.")


def _start_instances(model: str, workdir: str):
    from serving.process import ServerProcess
    procs = []
    for k in range(FLAGS.num_instances):
        extra = [f"--instance_id=i{k}"]
        if k == FLAGS.num_instances - 1 and FLAGS.scenario == "slow":
            extra.append(f"--debug_step_delay_s={FLAGS.slow_delay_s}")
        procs.append(ServerProcess(model, os.path.join(workdir, f"i{k}"), *extra))
    for p in procs:
        p.wait_ready()
    return procs


def _start_gateway(workdir: str, targets: list[str], policy: str):
    import yaml
    isolation = policy.endswith("+isolation")
    config = {"pools": [{"name": "bench", "instances": [{"name": f"i{k}", "target": t}
                                                        for k, t in enumerate(targets)]}],
              "routing": {"policy": policy.split("+")[0], "load_interval_ms": 100},
              "isolation": {"enabled": isolation, "window_s": 0.5, "abnormal_windows": 2, "healthy_windows": 3}}
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "gateway.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    gateway = ReadyFileProcess("gateway", ["-m", "serving.gateway", f"--config={path}", "--host=127.0.0.1",
                                           "--port=0", "--metrics_port=-1",
                                           f"--jobs_db={os.path.join(workdir, 'jobs.sqlite')}"], workdir,
                               ready_timeout_s=60.0)
    gateway.start().wait_ready()
    return gateway, gateway.port


def _stream(seed: int, n: int):
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(FLAGS.rate)
        length = rng.randint(FLAGS.min_prompt, FLAGS.max_prompt)
        out.append((t, [rng.randrange(3, 500) for _ in range(length)]))
    return out


async def _replay(target: str, stream) -> list[tuple[float, float, str]]:
    from serving.wire.client import AsyncClient, ClientError
    results = []
    async with AsyncClient(target, timeout=120) as client:
        t0 = time.monotonic()

        async def one(at, prompt):
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            start = time.monotonic()
            first = None
            try:
                async for _ in client.generate(prompt, max_tokens=FLAGS.max_tokens, ignore_eos=True):
                    if first is None:
                        first = time.monotonic()
                results.append((first - start, time.monotonic() - start, "OK"))
            except ClientError as e:
                results.append((float("nan"), time.monotonic() - start, e.code.name))
        await asyncio.gather(*(one(at, p) for at, p in stream))
    return results


def _routed_to(port: int, name: str) -> int:
    import grpc

    from serving.gateway.proto import gateway_pb2 as gpb
    from serving.gateway.proto import gateway_pb2_grpc as gpb_grpc
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        listed = gpb_grpc.GatewayAdminStub(ch).ListInstances(gpb.ListInstancesRequest(), timeout=10)
    return next(i.routed_total for i in listed.instances if i.name == name)


def _pct(values, q):
    values = sorted(v for v in values if v == v)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def _keep_stuck(target: str, stop: asyncio.Event) -> None:
    """scenario=stuck: keeps `stuck_requests` very long requests running on the bad instance."""
    from serving.wire.client import AsyncClient, ClientError
    async with AsyncClient(target) as client:
        async def worker(k):
            while not stop.is_set():
                try:
                    async for _ in client.generate([3 + k % 400] * 32, max_tokens=400, ignore_eos=True):
                        if stop.is_set():
                            return
                except ClientError:
                    await asyncio.sleep(0.1)
        await asyncio.gather(*(worker(k) for k in range(FLAGS.stuck_requests)))


def main() -> None:
    model = FLAGS.model
    if not model:
        from models.synthetic import shared_small_llama
        model = shared_small_llama()
    workdir = tempfile.mkdtemp(prefix="meshserve-bench-gateway-")
    print(f"starting {FLAGS.num_instances} instances of {model} (logs under {workdir}) ...", flush=True)
    instances = _start_instances(model, workdir)
    bad = f"i{FLAGS.num_instances - 1}"
    rows = []
    stop = asyncio.Event()
    loop = asyncio.new_event_loop()
    stuck_task = None
    try:
        if FLAGS.scenario == "stuck":
            stuck_task = loop.create_task(_keep_stuck(instances[-1].target, stop))
            loop.run_until_complete(asyncio.sleep(3.0))
        warm = _stream(FLAGS.seed + 1, FLAGS.warmup_requests)
        measured = _stream(FLAGS.seed, FLAGS.num_requests)
        for policy in FLAGS.policies:
            gateway, port = _start_gateway(os.path.join(workdir, policy), [p.target for p in instances], policy)
            try:
                loop.run_until_complete(asyncio.sleep(1.0))  # first load reports
                loop.run_until_complete(_replay(f"127.0.0.1:{port}", warm))
                before = _routed_to(port, bad)
                t0 = time.monotonic()
                res = loop.run_until_complete(_replay(f"127.0.0.1:{port}", measured))
                wall = time.monotonic() - t0
                to_bad = _routed_to(port, bad) - before
            finally:
                gateway.stop(timeout=30)
            ttft = [r[0] for r in res if r[2] == "OK"]
            e2e = [r[1] for r in res if r[2] == "OK"]
            rows.append(dict(policy=policy, ok=len(ttft), errors=len(res) - len(ttft), to_bad=to_bad,
                             ttft_p50=_pct(ttft, 0.5), ttft_p99=_pct(ttft, 0.99), e2e_p50=_pct(e2e, 0.5),
                             e2e_p99=_pct(e2e, 0.99), e2e_mean=statistics.fmean(e2e) if e2e else float("nan"),
                             wall_s=wall))
            print(f"  {policy}: done in {wall:.1f}s", flush=True)
    finally:
        stop.set()
        if stuck_task is not None:
            loop.run_until_complete(asyncio.wait_for(stuck_task, 30))
        for p in instances:
            p.terminate()
    bad_desc = (f"+{FLAGS.slow_delay_s * 1e3:.0f} ms per step" if FLAGS.scenario == "slow" else
                f"{FLAGS.stuck_requests} long requests (400 tokens) kept running on it")
    table(f"Routing policies: {FLAGS.num_instances} instances, {bad} bad ({bad_desc}); {FLAGS.num_requests} "
          f"requests at {FLAGS.rate:g}/s, prompts {FLAGS.min_prompt}-{FLAGS.max_prompt} tokens, {FLAGS.max_tokens} "
          "generated",
          ["policy", "TTFT p50 (ms)", "TTFT p99 (ms)", "E2E p50 (ms)", "E2E p99 (ms)", "E2E mean (ms)",
           f"sent to {bad}", "errors"],
          [[r["policy"], *(r[k] * 1e3 for k in ("ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99", "e2e_mean")),
            r["to_bad"], r["errors"]] for r in rows])
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(dict(flags={k: getattr(FLAGS, k) for k in ("num_instances", "scenario", "slow_delay_s",
                                                                  "num_requests", "rate", "max_tokens")},
                           rows=rows), f, indent=1)

