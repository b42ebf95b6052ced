"""`python -m serving.server --model=DIR [--flagfile=FILE] ...`: one instance server (gRPC meshserve.v1 + health,
Prometheus on --metrics_port, OTLP traces with --otlp_endpoint). SIGTERM drains and exits 0."""
from __future__ import annotations

import asyncio
import glob
import json
import logging
import os
import signal
import sys

from absl import app, flags

FLAGS = flags.FLAGS

flags.DEFINE_string("model", None, "HF model directory or Orbax checkpoint (models.convert).")
flags.DEFINE_string("tokenizer", "", "Tokenizer directory (default: the model directory).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Parameter and KV-cache dtype.")
flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
flags.DEFINE_integer("num_pages", 0, "KV pages; 0: sized from --kv_cache_memory_gb or --kv_cache_memory_fraction.")
flags.DEFINE_float("kv_cache_memory_gb", 1.0, "KV-cache size when --num_pages=0.")
flags.DEFINE_float("kv_cache_memory_fraction", 0.0,
                   "If > 0 (and --num_pages=0): the KV cache gets this fraction of the device's memory, less the "
                   "weights and what is already in use (vLLM's gpu_memory_utilization).")
flags.DEFINE_integer("max_model_len", 0, "Context cap in tokens; 0: the model's.")
flags.DEFINE_integer("max_num_seqs", 64, "Sequences running at once.")
flags.DEFINE_integer("max_num_batched_tokens", 512, "Token budget per step (the largest compiled bucket).")
flags.DEFINE_integer("min_token_bucket", 16, "Smallest compiled token bucket.")
flags.DEFINE_integer("max_prefill_chunk", 0, "Per-request prefill chunk cap; 0: the token budget.")
flags.DEFINE_boolean("enable_prefix_caching", True, "Reuse KV pages of shared prompt prefixes.")
flags.DEFINE_integer("max_waiting_requests", 1024, "Queue bound in requests (RESOURCE_EXHAUSTED beyond it).")
flags.DEFINE_integer("max_waiting_tokens", 1 << 22, "Queue bound in prompt tokens (RESOURCE_EXHAUSTED beyond it).")
flags.DEFINE_integer("long_prompt_threshold", 8192, "Prompts longer than this go through the long lane.")
flags.DEFINE_integer("max_long_prefills", 1, "Long prompts in prefill at once.")
flags.DEFINE_float("priority_ageing_s", 10.0, "Ageing of lower priority classes, seconds per class.")
flags.DEFINE_integer("seed", 0, "Seed for requests that bring none.")
flags.DEFINE_float("debug_step_delay_s", 0.0, "Adds this much to every engine step (simulates a slow device).")
flags.DEFINE_string("host", "0.0.0.0", "Address to listen on.")
flags.DEFINE_integer("port", 50051, "gRPC port; 0: any free port.")
flags.DEFINE_integer("metrics_port", 9090, "Prometheus port; 0: any free port; -1: none.")
flags.DEFINE_enum("log_format", "text", ["text", "json"], "Log line format.")
flags.DEFINE_float("drain_grace_s", 30.0, "On SIGTERM: how long accepted requests may take to finish.")
flags.DEFINE_integer("max_request_bytes", 1 << 20, "Largest GenerateRequest accepted (INVALID_ARGUMENT beyond).")
flags.DEFINE_float("retry_after_s", 1.0, "Retry hint sent with RESOURCE_EXHAUSTED.")
flags.DEFINE_string("instance_id", "", "Name in load reports (default host:pid).")
flags.DEFINE_string("otlp_endpoint", "", "OTLP/gRPC collector for traces (host:port); empty: no tracing.")
flags.DEFINE_string("service_name", "meshserve", "service.name of the traces.")
flags.DEFINE_boolean("warmup", True, "Compile every bucket before SERVING (never turn off in production).")
flags.DEFINE_string("compilation_cache_dir", "", "JAX persistent compilation cache (faster restarts).")
flags.DEFINE_string("ready_file", "", "Written (JSON: port, metrics_port, pid) once the server is SERVING.")


class _JsonFormatter(logging.Formatter):
    def format(self, record):
        out = {"ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
               "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def _setup_logging(fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def _kv_cache_gb_from_fraction(fraction: float, model_dir: str) -> float:
    import jax
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        raise app.UsageError(f"--kv_cache_memory_fraction: {jax.devices()[0]} does not report its memory; "
                             "use --num_pages or --kv_cache_memory_gb")
    weights = sum(os.path.getsize(p) for p in glob.glob(os.path.join(model_dir, "**", "*"), recursive=True)
                  if os.path.isfile(p) and not p.endswith((".json", ".jinja", ".txt", ".model")))
    free = fraction * stats["bytes_limit"] - stats.get("bytes_in_use", 0) - weights
    if free <= 0:
        raise app.UsageError(f"--kv_cache_memory_fraction={fraction}: nothing left for the KV cache after "
                             f"{weights / 2**30:.2f} GiB of weights")
    return free / 2 ** 30


async def _serve() -> int:
    from serving.core.engine import EngineConfig
    from serving.server.app import InstanceServer, ServerConfig, build_engine
    kv_gb = FLAGS.kv_cache_memory_gb
    if FLAGS.kv_cache_memory_fraction > 0 and not FLAGS.num_pages:
        kv_gb = _kv_cache_gb_from_fraction(FLAGS.kv_cache_memory_fraction, FLAGS.model)
    engine_config = EngineConfig(
        model=FLAGS.model, dtype=FLAGS.dtype, page_size=FLAGS.page_size, num_pages=FLAGS.num_pages,
        kv_cache_memory_gb=kv_gb, max_model_len=FLAGS.max_model_len or None, max_num_seqs=FLAGS.max_num_seqs,
        max_num_batched_tokens=FLAGS.max_num_batched_tokens, min_token_bucket=FLAGS.min_token_bucket,
        max_prefill_chunk=FLAGS.max_prefill_chunk or None, enable_prefix_caching=FLAGS.enable_prefix_caching,
        max_waiting_requests=FLAGS.max_waiting_requests, max_waiting_tokens=FLAGS.max_waiting_tokens,
        long_prompt_threshold=FLAGS.long_prompt_threshold, max_long_prefills=FLAGS.max_long_prefills,
        priority_ageing_s=FLAGS.priority_ageing_s, seed=FLAGS.seed, debug_step_delay_s=FLAGS.debug_step_delay_s)
    server_config = ServerConfig(
        host=FLAGS.host, port=FLAGS.port, metrics_port=FLAGS.metrics_port, warmup=FLAGS.warmup,
        drain_grace_s=FLAGS.drain_grace_s, max_request_bytes=FLAGS.max_request_bytes,
        retry_after_s=FLAGS.retry_after_s, instance_id=FLAGS.instance_id, otlp_endpoint=FLAGS.otlp_endpoint,
        service_name=FLAGS.service_name, ready_file=FLAGS.ready_file)
    engine = build_engine(engine_config, FLAGS.tokenizer)
    server = InstanceServer(engine, server_config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: (logging.getLogger("serving.server").info(
            "%s: draining", signal.Signals(s).name), asyncio.ensure_future(server.stop())))
    await server.start()
    await server.wait_stopped()
    return 0


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.model:
        raise app.UsageError("--model is required")
    _setup_logging(FLAGS.log_format)
    import prometheus_client
    prometheus_client.disable_created_metrics()  # the *_created series only add noise to every scrape
    if FLAGS.compilation_cache_dir:
        import jax
        jax.config.update("jax_compilation_cache_dir", FLAGS.compilation_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    code = asyncio.run(_serve())
    logging.getLogger("serving.server").info("exited cleanly")
    logging.shutdown()
    sys.exit(code)


if __name__ == "__main__":
    app.run(main)
