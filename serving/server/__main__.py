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


# The server's flags that are no field of EngineConfig or ServerConfig (those are defined from the dataclasses).
SERVER_ONLY_FLAGS = ("tokenizer", "kv_cache_memory_fraction", "coordinator_address", "num_processes", "process_id",
                     "step_channel_port", "step_channel_secret_file", "log_format")


def define_flags(fv: flags.FlagValues = FLAGS) -> None:
    """The server's flags (defined when the entry point runs, so importing this module defines nothing): one per
    EngineConfig and ServerConfig field (`serving.config_flags`), and SERVER_ONLY_FLAGS."""
    from serving.config_flags import flag_definitions
    from serving.core.config import EngineConfig
    from serving.server.config import ServerConfig

    def d(define, *args):
        define(*args, flag_values=fv)
    for define, *args in flag_definitions(EngineConfig) + flag_definitions(ServerConfig):
        d(define, *args)
    d(flags.DEFINE_string, "tokenizer", "", "Tokenizer directory or GGUF file (default: the model's).")
    d(flags.DEFINE_float, "kv_cache_memory_fraction", 0.0,
      "If > 0 (and --num_pages=0): this instance may use this fraction of the device's memory (at most what is "
      "free); the KV cache gets what the weights and activations leave (vLLM's gpu_memory_utilization; sized "
      "by serving.ledger).")
    d(flags.DEFINE_string, "coordinator_address", "",
      "Multi-host: host:port of the JAX coordination service (process 0); empty: one process.")
    d(flags.DEFINE_integer, "num_processes", 1, "Multi-host: processes in the instance (one per host).")
    d(flags.DEFINE_integer, "process_id", 0, "Multi-host: this process; 0 leads (gRPC + scheduler), others follow.")
    d(flags.DEFINE_integer, "step_channel_port", 0,
      "Multi-host: leader port for step messages to the followers; 0: the coordinator port + 1.")
    d(flags.DEFINE_string, "step_channel_secret_file", "",
      "Multi-host: file with the secret (>= 16 bytes) every process of the instance shares; the step channel is "
      "authenticated with it (else $MESHSERVE_STEP_SECRET_FILE / $MESHSERVE_STEP_SECRET; one is required).")
    d(flags.DEFINE_enum, "log_format", "text", ["text", "json"], "Log line format.")


def screens_head(f: flags.FlagValues) -> bool:
    """Whether the engine these flags configure builds the LM head's int8 screen (the engine's own choice,
    `serving.core.platform.platform_choices`, on the devices and processes the flags give it)."""
    from serving.core.platform import platform_choices
    return platform_choices(dtype=f.dtype, greedy_head_screen=f.greedy_head_screen, num_devices=f.tp * f.ep * f.pp,
                            num_processes=f.num_processes).greedy_head_screen


def configs_from_flags(f: flags.FlagValues = FLAGS):
    """(EngineConfig, ServerConfig) from parsed flags."""
    from serving.config_flags import from_flags
    from serving.core.config import EngineConfig
    from serving.server.config import ServerConfig
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
                              speculative_model=f.speculative_model, hybrid_kv_cache=f.hybrid_kv_cache)
        try:
            model_config = with_quantization(ledger.load_config(model=f.model)[1], f.quantization)
            num_pages = f.dp * kv_cache_pages(sizing, model_config,
                                              head_screen=screens_head(f),
                                              memory_fraction=f.kv_cache_memory_fraction)
        except ValueError as e:
            raise app.UsageError(f"--kv_cache_memory_fraction={f.kv_cache_memory_fraction}: {e}") from e
        logging.getLogger("serving.server").info("--kv_cache_memory_fraction=%g: %d KV pages",
                                                 f.kv_cache_memory_fraction, num_pages)
    engine_config = from_flags(EngineConfig, f, num_pages=num_pages)
    server_config = from_flags(ServerConfig, f)
    try:  # a bad key file fails now, not once the model has loaded
        from serving.auth import InstanceKeys
        InstanceKeys(f.api_key_file, f.admin_key_file)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    return engine_config, server_config


def _distributed_config():
    from sharding.multihost import DistributedConfig, load_secret
    if FLAGS.num_processes <= 1:
        return None
    if not FLAGS.coordinator_address:
        raise app.UsageError("--num_processes > 1 needs --coordinator_address (host:port of process 0)")
    port = FLAGS.step_channel_port or int(FLAGS.coordinator_address.rsplit(":", 1)[1]) + 1
    try:
        secret = load_secret(FLAGS.step_channel_secret_file)
    except (OSError, ValueError) as e:
        raise app.UsageError(str(e)) from None
    return DistributedConfig(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id, port, secret=secret)


def _follow(dist) -> int:
    """A follower process: the same engine, running the steps the leader sends, no gRPC."""
    from serving.core.factory import build_engine
    from sharding.multihost import shutdown
    engine_config, _ = configs_from_flags(FLAGS)
    engine = build_engine(engine_config, FLAGS.tokenizer)
    engine.follow(dist.follower_channel())
    shutdown()
    return 0


async def _serve(dist=None) -> int:
    from serving.core.factory import build_engine
    from serving.server.app import InstanceServer
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
        def follower_lost(pid, err):
            # Steps can no longer complete: fail every request (UNAVAILABLE) and leave, rather than hang.
            server.aengine.kill(err)
            threading.Timer(1.0, lambda: os._exit(4)).start()
        engine.runner.channel = await asyncio.to_thread(dist.leader_channel, on_follower_lost=follower_lost)
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
