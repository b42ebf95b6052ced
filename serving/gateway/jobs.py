"""Asynchronous jobs (R16): `JobStore` (a local SQLite file) and `JobManager`, which runs a submitted job through the
gateway's normal path, stores its result or error, feeds GetJob / WatchJob, POSTs an optional callback to an
allow-listed host (`check_callback_url`) and runs unfinished jobs again at restart. Details: docs/gateway.md."""
from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
import urllib.parse
import urllib.request
import uuid
from typing import AsyncIterator, Callable

import grpc

from serving.gateway.proto import gateway_pb2 as gpb
from serving.wire import meshserve_pb2 as pb

log = logging.getLogger(__name__)

_SCHEMA = """CREATE TABLE IF NOT EXISTS jobs (
  job_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, state INTEGER NOT NULL, request BLOB NOT NULL,
  callback_url TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL, result BLOB,
  error_code TEXT NOT NULL DEFAULT '', error_message TEXT NOT NULL DEFAULT '',
  callback_status TEXT NOT NULL DEFAULT '', attempts INTEGER NOT NULL DEFAULT 0)"""
TERMINAL = (gpb.JOB_STATE_SUCCEEDED, gpb.JOB_STATE_FAILED)


class JobError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code
        self.details = details


def check_callback_url(url: str, allowed_hosts) -> None:
    """INVALID_ARGUMENT unless an http(s) URL whose host is on the allow-list."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise JobError(grpc.StatusCode.INVALID_ARGUMENT, f"callback_url: {url!r} is not an http(s) URL")
    if parsed.hostname.lower() not in allowed_hosts:
        raise JobError(grpc.StatusCode.INVALID_ARGUMENT,
                       f"callback_url: host {parsed.hostname!r} is not on the gateway's callback allow-list "
                       f"({', '.join(allowed_hosts) or 'empty'})")


class JobStore:
    def __init__(self, path: str):
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute(_SCHEMA)

    def close(self) -> None:
        self.db.close()

    def insert(self, job_id: str, tenant: str, request: pb.GenerateRequest, callback_url: str) -> None:
        now = time.time()
        self.db.execute("INSERT INTO jobs (job_id, tenant, state, request, callback_url, created, updated) VALUES "
                        "(?, ?, ?, ?, ?, ?, ?)", (job_id, tenant, gpb.JOB_STATE_QUEUED, request.SerializeToString(),
                                                  callback_url, now, now))

    def update(self, job_id: str, **fields) -> None:
        fields["updated"] = time.time()
        cols = ", ".join(f"{k} = ?" for k in fields)
        self.db.execute(f"UPDATE jobs SET {cols} WHERE job_id = ?", (*fields.values(), job_id))

    def get(self, job_id: str) -> gpb.Job | None:
        row = self.db.execute("SELECT job_id, tenant, state, callback_url, created, updated, result, error_code, "
                              "error_message, callback_status, attempts FROM jobs WHERE job_id = ?",
                              (job_id,)).fetchone()
        if row is None:
            return None
        job = gpb.Job(job_id=row[0], tenant=row[1], state=row[2], callback_url=row[3], created_time=row[4],
                      updated_time=row[5], error_code=row[7], error_message=row[8], callback_status=row[9],
                      attempts=row[10])
        if row[6]:
            job.result.ParseFromString(row[6])
        return job

    def request(self, job_id: str) -> pb.GenerateRequest:
        row = self.db.execute("SELECT request FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return pb.GenerateRequest.FromString(row[0])

    def undelivered(self) -> list[str]:
        """Finished jobs whose callback was never attempted (the gateway stopped in between)."""
        return [r[0] for r in self.db.execute("SELECT job_id FROM jobs WHERE state IN (?, ?) AND callback_url != '' "
                                              "AND callback_status = '' ORDER BY created",
                                              (gpb.JOB_STATE_SUCCEEDED, gpb.JOB_STATE_FAILED))]

    def unfinished(self) -> list[str]:
        return [r[0] for r in self.db.execute("SELECT job_id FROM jobs WHERE state IN (?, ?) ORDER BY created",
                                              (gpb.JOB_STATE_QUEUED, gpb.JOB_STATE_RUNNING))]


def _post_json(url: str, body: dict, timeout: float) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - host is allow-listed
        return resp.status


class JobManager:
    """`run(request, tenant)` is the gateway's internal generate: an async iterator of GenerateResponses that
    raises grpc.aio.AbortError-like exceptions carrying (code, details) as JobError."""

    def __init__(self, store: JobStore, run: Callable[[pb.GenerateRequest, str], AsyncIterator[pb.GenerateResponse]],
                 allowed_hosts: Callable[[], tuple[str, ...]], *, callback_timeout_s: float = 10.0,
                 callback_attempts: int = 3, on_state: Callable[[str], None] | None = None):
        self.store = store
        self._run = run
        self._allowed_hosts = allowed_hosts
        self.callback_timeout_s = callback_timeout_s
        self.callback_attempts = callback_attempts
        self._on_state = on_state or (lambda state: None)
        self._tasks: dict[str, asyncio.Task] = {}
        self._changed: dict[str, asyncio.Event] = {}

    def start(self) -> int:
        """Resumes unfinished jobs (after a restart); returns how many."""
        ids = self.store.unfinished()
        for job_id in ids:
            log.info("job %s: resumed after a restart", job_id)
            self._spawn(job_id)
        for job_id in self.store.undelivered():
            log.info("job %s: callback sent after a restart", job_id)
            task = asyncio.ensure_future(self._callback(self.store.get(job_id)))
            self._tasks[job_id] = task
            task.add_done_callback(lambda _, j=job_id: self._tasks.pop(j, None))
        return len(ids)

    async def stop(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def submit(self, request: pb.GenerateRequest, callback_url: str, tenant: str) -> gpb.Job:
        if callback_url:
            check_callback_url(callback_url, self._allowed_hosts())
        if request.sampling.n > 1:
            raise JobError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.n: a job's result holds one completion, got "
                           f"n={request.sampling.n}; submit n jobs (with different seeds) or use Generate")
        job_id = "job-" + uuid.uuid4().hex
        request = pb.GenerateRequest.FromString(request.SerializeToString())
        if not request.request_id:
            request.request_id = job_id
        self.store.insert(job_id, tenant, request, callback_url)
        self._on_state("queued")
        self._spawn(job_id)
        return self.store.get(job_id)

    def get(self, job_id: str) -> gpb.Job:
        job = self.store.get(job_id)
        if job is None:
            raise JobError(grpc.StatusCode.NOT_FOUND, f"job_id: no job {job_id!r}")
        return job

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
            self.store.update(job_id, state=gpb.JOB_STATE_SUCCEEDED, result=result.SerializeToString())
            self._on_state("succeeded")
        except JobError as e:
            self.store.update(job_id, state=gpb.JOB_STATE_FAILED, error_code=e.code.name, error_message=e.details)
            self._on_state("failed")
        except asyncio.CancelledError:
            raise  # the gateway is stopping: the job stays RUNNING and is run again at the next start
        except Exception as e:  # noqa: BLE001 - recorded on the job
            log.exception("job %s failed", job_id)
            self.store.update(job_id, state=gpb.JOB_STATE_FAILED, error_code="INTERNAL", error_message=str(e))
            self._on_state("failed")
        self._notify(job_id)
        job = self.store.get(job_id)
        if job.callback_url:
            await self._callback(job)

    async def _callback(self, job: gpb.Job) -> None:
        body = {"job_id": job.job_id, "state": gpb.JobState.Name(job.state), "tenant": job.tenant,
                "text": job.result.text, "token_ids": list(job.result.token_ids),
                "finish_reason": pb.FinishReason.Name(job.result.finish_reason),
                "prompt_tokens": job.result.usage.prompt_tokens,
                "completion_tokens": job.result.usage.completion_tokens,
                "error_code": job.error_code, "error_message": job.error_message}
        status = ""
        for attempt in range(self.callback_attempts):
            try:
                code = await asyncio.to_thread(_post_json, job.callback_url, body, self.callback_timeout_s)
                status = "delivered" if 200 <= code < 300 else f"failed: HTTP {code}"
                if status == "delivered":
                    break
            except Exception as e:  # noqa: BLE001 - recorded on the job
                status = f"failed: {e}"
            await asyncio.sleep(0.5 * 2 ** attempt)
        log.info("job %s: callback %s", job.job_id, status)
        self.store.update(job.job_id, callback_status=status)
        self._notify(job.job_id)
