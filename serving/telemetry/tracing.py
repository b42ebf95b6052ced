"""`RequestTracer`: OpenTelemetry traces of requests (a `generate` span with `queue`, `prefill_chunk` and `decode`
children), written when the request ends; `make_tracer_provider` exports them over OTLP/gRPC (TLS with a CA file) or
to a test exporter. Token ids go into spans only when asked (`trace_content`). Details: docs/metrics.md."""
from __future__ import annotations

import threading
import time
from typing import Iterable, Mapping

from opentelemetry import trace
from opentelemetry.propagate import extract
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

# time.monotonic() -> epoch nanoseconds; the scheduler's timestamps are monotonic. Every span of a request (the root
# too) is stamped through this one mapping: the wall clock is slewed by NTP, so mixing it with monotonic stamps
# could put a child before its parent.
_MONO_TO_EPOCH_NS = time.time_ns() - time.monotonic_ns()


def epoch_ns(monotonic_s: float) -> int:
    return int(monotonic_s * 1e9) + _MONO_TO_EPOCH_NS


def make_tracer_provider(service_name: str, *, otlp_endpoint: str = "", otlp_ca_file: str = "",
                         exporter: SpanExporter | None = None, max_events: int = 8192) -> TracerProvider | None:
    """A provider that exports to `exporter` (synchronously: tests) or to an OTLP/gRPC collector (batched; over TLS
    checked against `otlp_ca_file` when given, else plaintext); None when neither is given (tracing off)."""
    if exporter is None and not otlp_endpoint:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                              span_limits=SpanLimits(max_events=max_events))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        if otlp_ca_file:
            import grpc
            with open(otlp_ca_file, "rb") as f:
                credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
            otlp = OTLPSpanExporter(endpoint=otlp_endpoint, insecure=False, credentials=credentials)
        else:
            otlp = OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True)
        provider.add_span_processor(BatchSpanProcessor(otlp))
    return provider


class RequestTracer:
    """Collects prefill-chunk timings from engine steps and writes each request's spans when it ends. Decode events
    carry each token's index and time; its id only with `trace_content` (traces often leave the trust boundary of
    the prompts: a shared collector, a vendor)."""

    def __init__(self, provider: TracerProvider | None, *, trace_content: bool = False):
        self.provider = provider
        self.trace_content = trace_content
        self._tracer = provider.get_tracer("meshserve.server") if provider else None
        self._chunks: dict[str, list[tuple[int, int, float, float]]] = {}  # request id -> chunks
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def start(self, request_id: str, metadata: Iterable[tuple[str, str]] | None, attributes: Mapping,
              start_time: float | None = None):
        """Opens the request's root span (a child of the caller's `traceparent`, if any) at `start_time` (monotonic
        seconds: the request's arrival; None: now); None when off."""
        if self._tracer is None:
            return None
        parent = extract({k: v for k, v in (metadata or ()) if isinstance(v, str)})
        with self._lock:
            self._chunks[request_id] = []
        return self._tracer.start_span("generate", context=parent, kind=SpanKind.SERVER,
                                       start_time=epoch_ns(time.monotonic() if start_time is None else start_time),
                                       attributes={k: v for k, v in attributes.items() if v is not None})

    def on_step(self, scheduled, start_time: float, end_time: float) -> None:
        """Engine thread: records the prefill chunks of traced requests in this step."""
        if self._tracer is None:
            return
        with self._lock:
            for s in scheduled:
                chunks = self._chunks.get(s.request.request_id)
                if chunks is not None and s.start < s.request.num_prompt_tokens:
                    chunks.append((s.start, len(s.token_ids), start_time, end_time))

    def event(self, span, name: str, attributes: Mapping) -> None:
        """An event on the request's span (e.g. its KV transfer: bytes, seconds, transport); nothing when off."""
        if span is not None:
            span.add_event(name, attributes=dict(attributes))

    def finish(self, span, request_id: str, request, *, finish_reason: str, error: str | None = None) -> None:
        """Writes queue / prefill_chunk / decode under `span` from the request's timestamps and ends it."""
        if span is None:
            return
        with self._lock:
            chunks = self._chunks.pop(request_id, [])
        ctx = trace.set_span_in_context(span)
        now = time.monotonic()
        if request is not None:
            m = request.metrics
            queue_end = m.first_scheduled_time if m.first_scheduled_time is not None else (m.finished_time or now)
            self._tracer.start_span("queue", context=ctx, start_time=epoch_ns(m.arrival_time),
                                    attributes={"meshserve.priority": request.priority}
                                    ).end(end_time=epoch_ns(queue_end))
            for i, (start, n, t0, t1) in enumerate(chunks):
                self._tracer.start_span("prefill_chunk", context=ctx, start_time=epoch_ns(t0), attributes={
                    "meshserve.chunk_index": i, "meshserve.chunk_start": start, "meshserve.chunk_tokens": n,
                }).end(end_time=epoch_ns(t1))
            if m.first_token_time is not None:
                decode = self._tracer.start_span("decode", context=ctx, start_time=epoch_ns(m.first_token_time),
                                                 attributes={"meshserve.output_tokens": len(m.token_times)})
                out = request.output_token_ids
                for i, t in enumerate(m.token_times):
                    attrs = {"meshserve.token_index": i}
                    if self.trace_content and i < len(out):
                        attrs["meshserve.token_id"] = int(out[i])
                    decode.add_event("token", attributes=attrs, timestamp=epoch_ns(t))
                decode.end(end_time=epoch_ns(m.finished_time or now))
            span.set_attribute("meshserve.prompt_tokens", request.num_prompt_tokens)
            span.set_attribute("meshserve.output_tokens", request.num_output_tokens)
            span.set_attribute("meshserve.cached_prompt_tokens", m.num_cached_prompt_tokens)
            span.set_attribute("meshserve.preemptions", m.num_preemptions)
        span.set_attribute("meshserve.finish_reason", finish_reason)
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=epoch_ns(time.monotonic()))

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()
