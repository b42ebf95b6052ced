"""`python -m serving.bench disagg_mix`: issue 40's benchmark, scaled to the shipped tiny model (context 256): long
prompts arrive while N requests decode; the decodes' inter-token latency (ITL) and the long prompts' TTFT with one
instance doing both (chunked prefill) vs a prefill + a decode instance (--role), the same total cores (2 vs 1 + 1,
pinned), a gateway in front of each (it and this client pinned to the cores that decode). Results:
docs/disaggregation.md."""
from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time

import grpc
from absl import flags

from serving.bench.harness import table
from serving.process import ReadyFileProcess

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "models/tiny/target", "Model directory (the shipped tiny model: context 256).")
flags.DEFINE_integer("decodes", 16, "Requests decoding while the long prompts arrive.")
flags.DEFINE_integer("decode_tokens", 200, "Tokens each decode request generates.")
flags.DEFINE_integer("long_prompts", 6, "Long prompts, one every --long_interval_s once the decodes run.")
flags.DEFINE_integer("long_tokens", 224, "Tokens per long prompt (several prefill chunks).")
flags.DEFINE_float("long_interval_s", 1.0, "Seconds between long prompts.")
flags.DEFINE_integer("max_num_batched_tokens", 64, "Token budget per step (the prefill chunk is what decodes leave).")
flags.DEFINE_list("cores", [], "CPU cores to pin to (default: the first two this process may use); the colocated "
                  "instance gets both, the prefill and decode instances one each.")

ENGINE = ("--page_size=8", "--num_pages=1024", "--max_num_seqs=32", "--min_token_bucket=16", "--http_port=-1",
          "--metrics_port=-1")


def _instance(workdir: str, name: str, cores: set[int], *flags_: str) -> ReadyFileProcess:
    args = ["-m", "serving.server", f"--model={FLAGS.model}", "--host=127.0.0.1", "--port=0", *ENGINE,
            f"--max_num_batched_tokens={FLAGS.max_num_batched_tokens}", *flags_]
    proc = ReadyFileProcess(name, args, os.path.join(workdir, name), env={
        "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}, ready_timeout_s=600.0)
    os.makedirs(os.path.join(workdir, name), exist_ok=True)
    proc.start()
    os.sched_setaffinity(proc.proc.pid, cores)  # before it starts its threads (they inherit it)
    return proc


def _gateway(workdir: str, config: dict) -> ReadyFileProcess:
    import yaml
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "gateway.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    gw = ReadyFileProcess("gateway", ["-m", "serving.gateway", f"--config={path}", "--host=127.0.0.1", "--port=0",
                                      "--metrics_port=-1", f"--jobs_db={os.path.join(workdir, 'jobs.sqlite')}"],
                          workdir, ready_timeout_s=120.0)
    return gw.start().wait_ready()


async def _one(stub, ids: list[int], max_tokens: int, arrivals: list[float]) -> None:
    from serving.wire import meshserve_pb2 as pb
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParameters(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    async for r in stub.Generate(req, timeout=300):
        now = time.monotonic()
        arrivals.extend([now] * len(r.token_ids))


async def _drive(target: str) -> dict:
    """The decodes start; once each has 3 tokens (a P/D pair: past its handoff) and 1 s more, the long prompts
    arrive; returns the decodes' ITL (ms) in that second ("before") and from the first long prompt's arrival to the
    last one's first token ("during"), their first-to-second token gap, and the long prompts' TTFT (ms)."""
    import random

    from serving.wire import meshserve_pb2_grpc as pb_grpc
    rng = random.Random(0)
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.InferenceStub(ch)
        # warm the path once (both stages, a long prompt's chunks)
        await _one(stub, [rng.randrange(3, 8000) for _ in range(FLAGS.long_tokens)], 4, [])
        decodes = [[] for _ in range(FLAGS.decodes)]
        tasks = [asyncio.ensure_future(_one(stub, [rng.randrange(3, 8000) for _ in range(16)], FLAGS.decode_tokens,
                                            d)) for d in decodes]
        while not all(len(d) >= 3 for d in decodes):  # every decode past its handoff (P/D: on the decode side)
            await asyncio.sleep(0.01)
        t_base = time.monotonic()
        await asyncio.sleep(1.0)
        longs, starts, t_first = [[] for _ in range(FLAGS.long_prompts)], [], time.monotonic()
        for k in range(FLAGS.long_prompts):
            starts.append(time.monotonic())
            tasks.append(asyncio.ensure_future(_one(stub, [rng.randrange(3, 8000) for _ in range(FLAGS.long_tokens)],
                                                    8, longs[k])))
            await asyncio.sleep(FLAGS.long_interval_s)
        while not all(longs):
            await asyncio.sleep(0.01)
        t_last = max(lg[0] for lg in longs)
        await asyncio.gather(*tasks)
        still = sum(1 for d in decodes if d[-1] < t_last)  # finished before the window ended
    itl = [(b - a) * 1e3 for d in decodes for a, b in zip(d, d[1:]) if t_first <= b <= t_last]
    base = [(b - a) * 1e3 for d in decodes for a, b in zip(d, d[1:]) if t_base <= a and b < t_first]
    return {"itl": itl, "itl_before": base, "handoff": [(d[1] - d[0]) * 1e3 for d in decodes],
            "ttft": [(lg[0] - s) * 1e3 for lg, s in zip(longs, starts)],
            "finished_early": still}


def _pct(v: list[float], q: float) -> float:
    return statistics.quantiles(v, n=100)[q - 1] if len(v) > 1 else float("nan")


def main() -> None:
    cores = sorted(int(c) for c in FLAGS.cores) if FLAGS.cores else sorted(os.sched_getaffinity(0))[:2]
    both, one, two = set(cores), {cores[0]}, {cores[-1]}
    rows = []
    with tempfile.TemporaryDirectory(prefix="disagg_mix.") as workdir:
        for label in ("colocated (1 instance, 2 cores)", "1 prefill + 1 decode (1 core each)"):
            procs = []
            try:
                if label.startswith("colocated"):
                    procs.append(_instance(workdir, "both", both))
                    procs[0].wait_ready()
                    config = {"pools": [{"name": "all", "instances": [{"name": "i0", "target": procs[0].target}]}]}
                else:
                    procs.append(_instance(workdir, "prefill", one, "--role=prefill"))
                    procs.append(_instance(workdir, "decode", two, "--role=decode"))
                    for p in procs:
                        p.wait_ready()
                    config = {"pools": [{"name": "p", "instances": [{"name": "p0", "target": procs[0].target}]},
                                        {"name": "d", "instances": [{"name": "d0", "target": procs[1].target}]}],
                              "disaggregation": {"prefill_pools": ["p"], "decode_pools": ["d"]}}
                config.update({"routing": {"load_interval_ms": 100}, "isolation": {"enabled": False}})
                gw = _gateway(os.path.join(workdir, "gw" + str(len(rows))), config)
                procs.append(gw)
                # the gateway and this client run where the decodes run (a P/D pair: the decode instance's core)
                decode_cores = both if label.startswith("colocated") else two
                os.sched_setaffinity(gw.proc.pid, decode_cores)
                mine = os.sched_getaffinity(0)
                os.sched_setaffinity(0, decode_cores)
                try:
                    res = asyncio.run(_drive(gw.target))
                finally:
                    os.sched_setaffinity(0, mine)
            finally:
                for p in reversed(procs):
                    p.stop(timeout=30)
            rows.append([label, _pct(res["itl_before"], 50), _pct(res["itl"], 50), _pct(res["itl"], 99),
                         max(res["itl"]), _pct(res["ttft"], 50), max(res["ttft"]), len(res["itl"]),
                         FLAGS.decodes - res["finished_early"], _pct(res["handoff"], 50)])
            print(rows[-1], flush=True)
    table(f"{FLAGS.decodes} decodes of {FLAGS.decode_tokens} tokens; {FLAGS.long_prompts} prompts of "
          f"{FLAGS.long_tokens} tokens, one every {FLAGS.long_interval_s:g}s; --max_num_batched_tokens="
          f"{FLAGS.max_num_batched_tokens}; cores {cores}; times in ms",
          ["config", "ITL p50 before", "ITL p50 during", "ITL p99 during", "ITL max during", "long TTFT p50",
           "long TTFT max", "ITL samples", "decodes still running at the end",
           "token 1 -> 2 gap p50 (P/D: the handoff)"], rows)
