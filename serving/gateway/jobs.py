"""Asynchronous jobs: `JobStore` (a local SQLite file, created 0600; the insert that acknowledges a job is fsynced) and
`JobManager`, which runs a submitted job through the gateway's normal path, stores its result or error, feeds GetJob /
WatchJob / CancelJob, delivers its signed callback (retried with backoff over a window, durably: the schedule lives in
the file), runs unfinished jobs again at restart (failing one the gateway died running `max_crashes` times) and
deletes finished ones after the retention window. Details: docs/gateway.md, docs/security.md."""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import sqlite3
import stat
import time
import urllib.parse
import uuid
from typing import AsyncIterator, Callable

import aiohttp
import grpc

from serving.gateway.callbacks import CallbackRefused, Deliverer, check_url, resolve, sign
from serving.gateway.config import ConfigError, GatewayConfig, webhook_key
from serving.gateway.proto import gateway_pb2 as gpb
from serving.wire import meshserve_pb2 as pb

log = logging.getLogger(__name__)

_SCHEMA = """CREATE TABLE IF NOT EXISTS jobs (
  job_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, state INTEGER NOT NULL, request BLOB NOT NULL,
  callback_url TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL, result BLOB,
  error_code TEXT NOT NULL DEFAULT '', error_message TEXT NOT NULL DEFAULT '',
  callback_status TEXT NOT NULL DEFAULT '', attempts INTEGER NOT NULL DEFAULT 0)"""
# Columns added since the first schema (ALTER TABLE on a file an older gateway wrote).
_ADDED_COLUMNS = {
    "crashes": "INTEGER NOT NULL DEFAULT 0",  # runs the gateway died in
    "idempotency_key": "TEXT NOT NULL DEFAULT ''",
    "submitted_digest": "TEXT NOT NULL DEFAULT ''",  # of the request and callback as submitted (idempotent retries)
    "callback_attempts": "INTEGER NOT NULL DEFAULT 0",
    "callback_next": "REAL NOT NULL DEFAULT 0",  # when the next delivery attempt is due
    "callback_since": "REAL NOT NULL DEFAULT 0",  # when the first was: the retry window counts from here
}
_INDEXES = ("CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency ON jobs (tenant, idempotency_key) "
            "WHERE idempotency_key != ''",
            "CREATE INDEX IF NOT EXISTS jobs_callbacks ON jobs (callback_status, callback_next)")
TERMINAL = (gpb.JOB_STATE_SUCCEEDED, gpb.JOB_STATE_FAILED, gpb.JOB_STATE_CANCELLED)
PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"  # callback_status ("" when there is no callback)
MAX_IDEMPOTENCY_KEY = 128
_STATE_NAMES = {gpb.JOB_STATE_SUCCEEDED: "succeeded", gpb.JOB_STATE_FAILED: "failed",
                gpb.JOB_STATE_CANCELLED: "cancelled"}


class JobError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code
        self.details = details


def _private_file(path: str) -> None:
    """Creates `path` readable by its owner only (jobs hold prompts and results); tightens an existing one."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    for p in (path, path + "-wal", path + "-shm"):
        try:
            mode = stat.S_IMODE(os.stat(p).st_mode)
        except FileNotFoundError:
            continue
        if mode & 0o077:
            log.warning("jobs db %s was mode %o: now 0600", p, mode)
            os.chmod(p, 0o600)


class JobStore:
    def __init__(self, path: str):
        if path != ":memory:":
            _private_file(path)  # before SQLite creates it (its -wal and -shm files take the same mode)
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute(_SCHEMA)
        have = {row[1] for row in self.db.execute("PRAGMA table_info(jobs)")}
        for column, decl in _ADDED_COLUMNS.items():
            if column not in have:
                self.db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {decl}")
        for sql in _INDEXES:
            self.db.execute(sql)
        # Callbacks an older gateway never attempted are delivered like any pending one.
        self.db.execute("UPDATE jobs SET callback_status = ?, callback_since = updated WHERE callback_status = '' AND "
                        "callback_url != '' AND state IN (?, ?, ?)", (PENDING, *TERMINAL))

    def close(self) -> None:
        self.db.close()

    def insert(self, job_id: str, tenant: str, request: pb.GenerateRequest, callback_url: str,
               idempotency_key: str = "", submitted_digest: str = "") -> None:
        """Durable when it returns (synchronous=FULL: the job is acknowledged after this)."""
        now = time.time()
        self.db.execute("PRAGMA synchronous=FULL")
        try:
            self.db.execute("INSERT INTO jobs (job_id, tenant, state, request, callback_url, created, updated, "
                            "idempotency_key, submitted_digest) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            (job_id, tenant, gpb.JOB_STATE_QUEUED, request.SerializeToString(), callback_url, now,
                             now, idempotency_key, submitted_digest))
        finally:
            self.db.execute("PRAGMA synchronous=NORMAL")

    def update(self, job_id: str, **fields) -> None:
        fields["updated"] = time.time()
        cols = ", ".join(f"{k} = ?" for k in fields)
        self.db.execute(f"UPDATE jobs SET {cols} WHERE job_id = ?", (*fields.values(), job_id))

    def get(self, job_id: str) -> gpb.Job | None:
        row = self.db.execute("SELECT job_id, tenant, state, callback_url, created, updated, result, error_code, "
                              "error_message, callback_status, attempts, callback_attempts FROM jobs WHERE job_id = ?",
                              (job_id,)).fetchone()
        if row is None:
            return None
        job = gpb.Job(job_id=row[0], tenant=row[1], state=row[2], callback_url=row[3], created_time=row[4],
                      updated_time=row[5], error_code=row[7], error_message=row[8], callback_status=row[9],
                      attempts=row[10], callback_attempts=row[11])
        if row[6]:
            job.result.ParseFromString(row[6])
        return job

    def request(self, job_id: str) -> pb.GenerateRequest:
        row = self.db.execute("SELECT request FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return pb.GenerateRequest.FromString(row[0])

    def find_idempotent(self, tenant: str, key: str) -> tuple[str, str] | None:
        """(job id, submitted digest) of the tenant's job with this idempotency key."""
        return self.db.execute("SELECT job_id, submitted_digest FROM jobs WHERE tenant = ? AND idempotency_key = ?",
                               (tenant, key)).fetchone()

    def unfinished(self) -> list[tuple[str, int, int]]:
        """(job id, state, crashes) of each queued or running job, oldest first."""
        return self.db.execute("SELECT job_id, state, crashes FROM jobs WHERE state IN (?, ?) ORDER BY created",
                               (gpb.JOB_STATE_QUEUED, gpb.JOB_STATE_RUNNING)).fetchall()

    def due_callbacks(self, now: float, limit: int) -> list[str]:
        return [r[0] for r in self.db.execute("SELECT job_id FROM jobs WHERE callback_status = ? AND callback_next <= ?"
                                              " ORDER BY callback_next LIMIT ?", (PENDING, now, limit))]

    def next_callback_time(self) -> float | None:
        return self.db.execute("SELECT MIN(callback_next) FROM jobs WHERE callback_status = ?",
                               (PENDING,)).fetchone()[0]

    def callback_since(self, job_id: str) -> float:
        return self.db.execute("SELECT callback_since FROM jobs WHERE job_id = ?", (job_id,)).fetchone()[0]

    def expire(self, before: float) -> int:
        """Deletes jobs finished before `before` whose callback is not still pending; returns how many."""
        return self.db.execute("DELETE FROM jobs WHERE state IN (?, ?, ?) AND updated < ? AND callback_status != ?",
                               (*TERMINAL, before, PENDING)).rowcount


class JobManager:
    """`run(request, tenant)` is the gateway's internal generate: an async iterator of GenerateResponses that
    raises JobError carrying (code, details). `config()` is the gateway's current configuration."""

    def __init__(self, store: JobStore, run: Callable[[pb.GenerateRequest, str], AsyncIterator[pb.GenerateResponse]],
                 config: Callable[[], GatewayConfig], *, on_state: Callable[[str], None] | None = None):
        self.store = store
        self._run = run
        self.config = config
        self.deliverer = Deliverer(lambda: config().callbacks)
        self._on_state = on_state or (lambda state: None)
        self._tasks: dict[str, asyncio.Task] = {}
        self._deliveries: dict[str, asyncio.Task] = {}
        self._changed: dict[str, asyncio.Event] = {}
        self._wake = asyncio.Event()
        self._maintenance: asyncio.Task | None = None
        self._stopping = False

    def start(self) -> int:
        """Resumes unfinished jobs (after a restart) and starts the callback and retention loop; returns how many
        jobs were resumed. A job found RUNNING was running when the gateway died: after `max_crashes` such deaths it
        fails instead of running again (its request may be what kills the gateway)."""
        max_crashes = self.config().jobs.max_crashes
        resumed = 0
        for job_id, state, crashes in self.store.unfinished():
            if state == gpb.JOB_STATE_RUNNING:
                crashes += 1
                self.store.update(job_id, crashes=crashes)
                if crashes >= max_crashes:
                    log.error("job %s: the gateway died %d times while running it; failed, not run again", job_id,
                              crashes)
                    self._finish(job_id, state=gpb.JOB_STATE_FAILED, error_code="INTERNAL", error_message=(
                        f"the gateway stopped unexpectedly {crashes} times while running this job (its request may "
                        f"be what stops it; jobs.max_crashes is {max_crashes}); it is not run again"))
                    continue
            log.info("job %s: resumed after a restart", job_id)
            self._spawn(job_id)
            resumed += 1
        self._maintenance = asyncio.ensure_future(self._maintenance_loop())
        return resumed

    async def stop(self) -> None:
        self._stopping = True
        tasks = [*self._tasks.values(), *self._deliveries.values()] + ([self._maintenance] if self._maintenance else [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.deliverer.close()

    # ------------------------------------------------------------------ submission and queries
    async def submit(self, request: pb.GenerateRequest, callback_url: str, tenant: str,
                     idempotency_key: str = "") -> gpb.Job:
        """A new job, or (same `idempotency_key` from the same tenant) the job an earlier identical submission made."""
        if request.sampling.n > 1:
            raise JobError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.n: a job's result holds one completion, got "
                           f"n={request.sampling.n}; submit n jobs (with different seeds) or use Generate")
        if len(idempotency_key) > MAX_IDEMPOTENCY_KEY or not idempotency_key.isprintable() \
                or not idempotency_key.isascii():
            raise JobError(grpc.StatusCode.INVALID_ARGUMENT, f"idempotency_key: at most {MAX_IDEMPOTENCY_KEY} "
                           f"printable ASCII characters, got {len(idempotency_key)} characters")
        submitted = request.SerializeToString(deterministic=True) + b"\0" + callback_url.encode()
        digest = hashlib.sha256(submitted).hexdigest()
        if (earlier := self._idempotent(tenant, idempotency_key, digest)) is not None:
            return earlier
        if callback_url:
            cfg = self.config().callbacks
            try:
                callback_url = check_url(callback_url, cfg)
                parts = urllib.parse.urlsplit(callback_url)
                await resolve(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), cfg,
                              self.deliverer.dns)
            except CallbackRefused as e:
                raise JobError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            if self._signing_key(tenant) is None:
                raise JobError(grpc.StatusCode.FAILED_PRECONDITION, f"callback_url: callbacks are signed and tenant "
                               f"{tenant!r} has no webhook secret (tenants[].webhook_secret or "
                               "callbacks.webhook_secret in the gateway's configuration)")
            if (earlier := self._idempotent(tenant, idempotency_key, digest)) is not None:
                return earlier  # the same submission, retried while this one resolved the callback host
        job_id = "job-" + uuid.uuid4().hex
        request = pb.GenerateRequest.FromString(request.SerializeToString())
        if not request.request_id:
            request.request_id = job_id
        self.store.insert(job_id, tenant, request, callback_url, idempotency_key, digest)
        self._on_state("queued")
        self._spawn(job_id)
        return self.store.get(job_id)

    def _idempotent(self, tenant: str, key: str, digest: str) -> gpb.Job | None:
        found = self.store.find_idempotent(tenant, key) if key else None
        if found is None:
            return None
        if found[1] != digest:
            raise JobError(grpc.StatusCode.ALREADY_EXISTS, f"idempotency_key: {key!r} was used for a different "
                           f"request (job {found[0]}); use a new key for a new job")
        return self.store.get(found[0])

    def get(self, job_id: str) -> gpb.Job:
        job = self.store.get(job_id)
        if job is None:
            raise JobError(grpc.StatusCode.NOT_FOUND, f"job_id: no job {job_id!r}")
        return job

    def cancel(self, job_id: str, by: str) -> gpb.Job:
        """Cancels a queued or running job (a finished one is returned as it is)."""
        job = self.get(job_id)
        if job.state in TERMINAL:
            return job
        self._finish(job_id, state=gpb.JOB_STATE_CANCELLED, error_code="CANCELLED", error_message=f"cancelled by {by}")
        task = self._tasks.get(job_id)
        if task is not None:
            task.cancel()
        return self.get(job_id)

    async def watch(self, job_id: str) -> AsyncIterator[gpb.Job]:
        job = self.get(job_id)
        yield job
        while job.state not in TERMINAL:
            event = self._changed.setdefault(job_id, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), 5.0)
            except asyncio.TimeoutError:
                pass
            new = self.get(job_id)
            if new.state != job.state or new.updated_time != job.updated_time:
                yield new
            job = new

    def _notify(self, job_id: str) -> None:
        event = self._changed.pop(job_id, None)
        if event is not None:
            event.set()

    # ------------------------------------------------------------------ running
    def _spawn(self, job_id: str) -> None:
        task = asyncio.ensure_future(self._execute(job_id))
        self._tasks[job_id] = task
        task.add_done_callback(lambda _, j=job_id: self._tasks.pop(j, None))

    async def _execute(self, job_id: str) -> None:
        job = self.store.get(job_id)
        request = self.store.request(job_id)
        self.store.update(job_id, state=gpb.JOB_STATE_RUNNING, attempts=job.attempts + 1)
        self._notify(job_id)
        result = gpb.JobResult()
        try:
            async for r in self._run(request, job.tenant):
                result.text += r.text
                result.token_ids.extend(r.token_ids)
                if r.finish_reason:
                    result.finish_reason = r.finish_reason
                    result.usage.CopyFrom(r.usage)
            outcome = dict(state=gpb.JOB_STATE_SUCCEEDED, result=result.SerializeToString())
        except JobError as e:
            outcome = dict(state=gpb.JOB_STATE_FAILED, error_code=e.code.name, error_message=e.details)
        except asyncio.CancelledError:
            if self._stopping:  # a clean stop, not a crash: queued again, run at the next start
                self.store.update(job_id, state=gpb.JOB_STATE_QUEUED)
            raise  # (or CancelJob, which has recorded the job as cancelled)
        except Exception:  # noqa: BLE001 - recorded on the job, without the exception's text
            log.exception("job %s failed", job_id)
            outcome = dict(state=gpb.JOB_STATE_FAILED, error_code="INTERNAL",
                           error_message="the gateway failed while running this job (its log has the details)")
        self._finish(job_id, **outcome)

    def _finish(self, job_id: str, **fields) -> None:
        """Records a terminal state; a job with a callback URL gets its first delivery due now."""
        if self.store.get(job_id).callback_url:
            now = time.time()
            fields.update(callback_status=PENDING, callback_next=now, callback_since=now)
        self.store.update(job_id, **fields)
        self._on_state(_STATE_NAMES[fields["state"]])
        self._notify(job_id)
        self._wake.set()

    # ------------------------------------------------------------------ callbacks and retention
    def _signing_key(self, tenant: str) -> bytes | None:
        cfg = self.config()
        secret = next((t.webhook_secret for t in cfg.tenants if t.name == tenant), "") or cfg.callbacks.webhook_secret
        try:
            return webhook_key(secret, "webhook_secret") if secret else None
        except ConfigError:
            return None

    async def _maintenance_loop(self) -> None:
        last_sweep = 0.0
        while True:
            self._wake.clear()
            cfg = self.config()
            now = time.time()
            sweep_every = min(60.0, max(0.5, cfg.jobs.retention_s / 4))
            try:
                if now - last_sweep >= sweep_every:
                    last_sweep = now
                    if removed := self.store.expire(now - cfg.jobs.retention_s):
                        log.info("%d jobs past the retention window (%gs) deleted", removed, cfg.jobs.retention_s)
                room = cfg.callbacks.max_concurrent - len(self._deliveries)
                for job_id in self.store.due_callbacks(now, room) if room > 0 else []:
                    # Leased for the attempt's length: not picked again meanwhile, and due again after a crash.
                    self.store.db.execute("UPDATE jobs SET callback_next = ? WHERE job_id = ?",
                                          (now + cfg.callbacks.timeout_s + 2.0, job_id))
                    task = asyncio.ensure_future(self._deliver(job_id))
                    self._deliveries[job_id] = task
                    task.add_done_callback(lambda _, j=job_id: (self._deliveries.pop(j, None), self._wake.set()))
                due = self.store.next_callback_time()
            except sqlite3.Error:
                log.exception("jobs maintenance failed")
                due = None
            wait = sweep_every if due is None else min(sweep_every, max(0.01, due - time.time()))
            try:
                await asyncio.wait_for(self._wake.wait(), wait)
            except asyncio.TimeoutError:
                pass

    def _callback_body(self, job: gpb.Job) -> bytes:
        return json.dumps({
            "job_id": job.job_id, "state": gpb.JobState.Name(job.state), "tenant": job.tenant,
            "text": job.result.text, "token_ids": list(job.result.token_ids),
            "finish_reason": pb.FinishReason.Name(job.result.finish_reason),
            "prompt_tokens": job.result.usage.prompt_tokens, "completion_tokens": job.result.usage.completion_tokens,
            "error_code": job.error_code, "error_message": job.error_message}).encode()

    async def _deliver(self, job_id: str) -> None:
        """One attempt; then delivered, the next attempt scheduled (exponential backoff within the window), or
        failed. Why an attempt failed goes to the log only: a tenant sees pending / delivered / failed."""
        job = self.store.get(job_id)
        if job is None or job.callback_status != PENDING:
            return
        cfg = self.config().callbacks
        attempt = job.callback_attempts + 1
        key = self._signing_key(job.tenant)
        ok, why = False, "no webhook secret for its tenant"
        if key is not None:
            body = self._callback_body(job)
            timestamp = int(time.time())
            headers = {"content-type": "application/json", "user-agent": "meshserve-gateway",
                       "webhook-id": job.job_id, "webhook-timestamp": str(timestamp),
                       "webhook-signature": sign(key, job.job_id, timestamp, body)}
            try:
                status = await self.deliverer.post(job.callback_url, body, headers)
                ok, why = 200 <= status < 300, f"HTTP {status}"
            except CallbackRefused as e:
                why = str(e)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                why = f"{type(e).__name__}: {e}"
        now = time.time()
        end = self.store.callback_since(job_id) + cfg.retry_window_s
        if ok:
            self.store.update(job_id, callback_status=DELIVERED, callback_attempts=attempt)
            log.info("job %s: callback delivered (attempt %d)", job_id, attempt)
        elif now >= end:
            self.store.update(job_id, callback_status=FAILED, callback_attempts=attempt)
            log.warning("job %s: callback failed for good after %d attempts (last: %s)", job_id, attempt, why)
        else:
            delay = min(cfg.retry_max_s, cfg.retry_initial_s * 2 ** (attempt - 1)) * random.uniform(0.8, 1.0)
            self.store.update(job_id, callback_next=min(now + delay, end), callback_attempts=attempt)
            log.info("job %s: callback attempt %d failed (%s); next in %.1fs", job_id, attempt, why,
                     min(now + delay, end) - now)
        self._notify(job_id)
