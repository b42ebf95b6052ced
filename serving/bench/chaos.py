"""Fault injection against real processes: a gateway (API keys, jobs) in front of instance servers on 127.0.0.1
(`Cluster`), load from real gRPC clients, and scenarios that each inject one fault and return what happened
(`Row`): overload past capacity, `kill -9` of an instance, a hung instance (SIGSTOP), a cancel storm, the gateway
killed with jobs in flight, and a soak. `python -m serving.bench chaos` runs them at scale and prints the table;
tests/serving/test_faults.py runs them small in CI. Details: docs/benchmarks.md.

    python -m serving.bench chaos [--chaos_model=DIR] [--chaos_seconds=20] [--soak_s=600]
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import random
import signal
import tempfile
import time
import urllib.request

import grpc
from absl import flags

from serving.bench.harness import cpu_name
from serving.process import REPO_ROOT, ReadyFileProcess, ServerProcess

_MODEL = flags.DEFINE_string("chaos_model", "", "Model directory (default: the shipped tiny model).")
_SECONDS = flags.DEFINE_float("chaos_seconds", 20.0, "Load duration of each scenario.")
_SOAK_S = flags.DEFINE_float("soak_s", 600.0, "Soak duration (steady load, RSS sampled); 0: no soak.")
_INSTANCES = flags.DEFINE_integer("chaos_instances", 2, "Instance servers behind the gateway.")
_WORKDIR = flags.DEFINE_string("chaos_workdir", "", "Logs and configuration (default: a temp dir).")

KEY = "chaos-key"
ADMIN_KEY = "chaos-admin"
METADATA = (("authorization", f"Bearer {KEY}"),)
GRACE_S = 5.0  # a request still open this long past its deadline is counted lost (hung)
CLIENTS = 32  # open-loop load: connections the requests are spread over


# ---------------------------------------------------------------------------- the processes
class Cluster:
    """`instances` instance servers and a gateway in front of them (one tenant key, an admin key, small queues so
    overload is refused rather than queued for minutes)."""

    def __init__(self, model_dir: str, workdir: str, *, instances: int = 2, instance_flags: tuple = (),
                 gateway_config: dict | None = None):
        self.model_dir, self.workdir = model_dir, workdir
        self.instance_flags = ("--enable_prefix_caching=false", *instance_flags)
        self.instances: list[ServerProcess] = []
        self.gateway: ReadyFileProcess | None = None
        self.extra_config = gateway_config or {}
        self.num_instances = instances

    def start(self) -> "Cluster":
        # One first: the others load its programs from the compilation cache instead of compiling alongside.
        self.instances.append(self._instance(0).wait_ready())
        self.instances += [self._instance(i) for i in range(1, self.num_instances)]
        for p in self.instances:
            p.wait_ready()
        config = {"pools": [{"name": "a", "instances": [{"name": f"i{i}", "target": p.target}
                                                        for i, p in enumerate(self.instances)]}],
                  "tenants": [{"name": "chaos", "api_keys": [KEY]}], "admin_keys": [ADMIN_KEY],
                  "admission": {"max_inflight_per_instance": 32, "queue_bounds": {"interactive": 64, "batch": 64},
                                "request_timeout_s": 60},
                  "isolation": {"window_s": 0.5, "silent_after_s": 2.0, "healthy_windows": 2}}
        for k, v in self.extra_config.items():
            config[k] = {**config.get(k, {}), **v} if isinstance(v, dict) else v
        path = os.path.join(self.workdir, "gateway.json")
        with open(path, "w") as f:
            json.dump(config, f)
        self.gateway = ReadyFileProcess("gateway", ["-m", "serving.gateway", f"--config={path}", "--host=127.0.0.1",
                                                    "--port=0", "--metrics_port=0", "--drain_grace_s=5",
                                                    f"--jobs_db={os.path.join(self.workdir, 'jobs.sqlite')}"],
                                        self.workdir, ready_timeout_s=60).start().wait_ready()
        self.wait_states({f"i{i}": "healthy" for i in range(len(self.instances))}, 60, need_report=True)
        return self

    def _instance(self, i: int, port: int = 0) -> ServerProcess:
        return ServerProcess(self.model_dir, os.path.join(self.workdir, f"i{i}"), f"--instance_id=i{i}",
                             *self.instance_flags, *([f"--port={port}"] if port else []))  # the last --port wins

    def restart_instance(self, i: int) -> float:
        """Starts instance i again on its old port (the gateway's configuration names it); returns the seconds
        until it serves."""
        t0 = time.monotonic()
        self.instances[i] = self._instance(i, self.instances[i].port).wait_ready()
        return time.monotonic() - t0

    def states(self) -> dict:
        from serving.gateway.proto import gateway_pb2 as gpb
        from serving.gateway.proto import gateway_pb2_grpc as gpb_grpc
        with grpc.insecure_channel(self.gateway.target) as ch:
            listed = gpb_grpc.GatewayAdminStub(ch).ListInstances(
                gpb.ListInstancesRequest(), metadata=[("authorization", f"Bearer {ADMIN_KEY}")], timeout=10)
        return {i.name: i for i in listed.instances}

    def wait_states(self, wanted: dict, timeout: float, need_report: bool = False) -> float:
        """Seconds until every named instance is in its wanted state; raises TimeoutError."""
        t0 = time.monotonic()
        while True:
            st = self.states()
            if all(st[n].state == s and (not need_report or st[n].report_age_s >= 0) for n, s in wanted.items()):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"instances not {wanted} after {timeout}s: "
                                   f"{ {n: (i.state, i.state_reason) for n, i in st.items()} }")
            time.sleep(0.05)

    def books(self, timeout: float = 30.0) -> list[dict]:
        """Each live instance's books once it is idle: pages still used, requests running or waiting, and the
        scheduler's invariant check."""
        from serving.wire.client import Client
        out = []
        for p in self.instances:
            if p.proc.poll() is not None:
                continue
            with Client(p.target, timeout=10) as c:
                t0 = time.monotonic()
                while True:
                    load = c.get_load(check_invariants=True)
                    idle = load.num_running == 0 and load.num_waiting == 0
                    if (idle and load.kv_pages_free == load.kv_pages_total) or time.monotonic() - t0 > timeout:
                        break
                    time.sleep(0.05)
            out.append({"pages_used": load.kv_pages_total - load.kv_pages_free, "running": load.num_running,
                        "waiting": load.num_waiting, "invariant_error": load.invariant_error})
        return out

    def gateway_requests(self) -> int:
        """Generate requests the gateway's servicer has finished, every status (its requests counter)."""
        with urllib.request.urlopen(self.gateway.metrics_url, timeout=10) as r:
            text = r.read().decode()
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("meshserve:gateway_requests_total{")))

    def rss_mb(self) -> dict:
        out = {}
        for name, p in [*((f"i{i}", p) for i, p in enumerate(self.instances)), ("gateway", self.gateway)]:
            try:
                with open(f"/proc/{p.proc.pid}/status") as f:
                    out[name] = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
            except (OSError, StopIteration):
                pass
        return out

    def stop(self) -> None:
        for p in [self.gateway, *self.instances]:
            if p is not None and p.proc is not None and p.proc.poll() is None:
                try:
                    os.kill(p.proc.pid, signal.SIGCONT)
                except OSError:
                    pass
                p.stop()


# ---------------------------------------------------------------------------- load
@dataclasses.dataclass
class Tally:
    """How the requests of a scenario ended. ok: every token asked for; rejected: RESOURCE_EXHAUSTED with a retry
    hint; failed: another explicit status (by code); lost: no end (hung past its deadline + GRACE_S), a broken
    client call, or a short or wrong answer."""
    sent: int = 0
    ok: int = 0
    rejected: int = 0
    failed: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    lost: int = 0
    lost_examples: list = dataclasses.field(default_factory=list)
    failed_examples: list = dataclasses.field(default_factory=list)
    started_failed: int = 0  # failed after tokens had streamed (not retriable)
    cancelled: int = 0  # left by the client on purpose (cancel storm)

    def lose(self, why: str) -> None:
        self.lost += 1
        if len(self.lost_examples) < 5:
            self.lost_examples.append(why)

    @property
    def num_failed(self) -> int:
        return sum(self.failed.values())


def prompt(seed: int, n: int = 16) -> list[int]:
    return [3 + (seed * 7919 + i * 131) % 500 for i in range(n)]


async def request(client, tally: Tally, seed: int, *, max_tokens: int = 8, deadline_s: float = 30.0,
                  expect: list[int] | None = None, cancel_after: int | None = None) -> list[int]:
    """One streamed greedy request through the gateway, its end added to `tally`; cancel_after: leave after that
    many responses (a cancel, not counted)."""
    from serving.wire.client import ClientError
    tally.sent += 1
    tokens: list[int] = []
    finished = False

    async def run():
        nonlocal finished
        n = 0
        async for r in client.generate(prompt(seed), max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                       timeout=deadline_s, metadata=METADATA):
            tokens.extend(r.token_ids)
            n += 1
            if r.finish_reason and r.index == 0:
                finished = True
            if cancel_after is not None and n >= cancel_after:
                return
    try:
        await asyncio.wait_for(run(), deadline_s + GRACE_S)
    except ClientError as e:
        if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.retry_after_s:
            tally.rejected += 1
        else:
            tally.failed[e.code.name] += 1
            tally.started_failed += bool(tokens)
            if len(tally.failed_examples) < 5:
                tally.failed_examples.append(f"{e.code.name}: {e.details}")
        return tokens
    except asyncio.TimeoutError:
        tally.lose(f"no end {deadline_s + GRACE_S:.0f}s after sending (deadline {deadline_s:.0f}s)")
        return tokens
    except Exception as e:  # noqa: BLE001 - counted, not raised: the scenario goes on
        tally.lose(f"{type(e).__name__}: {e}")
        return tokens
    if cancel_after is not None and not finished:
        tally.cancelled += 1
        return tokens
    if not finished or len(tokens) != max_tokens or (expect is not None and tokens != expect):
        tally.lose(f"wrong answer: {len(tokens)} of {max_tokens} tokens" + (
            " (different tokens)" if expect is not None and len(tokens) == max_tokens else ""))
    else:
        tally.ok += 1
    return tokens


async def open_loop(target: str, rate: float, seconds: float, tally: Tally, *, max_tokens: int = 8,
                    deadline_s: float = 30.0, during=None) -> None:
    """Poisson arrivals at `rate` per second for `seconds`; `during(elapsed)` is called every 50 ms (a fault)."""
    from serving.wire.client import AsyncClient
    rng = random.Random(1)
    # Many clients, as in production, each on its own connection.
    clients = [AsyncClient(target, channel=grpc.aio.insecure_channel(  # its own connection (no shared subchannel)
        target, options=[("grpc.use_local_subchannel_pool", 1)])) for _ in range(CLIENTS)]
    try:
        tasks, t0, seed = [], time.monotonic(), 0
        next_at = 0.0
        while (now := time.monotonic() - t0) < seconds:
            while next_at <= now:
                tasks.append(asyncio.ensure_future(request(clients[seed % CLIENTS], tally, seed,
                                                           max_tokens=max_tokens, deadline_s=deadline_s)))
                seed += 1
                next_at += rng.expovariate(rate)
            if during is not None:
                await asyncio.to_thread(during, now)
            await asyncio.sleep(min(0.05, max(0.0, next_at - (time.monotonic() - t0))))
        await asyncio.gather(*tasks)
    finally:
        await asyncio.gather(*(c.close() for c in clients))


async def closed_loop(target: str, concurrency: int, seconds: float, *, max_tokens: int = 8) -> float:
    """Requests completed per second with `concurrency` always in flight."""
    from serving.wire.client import AsyncClient
    tally = Tally()
    async with AsyncClient(target) as client:
        t0 = time.monotonic()

        async def worker(w):
            k = 0
            while time.monotonic() - t0 < seconds:
                await request(client, tally, w * 100_000 + k, max_tokens=max_tokens)
                k += 1
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        return tally.ok / (time.monotonic() - t0)


# ---------------------------------------------------------------------------- scenarios
@dataclasses.dataclass
class Row:
    scenario: str
    injected: str
    load: str
    tally: Tally
    pages_leaked: int = 0
    invariant_errors: int = 0
    time_to_out_s: float | None = None  # fault -> the gateway stops routing there (failed / quarantined)
    time_to_readmit_s: float | None = None  # recovery -> routed again
    gateway_counted: int | None = None  # requests the gateway's servicer finished (overload: must be all sent)
    notes: str = ""


def _books(cluster: Cluster, row: Row) -> Row:
    books = cluster.books()
    row.pages_leaked = sum(b["pages_used"] for b in books)
    row.invariant_errors = sum(bool(b["invariant_error"]) for b in books)
    return row


def capacity(cluster: Cluster, seconds: float, concurrency: int = 32, max_tokens: int = 8) -> float:
    return asyncio.run(closed_loop(cluster.gateway.target, concurrency, seconds, max_tokens=max_tokens))


def overload(cluster: Cluster, rate: float, seconds: float, max_tokens: int = 8) -> Row:
    """Open-loop load past capacity; also counts the requests the gateway's servicer saw (a request refused by gRPC
    itself, before the servicer, would end without a retry hint and without being counted: issue 22)."""
    tally = Tally()
    before = cluster.gateway_requests()
    asyncio.run(open_loop(cluster.gateway.target, rate, seconds, tally, max_tokens=max_tokens))
    t0 = time.monotonic()  # the servicer counts a request just after its status went out
    while (counted := cluster.gateway_requests() - before) < tally.sent and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    row = Row("overload", f"{rate:.0f} req/s for {seconds:.0f}s", f"{rate:.0f} req/s", tally, gateway_counted=counted,
              notes=f"the gateway's servicer saw {counted} of {tally.sent}")
    return _books(cluster, row)


def kill_instance(cluster: Cluster, rate: float, seconds: float, victim: int = 1) -> Row:
    """kill -9 of instance `victim` a third into the load; restarted after the load; readmission timed."""
    tally, marks = Tally(), {}
    name = f"i{victim}"

    def fault(elapsed):
        if "kill" not in marks and elapsed >= seconds / 3:
            cluster.instances[victim].proc.kill()
            marks["kill"] = time.monotonic()
        if "kill" in marks and "out" not in marks and cluster.states()[name].state == "failed":
            marks["out"] = time.monotonic() - marks["kill"]
    asyncio.run(open_loop(cluster.gateway.target, rate, seconds, tally, during=fault))
    cluster.instances[victim].proc.wait()
    ready_s = cluster.restart_instance(victim)
    readmit = ready_s + cluster.wait_states({name: "healthy"}, 60)
    row = Row("kill -9 instance", f"SIGKILL {name} at {seconds / 3:.0f}s, restarted after", f"{rate:.0f} req/s",
              tally, time_to_out_s=marks.get("out"), time_to_readmit_s=readmit,
              notes=f"{tally.started_failed} streaming ended UNAVAILABLE; restart ready in {ready_s:.0f}s")
    return _books(cluster, row)


def hang_instance(cluster: Cluster, rate: float, seconds: float, hang_s: float, deadline_s: float,
                  victim: int = 1) -> Row:
    """SIGSTOP of instance `victim` for hang_s (longer than the requests' deadline), then SIGCONT."""
    tally, marks = Tally(), {}
    name = f"i{victim}"
    pid = cluster.instances[victim].proc.pid

    def fault(elapsed):
        if "stop" not in marks and elapsed >= seconds / 4:
            os.kill(pid, signal.SIGSTOP)
            marks["stop"] = time.monotonic()
        if "stop" in marks and "out" not in marks and cluster.states()[name].state != "healthy":
            marks["out"] = time.monotonic() - marks["stop"]
        if "stop" in marks and "cont" not in marks and time.monotonic() - marks["stop"] >= hang_s:
            os.kill(pid, signal.SIGCONT)
            marks["cont"] = time.monotonic()
    try:
        asyncio.run(open_loop(cluster.gateway.target, rate, seconds, tally, deadline_s=deadline_s, during=fault))
    finally:
        os.kill(pid, signal.SIGCONT)
    cont = marks.get("cont", time.monotonic())
    readmit = cluster.wait_states({name: "healthy"}, 60) + (time.monotonic() - cont if "cont" in marks else 0)
    row = Row("hung instance", f"SIGSTOP {name} {hang_s:.0f}s (deadline {deadline_s:.0f}s), SIGCONT",
              f"{rate:.0f} req/s", tally, time_to_out_s=marks.get("out"), time_to_readmit_s=readmit,
              notes=f"{tally.failed.get('DEADLINE_EXCEEDED', 0)} ended DEADLINE_EXCEEDED")
    return _books(cluster, row)


def cancel_storm(cluster: Cluster, streams: int, max_tokens: int = 64, in_flight: int = 96) -> Row:
    """`streams` long streams, `in_flight` at a time, each cancelled after a random number of responses, then the
    same prompts' greedy answers compared with those computed before the storm."""
    from serving.wire.client import AsyncClient
    tally, check = Tally(), Tally()
    rng = random.Random(7)

    async def run():
        async with AsyncClient(cluster.gateway.target) as client:
            before = await asyncio.gather(*(request(client, Tally(), s, max_tokens=16) for s in range(8)))
            room = asyncio.Semaphore(in_flight)  # within the gateway's admission: cancelled, not refused

            async def one(i):
                async with room:
                    await request(client, tally, 1000 + i, max_tokens=max_tokens,
                                  cancel_after=rng.randint(1, max_tokens // 2))
            await asyncio.gather(*(one(i) for i in range(streams)))
            await asyncio.gather(*(request(client, check, s, max_tokens=16, expect=before[s]) for s in range(8)))
    asyncio.run(run())
    tally.sent += check.sent
    tally.ok += check.ok
    tally.lost += check.lost
    tally.lost_examples += check.lost_examples
    row = Row("cancel storm", f"{streams} streams cancelled at random points", f"{in_flight} at once", tally,
              notes=f"then {check.ok}/8 greedy answers identical to before")
    return _books(cluster, row)


def restart_gateway_with_jobs(cluster: Cluster, jobs: int, max_tokens: int = 32) -> Row:
    """`jobs` asynchronous jobs submitted, the gateway killed (-9) while they run, restarted on the same jobs
    database: every job ends SUCCEEDED exactly once with a whole answer."""
    from serving.gateway.proto import gateway_pb2 as gpb
    from serving.gateway.proto import gateway_pb2_grpc as gpb_grpc
    from serving.wire.client import generate_request
    tally = Tally()
    md = list(METADATA)
    ids = []
    with grpc.insecure_channel(cluster.gateway.target) as ch:
        stub = gpb_grpc.JobsStub(ch)
        for k in range(jobs):
            req = generate_request(prompt(5000 + k), max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            ids.append(stub.SubmitJob(gpb.SubmitJobRequest(request=req), metadata=md, timeout=10).job_id)
            tally.sent += 1
    cluster.gateway.stop(kill=True)
    cluster.gateway.start().wait_ready()
    deadline = time.monotonic() + 120
    final = {}
    with grpc.insecure_channel(cluster.gateway.target) as ch:
        stub = gpb_grpc.JobsStub(ch)
        while len(final) < len(ids) and time.monotonic() < deadline:
            for job_id in ids:
                if job_id not in final:
                    job = stub.GetJob(gpb.GetJobRequest(job_id=job_id), metadata=md, timeout=10)
                    if job.state in (gpb.JOB_STATE_SUCCEEDED, gpb.JOB_STATE_FAILED):
                        final[job_id] = job
            time.sleep(0.2)
    reran = 0
    for job_id in ids:
        job = final.get(job_id)
        if job is None:
            tally.lose(f"job {job_id} unfinished after 120 s")
        elif job.state == gpb.JOB_STATE_FAILED:
            tally.failed[job.error_code] += 1
        elif len(job.result.token_ids) != max_tokens:
            tally.lose(f"job {job_id}: {len(job.result.token_ids)} of {max_tokens} tokens")
        else:
            tally.ok += 1
            reran += job.attempts > 1
    cluster.wait_states({f"i{i}": "healthy" for i in range(len(cluster.instances))}, 30)
    row = Row("gateway kill -9 with jobs", f"SIGKILL the gateway with {jobs} jobs submitted, restarted",
              f"{jobs} jobs", tally, notes=f"{reran} jobs run again after the restart, each finished once")
    return _books(cluster, row)


def soak(cluster: Cluster, rate: float, seconds: float) -> tuple[Row, dict, dict]:
    """Steady load for `seconds`; RSS of every process before and after."""
    tally = Tally()
    asyncio.run(open_loop(cluster.gateway.target, rate, 5, Tally()))  # allocator and caches warm
    before = cluster.rss_mb()
    asyncio.run(open_loop(cluster.gateway.target, rate, seconds, tally))
    after = cluster.rss_mb()
    growth = ", ".join(f"{k} {after[k] - before[k]:+.1f}" for k in after if k in before)
    row = Row("soak", f"{seconds / 60:.0f} min steady", f"{rate:.0f} req/s", tally, notes=f"RSS MB: {growth}")
    return _books(cluster, row), before, after


# ---------------------------------------------------------------------------- report
def format_table(rows: list[Row], cpu: str, capacity_rps: float) -> str:
    head = ("scenario", "injected", "load", "sent", "ok", "rejected", "failed", "cancelled", "lost", "pages leaked",
            "out after", "readmitted after", "notes")
    lines = [f"CPU: {cpu}; capacity (closed loop, 8 output tokens): {capacity_rps:.1f} req/s",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        t = r.tally
        failed = ", ".join(f"{k} {v}" for k, v in sorted(t.failed.items())) or "0"

        def s(x):
            return "-" if x is None else f"{x:.2f} s"
        lines.append("| " + " | ".join(str(v) for v in (
            r.scenario, r.injected, r.load, t.sent, t.ok, t.rejected, failed, t.cancelled, t.lost, r.pages_leaked,
            s(r.time_to_out_s), s(r.time_to_readmit_s), r.notes)) + " |")
    return "\n".join(lines)


def main() -> None:
    model = _MODEL.value or os.path.join(REPO_ROOT, "models", "tiny", "target")
    workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="meshserve-chaos-")
    seconds = _SECONDS.value
    cluster = Cluster(model, workdir, instances=_INSTANCES.value)
    print(f"chaos: {_INSTANCES.value} instances of {model} behind a gateway; logs in {workdir}", flush=True)
    rows = []
    try:
        cluster.start()
        cap = capacity(cluster, min(10.0, seconds))
        print(f"capacity {cap:.1f} req/s", flush=True)
        steps = [
            lambda: overload(cluster, 2 * cap, seconds),
            lambda: kill_instance(cluster, 0.6 * cap, seconds),
            lambda: hang_instance(cluster, 0.5 * cap, seconds, hang_s=seconds / 2, deadline_s=seconds / 4),
            lambda: cancel_storm(cluster, 400),
            lambda: restart_gateway_with_jobs(cluster, 100),
        ]
        for step in steps:
            rows.append(step())
            print(format_table(rows[-1:], cpu_name(), cap).splitlines()[-1], flush=True)
        if _SOAK_S.value > 0:
            rows.append(soak(cluster, 0.5 * cap, _SOAK_S.value)[0])
        print("\n" + format_table(rows, cpu_name(), cap))
        for r in rows:
            for ex in r.tally.lost_examples:
                print(f"  lost in {r.scenario}: {ex}")
    finally:
        cluster.stop()
