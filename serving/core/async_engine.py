"""`AsyncEngine`: the engine on a background thread that alone touches it, with an asyncio interface for servers
(`stream` / `generate` yield one request's StepOutputs, all its samples' when n > 1; `abort`, `call`, `shutdown`,
`kill`); `EngineDeadError` once that thread is gone. Details: docs/engine.md."""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from typing import AsyncIterator, Callable, Sequence

from serving.core.interface import ServingEngine
from serving.core.output_processor import StepOutput
from serving.core.request import FinishReason, Priority, Request
from serving.params import SamplingParams

log = logging.getLogger(__name__)
# How long a failed multi-host step waits for the follower watchdog to report a lost peer (see _peer_lost).
PEER_LOSS_GRACE_S = 2.0
# What a collective's error says when the process at the other end is gone (gloo / NCCL / gRPC transports).
_PEER_GONE = ("connection reset by peer", "connection refused", "broken pipe", "connection closed", "socket closed",
              "end of file")


class EngineDeadError(RuntimeError):
    """The engine thread stopped; no request can be served."""


class AsyncEngine:
    def __init__(self, engine: ServingEngine):
        self.engine = engine
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        self._wake = threading.Event()
        # request id -> [its caller's loop, its queue, samples not finished yet]
        self._streams: dict[str, list] = {}
        self._stopping = False
        self._error: BaseException | None = None
        self.step_listeners: list[Callable[[ServingEngine, float], None]] = []  # called after each step (metrics)
        self._thread = threading.Thread(target=self._run, name="meshserve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API
    async def generate(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       priority: int = Priority.INTERACTIVE, deadline: float | None = None
                       ) -> AsyncIterator[StepOutput]:
        """Makes the request (the engine's make_request: raising ValueError at once), then streams it (`stream`)."""
        outputs = self.stream(self.engine.make_request(request_id, prompt, params, priority=priority,
                                                       deadline=deadline))
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()

    async def stream(self, request: Request) -> AsyncIterator[StepOutput]:
        """Admits a request the engine's make_request made (raising QueueFullError at once) and yields its outputs
        (every sample's, told apart by StepOutput.index, until all have finished)."""
        request_id = request.request_id
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        admitted = await asyncio.wrap_future(self._call(lambda: self._admit(request, loop, queue)))
        del admitted
        remaining = len(request.samples)
        finished = False
        try:
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                remaining -= out.finished
                if not remaining:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """Ends a request from any thread; its stream gets a final output with `reason`."""
        self._call(lambda: self._abort(request_id, reason))

    def call(self, fn: Callable[[ServingEngine], object]) -> concurrent.futures.Future:
        """Runs fn(engine) on the engine thread between steps (for consistent stats snapshots)."""
        return self._call(lambda: fn(self.engine))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def kill(self, error: BaseException) -> None:
        """From any thread: the engine can no longer run (e.g. a multi-host follower died). Every open stream
        fails with EngineDeadError and no new request is admitted; the engine thread is not waited for."""
        self._error = error
        self._stopping = True
        self._fail_all(EngineDeadError(f"the engine stopped: {error}"))
        self._wake.set()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    # ------------------------------------------------------------------ engine thread
    def _call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._error is not None or self._stopping:
            fut.set_exception(EngineDeadError(f"the engine is not running ({self._error or 'shut down'})"))
            return fut

        def run():
            # fn runs even if the caller has given up (an abort must still happen); the result is handed over only
            # if the future was not cancelled meanwhile (e.g. its RPC ended): setting a cancelled future raises,
            # which would kill the engine thread.
            try:
                result, error = fn(), None
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                result, error = None, e
            if fut.set_running_or_notify_cancel():
                if error is None:
                    fut.set_result(result)
                else:
                    fut.set_exception(error)
        self._commands.append(run)
        self._wake.set()
        return fut

    def _admit(self, request, loop, queue) -> bool:
        self.engine.add_request(request)
        self._streams[request.request_id] = [loop, queue, len(request.samples)]
        return True

    def _abort(self, request_id: str, reason: FinishReason) -> None:
        for out in self.engine.abort(request_id, reason):
            self._deliver(out)

    def _deliver(self, out: StepOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            stream[2] -= 1
            if not stream[2]:
                del self._streams[out.request_id]
        loop, queue = stream[0], stream[1]
        try:
            loop.call_soon_threadsafe(queue.put_nowait, out)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            pass

    def _peer_lost(self, engine, error: BaseException) -> bool:
        """After a failed step of a multi-host leader: whether a follower is gone. Its death fails the step's
        collectives and closes its step channel, and either can come first: a collective whose transport says the
        peer is gone is taken at its word (kill() here), else the channel's watchdog (which calls kill()) gets
        PEER_LOSS_GRACE_S to say so, so the client hears UNAVAILABLE rather than an engine error."""
        if getattr(engine, "channel", None) is None:
            return False
        text = str(error).lower()
        if self._error is None and any(s in text for s in _PEER_GONE):
            self.kill(ConnectionError(f"a multi-host peer is gone: {str(error).splitlines()[0]}"))
        deadline = time.monotonic() + PEER_LOSS_GRACE_S
        while self._error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self._error is not None

    def _fail_all(self, err: BaseException) -> None:
        for rid in list(self._streams):
            loop, queue, _ = self._streams.pop(rid)
            try:
                loop.call_soon_threadsafe(queue.put_nowait, err)
            except RuntimeError:
                pass

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                while self._commands:
                    self._commands.popleft()()
                if not engine.has_unfinished():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                t0 = time.perf_counter()
                try:
                    outputs = engine.step()
                except Exception as e:  # noqa: BLE001 - one bad step must not kill the server
                    if self._peer_lost(engine, e):
                        log.error("engine step failed with a multi-host peer gone: %s", e)
                        break  # kill() failed every stream as UNAVAILABLE: retry elsewhere
                    log.exception("engine step failed; failing the requests in it")
                    outputs = engine.fail_inflight(e)
                for out in outputs:
                    self._deliver(out)
                for listener in self.step_listeners:
                    listener(engine, time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001
            log.exception("engine thread died")
            self._error = e
            self._fail_all(EngineDeadError(f"engine thread died: {e!r}"))
