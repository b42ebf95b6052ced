"""One process of a two-process (2 x 4 CPU devices) meshserve instance, for tests/sharding/test_multihost.py.

    python tests/support/multihost_worker.py PROCESS_ID COORDINATOR_PORT STEP_PORT MODEL_DIR OUT_JSON [MAX_TOKENS]

Process 0 is the leader: it runs the engine (tp=8 over both processes' devices) on fixed prompts and writes the
greedy outputs to OUT_JSON. Process 1 follows. If a follower dies, the leader fails its requests and exits 3.
The step channel's secret comes from $MESHSERVE_STEP_SECRET; with $MULTIHOST_FOLLOWER_GO_FILE the follower joins
the step channel only once that file exists (so a test can reach the leader's port first).
"""
import json
import logging
import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    pid, coord_port, step_port, model_dir, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], \
        sys.argv[5]
    max_tokens = int(sys.argv[6]) if len(sys.argv) > 6 else 10
    from sharding.multihost import DistributedConfig, initialize, load_secret, shutdown
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    cfg = DistributedConfig(f"127.0.0.1:{coord_port}", 2, pid, step_port, secret=load_secret())
    initialize(cfg)
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    from serving.core.config import EngineConfig
    from serving.core.engine import Engine
    from serving.core.sampling_params import SamplingParams
    from tests.support.hf_models import random_prompt
    host_kv = bool(os.environ.get("MULTIHOST_HOST_KV"))  # a 16-page device pool over a host KV tier, more prompts
    engine = Engine(EngineConfig(model=model_dir, tp=8, page_size=8, num_pages=16 if host_kv else 64, max_num_seqs=8,
                                 max_num_batched_tokens=64, min_token_bucket=64, enable_prefix_caching=host_kv,
                                 host_kv_cache_gb=0.001 if host_kv else 0.0))
    if not cfg.is_leader:
        go = os.environ.get("MULTIHOST_FOLLOWER_GO_FILE")
        while go and not os.path.exists(go):
            time.sleep(0.05)
        engine.follow(cfg.follower_channel())
        shutdown()
        return

    def lost(follower, err):
        print(f"LEADER: follower {follower} lost: {err}; failing requests", flush=True)
        with open(out, "w") as f:
            json.dump({"error": "UNAVAILABLE", "detail": str(err)}, f)
        os._exit(3)

    engine.runner.channel = cfg.leader_channel(on_follower_lost=lost)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens = {}

    def run(requests):
        for rid, p in requests:
            engine.add_request(engine.make_request(rid, p, params))
        while engine.has_unfinished():
            for o in engine.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                print(f"LEADER: step {engine.step_count}", flush=True)

    prompts = [random_prompt(n, 160, seed=n) for n in (5, 17, 40, 3)]
    run([(f"r{i}", p) for i, p in enumerate(prompts)])
    if host_kv:  # then 4 prefixes of 5 pages cycled twice, one at a time, through 16 device pages: host hits
        for p in host_kv_prompts():
            prompts.append(p)
            run([(f"r{len(prompts) - 1}", p)])
    engine.runner.channel.close()
    with open(out, "w") as f:
        host = engine.scheduler.block_manager.host
        json.dump({"tokens": [tokens[f"r{i}"] for i in range(len(prompts))], "prompts": prompts,
                   "devices": jax.device_count(), "processes": jax.process_count(),
                   "host_hits": host.hit_blocks if host is not None else 0}, f)
    shutdown()


def host_kv_prompts() -> list[list[int]]:
    from tests.support.hf_models import random_prompt
    prefixes = [random_prompt(40, 160, seed=300 + k) for k in range(4)]
    return [p + [r, k] for r in range(2) for k, p in enumerate(prefixes)]


if __name__ == "__main__":
    main()
