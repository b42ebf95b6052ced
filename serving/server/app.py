"""`InstanceServer` (with `ServerConfig`): one engine behind a grpc.aio server and, with `http_port`, the OpenAI HTTP
API on the same event loop (serving.server.http), with health, Prometheus metrics and traces, its start-up (warm-up
before SERVING) and graceful shutdown; `expert_stats`. Details: docs/server.md."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from serving.api.protocol import parser_markers
from serving.api.tools import resolve_tool_call_parser
from serving.core.async_engine import AsyncEngine
from serving.core.interface import ServingEngine
from serving.auth import AuthInterceptor, InstanceKeys, bind_warning
from serving.server.config import ServerConfig
from serving.server.servicer import InferenceServicer, ServingOptions
from serving.telemetry.load import LoadTracker
from serving.telemetry.metrics import ServerMetrics
from serving.telemetry.tracing import RequestTracer, make_tracer_provider
from serving.transport import server_options
from serving.wire import meshserve_pb2_grpc as pb_grpc
from serving.wire.decoding import DecodeErrorInterceptor

log = logging.getLogger(__name__)

SERVICE_NAME = "meshserve.v1.Inference"



class InstanceServer:
    def __init__(self, engine: ServingEngine, config: ServerConfig, *, span_exporter=None):
        self.engine = engine
        self.config = config
        self.instance_id = config.instance_id or f"{socket.gethostname()}:{os.getpid()}"
        self.aengine = AsyncEngine(engine)
        self.keys = InstanceKeys(config.api_key_file, config.admin_key_file)  # raises ValueError naming the file
        self.tracer = RequestTracer(make_tracer_provider(config.service_name, otlp_endpoint=config.otlp_endpoint,
                                                         otlp_ca_file=config.otlp_ca_file, exporter=span_exporter),
                                    trace_content=config.trace_content)
        spec = getattr(engine, "spec", None)

        def stats() -> dict:
            out = engine.scheduler.stats()
            out.update(engine.structured.stats())
            out.update(getattr(engine, "host_kv_stats", dict)())
            if spec is not None:
                out.update(spec.stats())
            out["pipeline_bubble_fraction"] = getattr(engine, "bubble_fraction", 0.0)
            if engine.config.enable_lora:
                out["lora_requests_info"] = engine.lora_requests_info()
            if engine.model_config.is_moe and self.aengine.is_alive:
                out.update(self.aengine.call(expert_stats).result(30))  # between steps, on the engine thread
            return out
        self.model_name = (config.served_model_name or os.path.basename(os.path.normpath(engine.config.model))
                           or "model")
        self.metrics = ServerMetrics(self.model_name, stats, num_speculative_tokens=spec.k if spec is not None else 0,
                                     page_size=engine.config.page_size, num_pages=engine.num_pages,
                                     cache_dtype=engine.config.kv_cache_dtype_name, dtype=engine.config.dtype,
                                     quantization=engine.model_config.quantization or "none",
                                     max_lora=engine.config.max_loras if engine.config.enable_lora else 0)
        self.load_tracker = LoadTracker(self.metrics, self.tracer)
        self.aengine.step_listeners.append(self.load_tracker)
        self.health = health.aio.HealthServicer()
        self.servicer = InferenceServicer(
            self.aengine, ServingOptions(instance_id=self.instance_id, max_request_bytes=config.max_request_bytes,
                                         retry_after_s=config.retry_after_s, lora_root=config.lora_root),
            metrics=self.metrics, tracer=self.tracer, load_tracker=self.load_tracker,
            on_drain_change=lambda draining: asyncio.ensure_future(self._set_health(not draining)))
        self.servicer.model_name = self.model_name
        if config.role != "both":
            from serving.auth import KeyFile
            from serving.server.disagg import Disaggregation
            def read(path):
                with open(path, "rb") as f:
                    return f.read()
            # TLS to prefill instances: their CA; this instance's own certificate is the client's (their mTLS)
            peer_tls = None
            if config.kv_peer_ca_file:
                peer_tls = grpc.ssl_channel_credentials(
                    read(config.kv_peer_ca_file), read(config.tls_key) if config.tls_cert else None,
                    read(config.tls_cert) if config.tls_cert else None)
            peer_key = KeyFile(config.kv_peer_key_file, "kv_peer_key_file").first() if config.kv_peer_key_file else ""
            self.servicer.disagg = Disaggregation(self.aengine, config.role, timeout_s=config.kv_transfer_timeout_s,
                                                  peer_key=peer_key, peer_tls=peer_tls, metrics=self.metrics)
        # The chat parsers (ModelInfo reports them to the gateway); their markers stay in the decoded text.
        tok = engine.tokenizer
        self.tool_call_parser = resolve_tool_call_parser(config.tool_call_parser, tok.chat_template if tok else None)
        self.reasoning_parser = engine.config.reasoning_parser
        if tok is not None:
            tok.show_special_tokens(parser_markers(self.tool_call_parser, self.reasoning_parser))
        self.servicer.tool_call_parser, self.servicer.reasoning_parser = self.tool_call_parser, self.reasoning_parser
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.metrics_port = 0
        self.http = None  # serving.server.http.OpenAIServer when http_port >= 0
        self.http_port = 0
        self._metrics_http = None
        self._stopped = asyncio.Event()
        self._stopping = False
        self._watchdog: asyncio.Future | None = None

    async def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def start(self) -> None:
        cfg = self.config
        # Keys are checked first, before any handler or decoder runs; messages over the limit never reach either.
        self.server = grpc.aio.server(
            interceptors=[AuthInterceptor(self.keys, on_refused=self.metrics.observe_error), DecodeErrorInterceptor()],
            options=server_options(cfg.max_request_bytes, cfg.max_concurrent_streams))
        pb_grpc.add_InferenceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if cfg.tls_cert:
            def read(path):
                with open(path, "rb") as f:
                    return f.read()
            credentials = grpc.ssl_server_credentials(
                [(read(cfg.tls_key), read(cfg.tls_cert))],
                root_certificates=read(cfg.tls_client_ca) if cfg.tls_client_ca else None,
                require_client_auth=bool(cfg.tls_client_ca))
            self.port = self.server.add_secure_port(f"{cfg.host}:{cfg.port}", credentials)
        else:
            self.port = self.server.add_insecure_port(f"{cfg.host}:{cfg.port}")
        if self.port == 0:
            raise RuntimeError(f"cannot listen on {cfg.host}:{cfg.port}")
        warning = bind_warning(cfg.host, self.port, self.keys)
        if warning:
            log.warning("%s", warning)
        await self._set_health(False)
        await self.server.start()
        if cfg.metrics_port >= 0:
            self._metrics_http, self.metrics_port = self.metrics.start_http_server(cfg.metrics_port, cfg.host)
        if cfg.http_port >= 0:  # answers 503 on /health and the APIs until SERVING
            from serving.api.guard import HttpLimits
            from serving.server.http import OpenAIServer
            self.http = OpenAIServer(self.servicer, model_name=self.model_name,
                                     max_request_bytes=cfg.max_request_bytes, retry_after_s=cfg.retry_after_s,
                                     tool_call_parser=self.tool_call_parser, keys=self.keys,
                                     limits=HttpLimits(cfg.http_header_timeout_s, cfg.http_body_timeout_s,
                                                       cfg.http_max_connections))
            self.http_port = self.servicer.http_port = await self.http.start(cfg.host, cfg.http_port, tls_cert=cfg.tls_cert, tls_key=cfg.tls_key,
                                                   tls_client_ca=cfg.tls_client_ca)
        log.info("listening on %s:%d (metrics :%s, HTTP :%s); warming up", cfg.host, self.port,
                 self.metrics_port or "off", self.http_port or "off")
        if cfg.warmup:
            # On the engine thread, before any request: compiles every bucket's programs.
            await asyncio.wrap_future(self.aengine.call(lambda e: e.warmup()))
        if self.servicer.disagg is not None:
            await self.servicer.disagg.start()  # compiles the page transfer programs; the prefill side's reaper
        self.metrics.set_compile_stats(self.engine.compile_count, self.engine.compile_time_s)
        self.metrics.set_draining(False)
        self.servicer.ready = True
        await self._set_health(True)
        log.info("SERVING on %s:%d: %d programs compiled in %.1fs", cfg.host, self.port, self.engine.compile_count,
                 self.engine.compile_time_s)
        self._watchdog = asyncio.ensure_future(self._watch_engine())
        if cfg.ready_file:
            tmp = cfg.ready_file + ".tmp"
            info = {"port": self.port, "metrics_port": self.metrics_port, "pid": os.getpid(),
                    "instance_id": self.instance_id}
            if self.http is not None:
                info["http_port"] = self.http_port
            with open(tmp, "w") as f:
                json.dump(info, f)
            os.replace(tmp, cfg.ready_file)

    async def _watch_engine(self) -> None:
        """A dead engine thread cannot serve: say so on health, so orchestrators and the gateway move away."""
        while not self._stopping:
            if not self.aengine.is_alive:
                log.error("the engine thread died; reporting NOT_SERVING")
                self.servicer.ready = False
                await self._set_health(False)
                return
            await asyncio.sleep(1.0)

    async def stop(self, grace_s: float | None = None) -> None:
        """Drains: admits nothing new, waits up to grace_s for accepted requests, aborts the rest, closes."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        grace = self.config.drain_grace_s if grace_s is None else grace_s
        self.servicer.set_draining(True)
        await self._set_health(False)
        t0 = time.monotonic()
        n = len(self.servicer.inflight)
        log.info("shutting down: draining %d requests (grace %.1fs)", n, grace)
        if not await self.servicer.wait_idle(grace):
            left = self.servicer.abort_all()
            log.warning("grace period over: aborted %d requests", left)
            await self.servicer.wait_idle(5.0)
        log.info("drained in %.2fs", time.monotonic() - t0)
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.servicer.disagg is not None:
            await self.servicer.disagg.close()
        if self.http is not None:
            await self.http.stop()
        if self.server is not None:
            await self.server.stop(1.0)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        self.aengine.shutdown()
        self.tracer.shutdown()
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


def expert_stats(engine: ServingEngine) -> dict:
    """MoE expert load for metrics: tokens per physical slot and their variance over expert-parallel devices."""
    load, per_device = engine.expert_load(), engine.expert_device_load()
    layers = engine.moe_layer_indices()
    return {"expert_tokens": {(layers[i], slot): int(v) for i, row in enumerate(load) for slot, v in enumerate(row)},
            "expert_load_variance": float(per_device.var(axis=1).mean())}
