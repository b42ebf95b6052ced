"""The meshserve.v1.Inference servicer (`InferenceServicer`): requests in, read and checked (serving.wire.requests, then
the engine's make_request), through the AsyncEngine, tokens streamed back, every request ending in a last response or
an explicit status; load reports, drain. Details: docs/server.md."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid

import grpc

from serving.core.async_engine import AsyncEngine, EngineDeadError
from serving.core.lora import UnknownAdapterError
from serving.core.request import FinishReason, Request
from serving.core.scheduler import QueueFullError
from serving.params import InvalidArgument, check_max_tokens
from serving.server.disagg import TRANSPORT, TransferError, continuation, prefill_only, resume
from serving.telemetry.load import LoadTracker
from serving.telemetry.metrics import ServerMetrics
from serving.telemetry.tracing import RequestTracer
from serving.wire import meshserve_pb2 as pb
from serving.wire import meshserve_pb2_grpc as pb_grpc
from serving.wire.client import RETRY_PUSHBACK_KEY
from serving.wire.requests import prefix_cache_salt, read_generate, status_details, tokenize_prompt

log = logging.getLogger(__name__)

FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT, FinishReason.TIMEOUT: pb.FINISH_REASON_TIMEOUT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
LARGE_REQUEST_BYTES = 32 << 10  # parsed and tokenized off the event loop


@dataclasses.dataclass(slots=True)
class ServingOptions:
    instance_id: str = ""
    max_request_bytes: int = 1 << 20  # larger GenerateRequests get INVALID_ARGUMENT naming the prompt field
    retry_after_s: float = 1.0  # the hint sent with RESOURCE_EXHAUSTED
    lora_root: str = ""  # LoRA adapters loadable at run time live under it (realpath); "": run-time loading is off


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, aengine: AsyncEngine, options: ServingOptions, *, metrics: ServerMetrics | None = None,
                 tracer: RequestTracer | None = None, load_tracker: LoadTracker | None = None,
                 on_drain_change=None):
        self.aengine = aengine
        self.engine = aengine.engine
        self.options = options
        self.metrics = metrics
        self.tracer = tracer or RequestTracer(None)
        self.load_tracker = load_tracker or LoadTracker(metrics, self.tracer)
        self.ready = False
        self.draining = False
        self.model_name = ""  # ModelInfo's served_model_name and http_port (set by the InstanceServer)
        self.http_port = 0
        self.tool_call_parser = self.reasoning_parser = ""  # ModelInfo's chat parsers (set by the InstanceServer)
        self.inflight: dict[str, float] = {}  # request id -> arrival (monotonic)
        self._on_drain_change = on_drain_change
        self.disagg = None  # serving.server.disagg.Disaggregation with --role=prefill|decode
        self._idle = asyncio.Event()
        self._idle.set()

    # ------------------------------------------------------------------ state
    def set_draining(self, draining: bool) -> None:
        if draining != self.draining:
            self.draining = draining
            log.info("draining" if draining else "admitting again")
            if self.metrics is not None:
                self.metrics.set_draining(draining)
            if self._on_drain_change is not None:
                self._on_drain_change(draining)

    def begin(self, rid: str) -> float:
        """Counts a request (gRPC or HTTP) in flight, for the drain; returns its arrival time (monotonic)."""
        arrival = self.inflight[rid] = time.monotonic()
        self._idle.clear()
        return arrival

    def end(self, rid: str) -> None:
        self.inflight.pop(rid, None)
        if not self.inflight:
            self._idle.set()

    async def wait_idle(self, timeout: float | None) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def abort_all(self, reason: FinishReason = FinishReason.ABORT) -> int:
        for rid in list(self.inflight):
            self.aengine.abort(rid, reason)
        return len(self.inflight)

    # ------------------------------------------------------------------ parsing
    def make_request(self, req: pb.GenerateRequest, request_id: str, time_remaining: float | None) -> Request:
        """The engine's request for a GenerateRequest: read (serving.wire.requests), checked against the model
        (the engine's make_request) and against the API's context rule; raises ValueError (`status_details`)."""
        call = read_generate(req, self.options.max_request_bytes, tokenizer=self.engine.tokenizer,
                             time_remaining=time_remaining)
        # The tenant (and its client's cache_salt) salts the prefix cache: one tenant's cached_tokens say nothing of
        # another's prompts.
        request = self.engine.make_request(request_id, call.prompt_ids, call.params, priority=call.priority,
                                           deadline=call.deadline, field=call.field,
                                           cache_salt=prefix_cache_salt(req))
        check_max_tokens(len(call.prompt_ids), call.params.max_tokens, self.engine.max_model_len)
        return request

    # ------------------------------------------------------------------ Generate
    async def _refuse(self, context, code: grpc.StatusCode, details: str, trailing=()) -> None:
        if self.metrics is not None:
            self.metrics.observe_error(code.name)
        await context.abort(code, details, trailing_metadata=trailing)

    async def Generate(self, request: pb.GenerateRequest, context):
        if not self.ready:
            await self._refuse(context, grpc.StatusCode.UNAVAILABLE, "the server is starting (warming up); retry")
        if self.draining:
            await self._refuse(context, grpc.StatusCode.UNAVAILABLE,
                               "the server is draining and admits no new requests; send it elsewhere")
        rid = request.request_id or uuid.uuid4().hex
        export_max_tokens = 0  # kv_export: the max_tokens asked for (the engine runs one token)
        kv_source = request.kv_source if request.HasField("kv_source") else None
        if request.kv_export or kv_source is not None:
            role = self.disagg.role if self.disagg is not None else "both"
            want = "prefill" if request.kv_export else "decode"
            if role != want or (request.kv_export and kv_source is not None):
                await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, (
                    f"{'kv_export' if request.kv_export else 'kv_source'}: this instance's role is {role}; send it "
                    f"to a --role={want} instance (docs/disaggregation.md)"))
            try:
                if request.kv_export:
                    request, export_max_tokens = prefill_only(request)
                else:
                    request = continuation(request)
            except ValueError as e:
                await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, status_details(e))
        try:
            # Tokenizing a large prompt, or compiling a grammar, would stall every other stream.
            if request.ByteSize() > LARGE_REQUEST_BYTES or request.sampling.HasField("structured"):
                ereq = await asyncio.to_thread(self.make_request, request, rid, context.time_remaining())
            else:
                ereq = self.make_request(request, rid, context.time_remaining())
        except ValueError as e:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, status_details(e))
        except UnknownAdapterError as e:
            await self._refuse(context, grpc.StatusCode.NOT_FOUND, f"sampling.adapter: {e}")
        if rid in self.inflight:
            await self._refuse(context, grpc.StatusCode.ALREADY_EXISTS, f"request_id: {rid!r} is already in flight")
        if kv_source is not None:
            try:
                # a streamed transfer's first token comes with its last pages (after the pull)
                resume(ereq, kv_source.first_token_id, check_only=kv_source.streamed)
            except ValueError as e:
                await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, status_details(e))
        num_prompt_tokens, params, deadline = ereq.num_prompt_tokens, ereq.sampling_params, ereq.deadline
        span = self.tracer.start(rid, context.invocation_metadata(), {
            "meshserve.request_id": rid, "meshserve.tenant": request.tenant or None,
            "meshserve.priority": ereq.priority, "meshserve.prompt_tokens": num_prompt_tokens},
            start_time=ereq.arrival_time)  # the engine's request was made while parsing: its queue span starts there
        arrival = self.begin(rid)
        last_request, final, failure = None, None, None  # failure: (code, details, trailing)
        remaining = params.n  # samples not finished
        stream = self.aengine.stream(ereq)
        # kv_export of a prompt of several prefill chunks: pullable chunk by chunk while they run
        streaming_tid = ""
        try:
            if export_max_tokens > 1 and num_prompt_tokens > self.disagg.transfers.chunk_tokens:
                handoff = await self.disagg.open(ereq)
                streaming_tid = handoff.transfer_id
                yield pb.GenerateResponse(request_id=rid, kv_transfer=handoff)
            if kv_source is not None:
                await self._pull_kv(kv_source, ereq, span, context.time_remaining())
            first = True
            async for out in stream:
                if first and kv_source is not None:  # admitted and running here: the prefill side may free them
                    await self.disagg.release(kv_source)
                last_request = out.request
                if out.finished:
                    final = out
                    remaining -= 1
                    self.record_finished(out)
                    if out.finish_reason is FinishReason.TIMEOUT:
                        failure = (grpc.StatusCode.DEADLINE_EXCEEDED, f"the deadline passed after "
                                   f"{out.request.num_output_tokens} generated tokens", ())
                        break
                    if out.finish_reason is FinishReason.ERROR:
                        log.error("request %s failed inside the engine: %s", rid, out.stop_reason)
                        failure = (grpc.StatusCode.INTERNAL, f"the engine failed on this request's step (request "
                                   f"id {rid}); the server's log has the details", ())  # never the exception text
                        break
                    if out.finish_reason is FinishReason.ABORT:
                        failure = (grpc.StatusCode.UNAVAILABLE,
                                   "the server shut down before the request finished; retry elsewhere", ())
                        break
                response = self._response(rid, out, first)
                if (out.finished and export_max_tokens > 1 and out.finish_reason is FinishReason.LENGTH
                        and out.request.num_tokens < self.engine.max_model_len):
                    # the client's request goes on on a decode instance, from the pages held here
                    if streaming_tid:
                        tid, streaming_tid = streaming_tid, ""
                        try:
                            response.kv_transfer.CopyFrom(await self.disagg.finish(tid, out.request,
                                                                                   out.request.output_token_ids[-1]))
                        except KeyError:  # a ReleaseKV while the prefill ran: no continuation (not a short answer)
                            failure = (grpc.StatusCode.ABORTED, f"kv_export: KV transfer {tid} was released while "
                                       "the prefill ran (ReleaseKV); retry the request", ())
                            break
                    else:
                        response.kv_transfer.CopyFrom(await self.disagg.hold(out.request))
                    response.finish_reason = pb.FINISH_REASON_UNSPECIFIED
                    self.tracer.event(span, "kv_hold", {"meshserve.kv_pages": response.kv_transfer.num_pages})
                yield response
                first = False
        except TransferError as e:
            failure = (e.code, e.details, ())
        except QueueFullError as e:
            ms = int(self.options.retry_after_s * 1000)
            failure = (grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e}; retry in {self.options.retry_after_s:g}s",
                       ((RETRY_PUSHBACK_KEY, str(ms)),))
        except ValueError as e:
            failure = (grpc.StatusCode.INVALID_ARGUMENT, status_details(e), ())
        except EngineDeadError as e:
            failure = (grpc.StatusCode.UNAVAILABLE, str(e), ())  # the instance cannot serve: retry elsewhere
        finally:
            # Reached on normal ends, errors and client cancels (CancelledError / GeneratorExit).
            reason = final.finish_reason if final is not None else FinishReason.ABORT
            if remaining:
                # Cancelled by the client, or by gRPC when the deadline passed, or a sample failed: free the pages of
                # every sample now (a no-op if it never got in).
                if final is None or failure is None:
                    reason = FinishReason.ABORT
                    if deadline is not None and time.monotonic() >= deadline - 0.005:
                        reason = FinishReason.TIMEOUT
                self.aengine.abort(rid, reason)
            await stream.aclose()
            if streaming_tid:  # failed, cancelled, or ended by its first token: the held pages go, the pulls end
                self.disagg.abandon(streaming_tid)
            self.end(rid)
            if remaining and failure is None:  # cancelled: count it, with what it had got
                self.record_abort(last_request, reason, num_prompt_tokens=num_prompt_tokens, arrival_time=arrival)
            label = "rejected" if final is None and failure is not None else reason.value
            self.tracer.finish(span, rid, last_request, finish_reason=label,
                               error=None if failure is None else failure[1])
        if failure is not None:
            await self._refuse(context, *failure)

    async def _pull_kv(self, src: pb.KVSource, ereq: Request, span, time_remaining: float | None) -> None:
        """Decode side: pulls the prefill instance's pages of `src` and registers them in the prefix cache, before
        `ereq` is scheduled (its admission command runs after this one on the engine thread)."""
        cached, info = await self.disagg.pull(src, ereq, time_remaining or self.disagg.timeout_s)
        if src.streamed:
            resume(ereq, info["first_token_id"])
        self.tracer.event(span, "kv_transfer", {"meshserve.kv_bytes": info["bytes"],
                                                "meshserve.kv_seconds": info["seconds"],
                                                "meshserve.kv_transport": info["transport"],
                                                "meshserve.kv_pages": info["pages"],
                                                "meshserve.kv_pieces": info["pieces"],
                                                "meshserve.kv_pieces_during_prefill": info["pieces_during_prefill"],
                                                "meshserve.kv_cached_blocks": cached})
        if self.metrics is not None:
            self.metrics.observe_kv_transfer(info["bytes"], info["seconds"], info["pieces"],
                                             info["pieces_during_prefill"])

    def _response(self, rid: str, out, first: bool) -> pb.GenerateResponse:
        resp = pb.GenerateResponse(request_id=rid, token_ids=out.new_token_ids, text=out.new_text, index=out.index)
        if out.logprobs:
            for lp in out.logprobs:
                resp.logprobs.add(token_id=lp.token_id, logprob=lp.logprob,
                                  top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
        r = out.request
        if first:
            resp.usage.prompt_tokens = r.num_prompt_tokens
        if out.finished:
            resp.finish_reason = FINISH_REASONS[out.finish_reason]
            if isinstance(out.stop_reason, str):
                resp.stop_string = out.stop_reason
            elif out.stop_reason is not None:
                resp.stop_token_id = int(out.stop_reason)
            m = r.metrics
            resp.usage.prompt_tokens = r.num_prompt_tokens
            resp.usage.completion_tokens = r.num_output_tokens
            resp.usage.cached_prompt_tokens = m.num_cached_prompt_tokens
            resp.usage.num_preemptions = m.num_preemptions
            end = m.finished_time if m.finished_time is not None else time.monotonic()
            if m.first_scheduled_time is not None:
                resp.timing.queue_time_s = m.first_scheduled_time - m.arrival_time
            if m.first_token_time is not None:
                resp.timing.time_to_first_token_s = m.first_token_time - m.arrival_time
            resp.timing.e2e_latency_s = end - m.arrival_time
        return resp

    def record_finished(self, out) -> None:
        """Each sample counts as a finished sequence; the prompt's tokens are counted once, with sample 0."""
        if self.metrics is None:
            return
        r, m = out.request, out.request.metrics
        self.metrics.observe_finished(
            finish_reason=out.finish_reason.value, num_prompt_tokens=0 if out.index else r.num_prompt_tokens,
            num_output_tokens=r.num_output_tokens, arrival_time=m.arrival_time,
            first_scheduled_time=m.first_scheduled_time, first_token_time=m.first_token_time,
            token_times=list(m.token_times), finished_time=m.finished_time)

    def record_abort(self, r, reason: FinishReason, *, num_prompt_tokens: int, arrival_time: float) -> None:
        """A request that ended without its last output (client cancel, gRPC deadline); `r` is None if it had
        no output yet."""
        if self.metrics is None:
            return
        if r is None:
            self.metrics.observe_finished(
                finish_reason=reason.value, num_prompt_tokens=num_prompt_tokens, num_output_tokens=0,
                arrival_time=arrival_time, first_scheduled_time=None, first_token_time=None, token_times=[],
                finished_time=time.monotonic())
            return
        m = r.metrics
        self.metrics.observe_finished(
            finish_reason=reason.value, num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=r.num_output_tokens, arrival_time=m.arrival_time,
            first_scheduled_time=m.first_scheduled_time, first_token_time=m.first_token_time,
            token_times=list(m.token_times), finished_time=time.monotonic())

    # ------------------------------------------------------------------ other RPCs
    async def Tokenize(self, request: pb.TokenizeRequest, context):
        which = request.WhichOneof("prompt")
        try:
            if which is None:
                raise InvalidArgument("prompt: empty; set text or chat")
            ids = tokenize_prompt(which, request, self.engine.tokenizer)
        except ValueError as e:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        resp = pb.TokenizeResponse(token_ids=ids, max_model_len=self.engine.max_model_len)
        if request.return_token_strings:
            resp.token_strings.extend(self.engine.tokenizer.id_to_token(t) or "" for t in ids)
        return resp

    async def ModelInfo(self, request, context):
        e, c = self.engine, self.engine.config
        tok = e.tokenizer
        return pb.ModelInfoResponse(
            model=c.model, architecture=e.model_config.family, vocab_size=e.model_config.vocab_size,
            max_model_len=e.max_model_len,
            eos_token_ids=list(e.eos_token_ids), dtype=c.dtype, has_tokenizer=tok is not None,
            has_chat_template=bool(tok is not None and tok.chat_template), page_size=c.page_size,
            num_pages=e.num_pages, max_num_seqs=c.max_num_seqs * c.dp, max_num_batched_tokens=c.max_num_batched_tokens,
            token_buckets=list(e.buckets), compile_count=e.compile_count, compile_time_s=e.compile_time_s,
            devices=[str(d) for d in e.devices], instance_id=self.options.instance_id,
            max_waiting_requests=c.max_waiting_requests * c.dp, max_waiting_tokens=c.max_waiting_tokens * c.dp,
            max_request_bytes=self.options.max_request_bytes, served_model_name=self.model_name,
            http_port=self.http_port, reasoning_parser=self.reasoning_parser, tool_call_parser=self.tool_call_parser,
            quantization=e.model_config.quantization or "none", kv_cache_dtype=c.kv_cache_dtype_name,
            lora_adapters=[lora_message(a) for a in e.list_adapters()], max_loras=c.max_loras if c.enable_lora else 0,
            role=self.disagg.role if self.disagg is not None else "both",
            kv_transport=TRANSPORT if self.disagg is not None else "",
            **host_kv_info(e))

    async def load_report(self, check_invariants: bool = False) -> pb.LoadReport:
        def snapshot(engine):
            s = engine.scheduler
            error = ""
            if check_invariants:
                try:
                    s.check_invariants()
                    if not engine.has_unfinished():
                        s.block_manager.check_idle()
                except AssertionError as exc:
                    error = f"AssertionError: {exc}"
            bm = s.block_manager
            return s.stats(), bm.num_pages, bm.num_free_pages, error, {**lora_load(engine), **host_kv_load(engine)}
        try:
            stats, total, free, error, lora = await asyncio.wrap_future(self.aengine.call(snapshot))
        except EngineDeadError as e:
            stats, total, free, error, lora = self.engine.scheduler.stats(), self.engine.num_pages, 0, str(e), {}
        load = self.load_tracker.snapshot(time.monotonic())
        queries, hits = int(stats["prefix_cache_queries"]), int(stats["prefix_cache_hits"])
        return pb.LoadReport(
            instance_id=self.options.instance_id, timestamp=time.time(), num_waiting=int(stats["num_waiting"]),
            num_running=int(stats["num_running"]), num_waiting_tokens=int(stats["num_waiting_tokens"]),
            kv_pages_total=total, kv_pages_free=free, kv_cache_usage=float(stats["kv_cache_usage"]),
            tokens_per_s=load["tokens_per_s"], generation_tokens_per_s=load["generation_tokens_per_s"],
            step_time_p50_s=load["step_time_p50_s"], step_time_p99_s=load["step_time_p99_s"],
            device_step_times=[pb.DeviceStepTime(device=d, step_time_s=t)
                               for d, t in sorted(load["device_step_times_s"].items())],
            prefix_cache_hit_rate=hits / queries if queries else 0.0, prefix_cache_queries=queries,
            prefix_cache_hits=hits, num_preemptions=int(stats["num_preemptions"]), draining=self.draining,
            serving=self.ready and not self.draining and self.aengine.is_alive,
            # Instance-wide: each data-parallel replica runs max_num_seqs and queues max_waiting_requests.
            max_num_seqs=self.engine.config.max_num_seqs * self.engine.config.dp,
            max_waiting_requests=self.engine.config.max_waiting_requests * self.engine.config.dp, steps=load["steps"],
            invariant_error=error, **lora)

    async def GetLoad(self, request: pb.GetLoadRequest, context):
        return await self.load_report(request.check_invariants)

    async def WatchLoad(self, request: pb.WatchLoadRequest, context):
        interval = max(10, request.interval_ms or 1000) / 1000.0
        while True:
            yield await self.load_report()
            await asyncio.sleep(interval)

    # ------------------------------------------------------------------ LoRA adapters (admin: serving.auth)
    async def load_adapter(self, name: str, path: str) -> dict:
        """Registers the PEFT adapter in directory `path` (under --lora_root) as `name`, on the engine thread; returns
        its info. Raises PermissionError (run-time loading off, or the path outside the root), ValueError (the
        name is empty or taken; the adapter does not fit the model: models.lora.AdapterError says why)."""
        if not name:
            raise InvalidArgument("lora_name: empty; name the adapter")
        resolved = allowed_adapter_path(path, self.options.lora_root)
        return await asyncio.wrap_future(self.aengine.call(lambda e: e.load_adapter(name, resolved)))

    async def unload_adapter(self, name: str) -> dict:
        """Unregisters adapter `name` (UnknownAdapterError if not served); its requests in flight finish on it."""
        return await asyncio.wrap_future(self.aengine.call(lambda e: e.unload_adapter(name)))

    async def LoadLoRAAdapter(self, request: pb.LoadLoRAAdapterRequest, context):
        try:
            info = await self.load_adapter(request.lora_name, request.lora_path)
        except (ValueError, LookupError, PermissionError) as e:
            await self._refuse(context, lora_status(e), str(e))
        return pb.LoRAAdapterResponse(adapter=lora_message(info))

    async def UnloadLoRAAdapter(self, request: pb.UnloadLoRAAdapterRequest, context):
        try:
            info = await self.unload_adapter(request.lora_name)
        except (ValueError, LookupError) as e:
            await self._refuse(context, lora_status(e), str(e))
        return pb.LoRAAdapterResponse(adapter=lora_message(info), requests_in_flight=info["requests_in_flight"])

    async def PullKV(self, request: pb.PullKVRequest, context):
        if self.disagg is None:
            await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION,
                               "PullKV: this instance's role is both; pages are pulled from --role=prefill instances")
        async for msg in self.disagg.pull_kv(request, context):
            yield msg

    async def ReleaseKV(self, request: pb.ReleaseKVRequest, context):
        if self.disagg is None or self.disagg.role != "prefill":
            await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION,
                               "ReleaseKV: this instance holds no KV transfers (not --role=prefill)")
        return await self.disagg.release_kv(request, context)

    async def Drain(self, request: pb.DrainRequest, context):
        self.set_draining(not request.resume)
        stats = self.engine.scheduler.stats()
        return pb.DrainResponse(draining=self.draining, num_waiting=int(stats["num_waiting"]),
                                num_running=int(stats["num_running"]))


def allowed_adapter_path(path: str, root: str) -> str:
    """`path` resolved (symlinks too) if it lies under `root` (--lora_root); PermissionError naming both otherwise, or
    when no root is set (run-time loading off)."""
    if not root:
        raise PermissionError("lora_path: loading adapters at run time is off on this server (start it with "
                              "--lora_root=DIR to allow adapters under DIR)")
    if not path:
        raise InvalidArgument("lora_path: empty; give the adapter's directory")
    real, top = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, top]) != top:
        raise PermissionError(f"lora_path: {path!r} is not under the server's --lora_root {root!r}")
    return real


def lora_status(e: Exception) -> grpc.StatusCode:
    if isinstance(e, UnknownAdapterError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(e, PermissionError):
        return grpc.StatusCode.PERMISSION_DENIED
    return grpc.StatusCode.INVALID_ARGUMENT


def lora_message(info: dict) -> pb.LoRAAdapter:
    """An adapter's info (Engine.list_adapters / load_adapter) as meshserve.v1's LoRAAdapter."""
    slots = info.get("slots", [info.get("slot")])
    return pb.LoRAAdapter(name=info["name"], path=info["path"], rank=info["rank"],
                          target_modules=info["target_modules"], resident=any(s is not None for s in slots))


def host_kv_info(engine) -> dict:
    """ModelInfo's host KV tier fields (its pages and bytes; none when the tier is off) and the KV-event endpoint."""
    events = getattr(engine, "kv_events", None)
    out = (dict(kv_events_endpoint=events.endpoint, kv_events_replay_endpoint=events.replay_endpoint)
           if events is not None else {})
    stats = getattr(engine, "host_kv_stats", dict)()
    if not stats:
        return out
    return dict(out, host_kv_cache_pages=int(stats["host_kv_cache_pages"]),
                host_kv_cache_bytes=int(stats["host_kv_cache_bytes"]))


def host_kv_load(engine) -> dict:
    """The LoadReport's host KV tier fields (on the engine thread): pages, pages in use, host-tier hits in tokens."""
    stats = getattr(engine, "host_kv_stats", dict)()
    if not stats:
        return {}
    pages = int(stats["host_kv_cache_pages"])
    return dict(host_kv_pages_total=pages, host_kv_pages_used=round(stats["host_kv_cache_usage"] * pages),
                host_prefix_cache_hits=int(stats["host_prefix_cache_hits"]))


def lora_load(engine) -> dict:
    """The LoadReport's LoRA fields (on the engine thread): the adapters served and on a device, the slots, and the
    adapters of the running and waiting requests; {} without --enable_lora."""
    if not engine.config.enable_lora:
        return {}
    adapters, info = engine.list_adapters(), engine.lora_requests_info()
    return dict(lora_adapters=[a["name"] for a in adapters],
                lora_resident=[a["name"] for a in adapters if lora_message(a).resident],
                max_loras=info["max_lora"], lora_running=info["running"], lora_waiting=info["waiting"])
