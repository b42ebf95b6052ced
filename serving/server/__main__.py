"""`python -m serving.server --model=DIR [--flagfile=FILE] ...`: one instance server (gRPC meshserve.v1 + health, the
OpenAI HTTP API on --http_port, Prometheus on --metrics_port, OTLP traces with --otlp_endpoint). SIGTERM drains and
exits 0."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading

from absl import app, flags

from serving.telemetry.logs import start_entry_point

FLAGS = flags.FLAGS


def define_flags(fv: flags.FlagValues = FLAGS) -> None:
    """The server's flags (defined when the entry point runs, so importing this module defines nothing)."""
    def d(define, *args):
        define(*args, flag_values=fv)
    d(flags.DEFINE_string, "model", None, "HF model directory, GGUF file (a split one's part, or a directory holding "
      "one), or Orbax checkpoint (models.convert).")
    d(flags.DEFINE_string, "tokenizer", "", "Tokenizer directory or GGUF file (default: the model's).")
    d(flags.DEFINE_enum, "dtype", "float32", ["float32", "bfloat16", "float16"],
      "Parameter and activation dtype (and the KV cache's with --kv_cache_dtype=auto).")
    d(flags.DEFINE_enum, "quantization", "none", ["none", "int8", "fp8"],
      "Matmul weights quantized at load, per-channel scales (int8 symmetric, fp8 e4m3); 'none': as the "
      "checkpoint holds them (a compressed-tensors or block-wise fp8 checkpoint loads quantized as it is).")
    d(flags.DEFINE_enum, "kv_cache_dtype", "auto", ["auto", "int8", "fp8_e4m3"],
      "KV-cache dtype: 'auto' (--dtype), or quantized with a scale per token and KV head (about twice the pages "
      "of bfloat16 in the same memory).")
    d(flags.DEFINE_integer, "tp", 1, "Tensor-parallel degree (devices on the mesh's 'tensor' axis).")
    d(flags.DEFINE_integer, "ep", 1, "Expert-parallel degree (MoE models; devices on the 'expert' axis).")
    d(flags.DEFINE_integer, "pp", 1, "Pipeline stages (devices on the mesh's 'pipeline' axis; dense models).")
    d(flags.DEFINE_integer, "dp", 1,
      "Data-parallel replicas inside the instance, each on its own --tp x --ep devices with its own scheduler and "
      "KV pages (--num_pages / --kv_cache_memory_gb are split over them; --max_num_seqs and the queue bounds are "
      "per replica). Not with --pp, speculative decoding or multi-host.")
    d(flags.DEFINE_integer, "micro_batches", 0, "Pipeline micro-batches per step; 0: --pp.")
    d(flags.DEFINE_integer, "spare_expert_slots", 0, "MoE: extra expert slots per layer for replicas of hot experts.")
    d(flags.DEFINE_integer, "page_size", 16, "Tokens per KV page.")
    d(flags.DEFINE_integer, "num_pages", 0,
      "KV pages; 0: sized from --kv_cache_memory_fraction or --kv_cache_memory_gb.")
    d(flags.DEFINE_float, "kv_cache_memory_gb", 1.0, "KV-cache size when --num_pages=0.")
    d(flags.DEFINE_float, "kv_cache_memory_fraction", 0.0,
      "If > 0 (and --num_pages=0): this instance may use this fraction of the device's memory (at most what is "
      "free); the KV cache gets what the weights and activations leave (vLLM's gpu_memory_utilization; sized "
      "by serving.ledger).")
    d(flags.DEFINE_integer, "max_model_len", 0, "Context cap in tokens; 0: the model's.")
    d(flags.DEFINE_integer, "max_num_seqs", 64, "Sequences running at once (per --dp replica).")
    d(flags.DEFINE_integer, "max_num_batched_tokens", 512, "Token budget per step (the largest compiled bucket).")
    d(flags.DEFINE_integer, "min_token_bucket", 0,
      "Smallest compiled token bucket; 0 = the platform's smallest efficient batch (CPU: 1 for float32, 8 for "
      "bfloat16; accelerators: 8).")
    d(flags.DEFINE_integer, "max_prefill_chunk", 0, "Per-request prefill chunk cap; 0: the token budget.")
    d(flags.DEFINE_boolean, "enable_prefix_caching", True, "Reuse KV pages of shared prompt prefixes.")
    d(flags.DEFINE_integer, "max_waiting_requests", 1024, "Queue bound in requests (RESOURCE_EXHAUSTED beyond it).")
    d(flags.DEFINE_integer, "max_waiting_tokens", 1 << 22,
      "Queue bound in prompt tokens (RESOURCE_EXHAUSTED beyond it).")
    d(flags.DEFINE_integer, "long_prompt_threshold", 8192, "Prompts longer than this go through the long lane.")
    d(flags.DEFINE_integer, "max_long_prefills", 1, "Long prompts in prefill at once.")
    d(flags.DEFINE_float, "priority_ageing_s", 10.0, "Ageing of lower priority classes, seconds per class.")
    d(flags.DEFINE_integer, "seed", 0, "Seed for requests that bring none.")
    d(flags.DEFINE_boolean, "async_scheduling", True,
      "After a greedy step, schedule and launch the next one before its tokens reach the host (the next step's "
      "decodes read them on the device); single-device engines without speculative decoding.")
    d(flags.DEFINE_boolean, "greedy_head_screen", True,
      "Greedy steps of up to 4 sequences on the native CPU kernels take the LM head's argmax from an int8 copy of "
      "it plus an exact recheck of the rows its error bounds leave open (same tokens, a fraction of the read).")
    d(flags.DEFINE_string, "compilation_cache_dir", None,
      "JAX persistent compilation cache (a restart loads its compiled programs); default "
      "$MESHSERVE_COMPILATION_CACHE or ~/.cache/meshserve/xla/<platform>; '' turns it off.")
    d(flags.DEFINE_float, "debug_step_delay_s", 0.0, "Adds this much to every engine step (simulates a slow device).")
    d(flags.DEFINE_enum, "speculative_method", "", ["", "draft", "ngram"],
      "Speculative decoding: 'draft' (--speculative_model proposes), 'ngram' (prompt lookup); empty: off.")
    d(flags.DEFINE_string, "speculative_model", "", "Draft model directory (same tokenizer as --model).")
    d(flags.DEFINE_integer, "num_speculative_tokens", 4, "Draft tokens per speculating sequence per step (k).")
    d(flags.DEFINE_integer, "prompt_lookup_min", 1, "Shortest n-gram prompt lookup matches (--speculative_method=ngram).")
    d(flags.DEFINE_integer, "prompt_lookup_max", 4, "Longest n-gram prompt lookup matches (--speculative_method=ngram).")
    d(flags.DEFINE_integer, "speculative_disable_by_batch_size", 0,
      "No speculation while this many requests or more are running; 0: never switched off by batch size.")
    d(flags.DEFINE_float, "speculative_min_acceptance", -1.0,
      "A request stops speculating (for a back-off period) when its acceptance rate falls below this; < 0: the "
      "break-even rate for k and the draft's cost.")
    d(flags.DEFINE_string, "coordinator_address", "",
      "Multi-host: host:port of the JAX coordination service (process 0); empty: one process.")
    d(flags.DEFINE_integer, "num_processes", 1, "Multi-host: processes in the instance (one per host).")
    d(flags.DEFINE_integer, "process_id", 0, "Multi-host: this process; 0 leads (gRPC + scheduler), others follow.")
    d(flags.DEFINE_integer, "step_channel_port", 0,
      "Multi-host: leader port for step messages to the followers; 0: the coordinator port + 1.")
    d(flags.DEFINE_string, "host", "0.0.0.0", "Address to listen on.")
    d(flags.DEFINE_string, "tls_cert", "", "PEM certificate chain: serve TLS (with --tls_key).")
    d(flags.DEFINE_string, "tls_key", "", "PEM private key for --tls_cert.")
    d(flags.DEFINE_string, "tls_client_ca", "", "PEM CA: require client certificates signed by it (mutual TLS).")
    d(flags.DEFINE_integer, "port", 50051, "gRPC port; 0: any free port.")
    d(flags.DEFINE_integer, "metrics_port", 9090, "Prometheus port; 0: any free port; -1: none.")
    d(flags.DEFINE_integer, "http_port", -1,
      "OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health, /tokenize, "
      "/detokenize) on this port, beside gRPC; 0: any free port (reported in --ready_file); -1: off.")
    d(flags.DEFINE_string, "served_model_name", "",
      "The model's name in the HTTP API (requests naming another get 404) and in metrics; default: the --model "
      "directory's name.")
    d(flags.DEFINE_enum, "reasoning_parser", "", ["", "deepseek_r1", "qwen3"],
      "How the model marks its reasoning (<think>...</think>): chat responses carry it as reasoning_content, usage "
      "counts its tokens, and a response_format or forced tool call applies only after it; empty: no reasoning.")
    d(flags.DEFINE_enum, "tool_call_parser", "", ["", "hermes", "llama3_json", "mistral"],
      "The format of the model's tool calls, parsed into OpenAI tool_calls; empty: the one its chat template shows "
      "(<tool_call>: hermes, [TOOL_CALLS]: mistral, <|python_tag|>: llama3_json), else none.")
    d(flags.DEFINE_enum, "log_format", "text", ["text", "json"], "Log line format.")
    d(flags.DEFINE_float, "drain_grace_s", 30.0, "On SIGTERM: how long accepted requests may take to finish.")
    d(flags.DEFINE_integer, "max_request_bytes", 1 << 20,
      "Largest GenerateRequest accepted (INVALID_ARGUMENT beyond).")
    d(flags.DEFINE_float, "retry_after_s", 1.0, "Retry hint sent with RESOURCE_EXHAUSTED.")
    d(flags.DEFINE_string, "instance_id", "", "Name in load reports (default host:pid).")
    d(flags.DEFINE_string, "otlp_endpoint", "", "OTLP/gRPC collector for traces (host:port); empty: no tracing.")
    d(flags.DEFINE_string, "service_name", "meshserve", "service.name of the traces.")
    d(flags.DEFINE_boolean, "warmup", True, "Compile every bucket before SERVING (never turn off in production).")
    d(flags.DEFINE_string, "ready_file", "",
      "Written (JSON: port, metrics_port, http_port with --http_port, pid) once the server is SERVING.")


def screens_head(f: flags.FlagValues) -> bool:
    """Whether the engine these flags configure builds the LM head's int8 screen (the engine's own choice,
    `serving.core.platform.platform_choices`, on the devices and processes the flags give it)."""
    from serving.core.platform import platform_choices
    return platform_choices(dtype=f.dtype, greedy_head_screen=f.greedy_head_screen, num_devices=f.tp * f.ep * f.pp,
                            num_processes=f.num_processes).greedy_head_screen


def configs_from_flags(f: flags.FlagValues = FLAGS):
    """(EngineConfig, ServerConfig) from parsed flags."""
    from serving.core.config import EngineConfig
    from serving.server.app import ServerConfig
    if f.dp < 1:
        raise app.UsageError(f"--dp must be >= 1, got {f.dp}")
    if f.dp > 1:
        other = ("--pp" if f.pp > 1 else "--speculative_method" if f.speculative_method else
                 "--num_processes" if f.num_processes > 1 else "")
        if other:
            raise app.UsageError(f"--dp={f.dp} does not combine with {other}: data-parallel replicas take "
                                 "--tp/--ep only, on one host")
    num_pages = f.num_pages
    if f.kv_cache_memory_fraction > 0 and not num_pages:
        # Sized before the engine loads anything, by the engine's own sizing, on each replica's own devices.
        from serving import ledger
        from serving.core.model_runner import kv_cache_pages
        from models.weights import with_quantization
        sizing = EngineConfig(model=f.model, dtype=f.dtype, page_size=f.page_size, kv_cache_dtype=f.kv_cache_dtype,
                              max_num_batched_tokens=f.max_num_batched_tokens, max_num_seqs=f.max_num_seqs,
                              tp=f.tp, ep=f.ep, speculative_method=f.speculative_method,
                              speculative_model=f.speculative_model)
        try:
            model_config = with_quantization(ledger.load_config(model=f.model)[1], f.quantization)
            num_pages = f.dp * kv_cache_pages(sizing, model_config,
                                              head_screen=screens_head(f),
                                              memory_fraction=f.kv_cache_memory_fraction)
        except ValueError as e:
            raise app.UsageError(f"--kv_cache_memory_fraction={f.kv_cache_memory_fraction}: {e}") from e
        logging.getLogger("serving.server").info("--kv_cache_memory_fraction=%g: %d KV pages",
                                                 f.kv_cache_memory_fraction, num_pages)
    engine_config = EngineConfig(
        model=f.model, dtype=f.dtype, quantization=f.quantization, kv_cache_dtype=f.kv_cache_dtype,
        page_size=f.page_size, num_pages=num_pages, kv_cache_memory_gb=f.kv_cache_memory_gb, max_model_len=f.max_model_len or None,
        max_num_seqs=f.max_num_seqs, max_num_batched_tokens=f.max_num_batched_tokens,
        min_token_bucket=f.min_token_bucket, max_prefill_chunk=f.max_prefill_chunk or None,
        enable_prefix_caching=f.enable_prefix_caching, max_waiting_requests=f.max_waiting_requests,
        max_waiting_tokens=f.max_waiting_tokens, long_prompt_threshold=f.long_prompt_threshold,
        max_long_prefills=f.max_long_prefills, priority_ageing_s=f.priority_ageing_s, seed=f.seed,
        async_scheduling=f.async_scheduling, greedy_head_screen=f.greedy_head_screen,
        compilation_cache_dir=f.compilation_cache_dir,
        debug_step_delay_s=f.debug_step_delay_s, tp=f.tp, ep=f.ep, dp=f.dp, pp=f.pp, micro_batches=f.micro_batches,
        spare_expert_slots=f.spare_expert_slots,
        speculative_method=f.speculative_method, speculative_model=f.speculative_model,
        num_speculative_tokens=f.num_speculative_tokens, prompt_lookup_min=f.prompt_lookup_min,
        prompt_lookup_max=f.prompt_lookup_max, speculative_disable_by_batch_size=f.speculative_disable_by_batch_size,
        speculative_min_acceptance=f.speculative_min_acceptance, reasoning_parser=f.reasoning_parser)
    server_config = ServerConfig(
        host=f.host, port=f.port, metrics_port=f.metrics_port, warmup=f.warmup, drain_grace_s=f.drain_grace_s,
        max_request_bytes=f.max_request_bytes, retry_after_s=f.retry_after_s, instance_id=f.instance_id,
        otlp_endpoint=f.otlp_endpoint, service_name=f.service_name, ready_file=f.ready_file,
        tls_cert=f.tls_cert, tls_key=f.tls_key, tls_client_ca=f.tls_client_ca, http_port=f.http_port,
        served_model_name=f.served_model_name, tool_call_parser=f.tool_call_parser)
    return engine_config, server_config


def _distributed_config():
    from sharding.multihost import DistributedConfig
    if FLAGS.num_processes <= 1:
        return None
    if not FLAGS.coordinator_address:
        raise app.UsageError("--num_processes > 1 needs --coordinator_address (host:port of process 0)")
    port = FLAGS.step_channel_port or int(FLAGS.coordinator_address.rsplit(":", 1)[1]) + 1
    return DistributedConfig(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id, port)


def _follow(dist) -> int:
    """A follower process: the same engine, running the steps the leader sends, no gRPC."""
    from serving.server.app import build_engine
    from sharding.multihost import FollowerChannel, shutdown
    engine_config, _ = configs_from_flags(FLAGS)
    engine = build_engine(engine_config, FLAGS.tokenizer)
    engine.follow(FollowerChannel(dist.leader_host, dist.step_channel_port, dist.process_id))
    shutdown()
    return 0


async def _serve(dist=None) -> int:
    from serving.server.app import InstanceServer, build_engine
    log = logging.getLogger("serving.server")
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()

    def on_signal(sig):
        log.info("%s: draining", signal.Signals(sig).name)
        stop_requested.set()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    engine_config, server_config = configs_from_flags(FLAGS)
    engine = await asyncio.to_thread(build_engine, engine_config, FLAGS.tokenizer)  # signals still handled
    if stop_requested.is_set():
        return 0
    server = InstanceServer(engine, server_config)
    if dist is not None:
        from sharding.multihost import LeaderChannel

        def follower_lost(pid, err):
            # Steps can no longer complete: fail every request (UNAVAILABLE) and leave, rather than hang.
            server.aengine.kill(err)
            threading.Timer(1.0, lambda: os._exit(4)).start()
        engine.runner.channel = await asyncio.to_thread(LeaderChannel, dist.step_channel_port, dist.num_processes - 1,
                                                 on_follower_lost=follower_lost)
    starting = asyncio.ensure_future(server.start())
    stopping = asyncio.ensure_future(stop_requested.wait())
    await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
    if starting.done():
        starting.result()  # start-up errors end the process here
        await stopping
    await server.stop()
    if not starting.done():  # stopped during warm-up
        starting.cancel()
    return 0


def main(argv):
    start_entry_point(argv, FLAGS.log_format, model=FLAGS.model)
    dist = _distributed_config()
    if dist is not None:
        from sharding.multihost import initialize
        initialize(dist)  # before any other JAX call
        if not dist.is_leader:
            sys.exit(_follow(dist))
    code = asyncio.run(_serve(dist))
    logging.getLogger("serving.server").info("exited cleanly")
    logging.shutdown()
    if any(t.name == "meshserve-engine" and t.is_alive() for t in threading.enumerate()):
        # Stopped during warm-up: the engine thread is inside an XLA compile, which interpreter teardown would
        # abort; everything worth keeping is flushed, so leave at once.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    define_flags()
    app.run(main)
