"""`python -m serving.gateway --config=FILE [--port=...]`: the gateway (meshserve.v1.Inference for clients,
meshserve.gateway.v1 Jobs and GatewayAdmin, grpc.health.v1; the OpenAI HTTP API with --http_port), Prometheus on --metrics_port, OTLP traces with
--otlp_endpoint; the config file is re-read when it changes; SIGTERM drains and exits 0. Details: docs/gateway.md."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys

from absl import app, flags

from serving.telemetry.logs import start_entry_point

FLAGS = flags.FLAGS

flags.DEFINE_string("config", None, "Gateway configuration file (YAML or JSON; docs/gateway.md).")
flags.DEFINE_string("host", "0.0.0.0", "Address to listen on.")
flags.DEFINE_integer("port", 8000, "gRPC port; 0: any free port.")
flags.DEFINE_integer("http_port", -1, "OpenAI-compatible HTTP API port (same TLS as gRPC); 0: any free port; -1: none.")
flags.DEFINE_integer("metrics_port", 9100, "Prometheus port; 0: any free port; -1: none.")
flags.DEFINE_string("jobs_db", "gateway-jobs.sqlite", "SQLite file of asynchronous jobs (kept across restarts).")
flags.DEFINE_string("tls_cert", "", "PEM certificate chain: serve TLS (with --tls_key).")
flags.DEFINE_string("tls_key", "", "PEM private key for --tls_cert.")
flags.DEFINE_string("tls_client_ca", "", "PEM CA: require client certificates signed by it (mutual TLS).")
flags.DEFINE_string("otlp_endpoint", "", "OTLP/gRPC collector for traces (host:port); empty: no tracing.")
flags.DEFINE_string("otlp_ca_file", "", "PEM CA of the OTLP collector: export over TLS; empty: plaintext.")
flags.DEFINE_integer("max_request_bytes", 1 << 20,
                     "Largest gRPC request read (with 64 KiB for a job's envelope); larger ones are refused before "
                     "they are decoded (RESOURCE_EXHAUSTED).")
flags.DEFINE_integer("max_concurrent_streams", 1024, "gRPC streams at once per client connection.")
flags.DEFINE_string("service_name", "meshserve-gateway", "service.name of the traces.")
flags.DEFINE_float("drain_grace_s", 30.0, "On SIGTERM: how long running requests may take to finish.")
flags.DEFINE_enum("log_format", "text", ["text", "json"], "Log line format.")
flags.DEFINE_string("ready_file", "", "Written (JSON: port, metrics_port, pid) once the gateway serves.")

SERVICE_NAMES = ("", "meshserve.v1.Inference", "meshserve.gateway.v1.Jobs", "meshserve.gateway.v1.GatewayAdmin")


async def _serve() -> int:
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from serving.gateway.app import Gateway
    from serving.gateway.proto import gateway_pb2_grpc as gpb_grpc
    from serving.gateway.security import GatewayAuthInterceptor, server_credentials
    from serving.gateway.service import AdminServicer, InferenceServicer, JobsServicer
    from serving.transport import server_options
    from serving.wire import meshserve_pb2_grpc as pb_grpc
    from serving.wire.decoding import DecodeErrorInterceptor

    gateway = Gateway(FLAGS.config, FLAGS.jobs_db, otlp_endpoint=FLAGS.otlp_endpoint, otlp_ca_file=FLAGS.otlp_ca_file,
                      service_name=FLAGS.service_name)

    def refused(method, code):  # counted as the servicer counts the Generate calls it ends
        if method == "/meshserve.v1.Inference/Generate":
            gateway.metrics.requests.labels(code.name).inc()
    # Keys first (a call without one is refused before its request is read), then the decoder's own errors.
    server = grpc.aio.server(interceptors=[GatewayAuthInterceptor(gateway.auth, refused), DecodeErrorInterceptor()],
                             options=server_options(FLAGS.max_request_bytes, FLAGS.max_concurrent_streams))
    inference = InferenceServicer(gateway)
    pb_grpc.add_InferenceServicer_to_server(inference, server)
    gpb_grpc.add_JobsServicer_to_server(JobsServicer(gateway), server)
    gpb_grpc.add_GatewayAdminServicer_to_server(AdminServicer(gateway), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{FLAGS.host}:{FLAGS.port}"
    if FLAGS.tls_cert:
        port = server.add_secure_port(address, server_credentials(FLAGS.tls_cert, FLAGS.tls_key, FLAGS.tls_client_ca))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"cannot listen on {address}")
    await gateway.start()
    await server.start()
    http, http_port = None, 0
    if FLAGS.http_port >= 0:
        from serving.gateway.http import GatewayHTTP
        http = GatewayHTTP(gateway)
        http_port = await http.start(FLAGS.host, FLAGS.http_port, tls_cert=FLAGS.tls_cert, tls_key=FLAGS.tls_key,
                                     tls_client_ca=FLAGS.tls_client_ca)
    metrics_http, metrics_port = None, 0
    if FLAGS.metrics_port >= 0:
        metrics_http, metrics_port = gateway.metrics.start_http_server(FLAGS.metrics_port, FLAGS.host)
    for name in SERVICE_NAMES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log = logging.getLogger("serving.gateway")
    log.info("gateway serving on %s:%d (%s; HTTP :%s; metrics :%s)", FLAGS.host, port,
             "TLS" if FLAGS.tls_cert else "plaintext", http_port or "off", metrics_port or "off")
    if FLAGS.ready_file:
        tmp = FLAGS.ready_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"port": port, "metrics_port": metrics_port, "http_port": http_port, "pid": os.getpid()}, f)
        os.replace(tmp, FLAGS.ready_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: draining for up to %.0fs", FLAGS.drain_grace_s)
    inference.draining = True
    for name in SERVICE_NAMES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    stopping = [server.stop(FLAGS.drain_grace_s)]
    if http is not None:
        stopping.append(http.stop(FLAGS.drain_grace_s))
    await asyncio.gather(*stopping)
    await gateway.stop()
    if metrics_http is not None:
        metrics_http.shutdown()
    return 0


def main(argv):
    start_entry_point(argv, FLAGS.log_format, config=FLAGS.config)
    code = asyncio.run(_serve())
    logging.getLogger("serving.gateway").info("exited cleanly")
    logging.shutdown()
    sys.exit(code)


if __name__ == "__main__":
    app.run(main)
