"""The instance server end to end: a real `python -m serving.server` process on 127.0.0.1 with a small Llama,
driven through the client library: streams equal the offline engine, every bad input gets its status code naming
the field, 200 concurrent streams with client cancels leak no page, metrics parse and count what was sent."""
import asyncio
import os
import random
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.wire.client import AsyncClient, Client, ClientError
from models.synthetic import shared_small_llama
from serving.process import REPO_ROOT, ServerProcess
from tests.support.server import wait_idle

pytestmark = pytest.mark.e2e

ENGINE_OPTIONS = dict(page_size=8, num_pages=512, max_num_seqs=32, max_num_batched_tokens=32, min_token_bucket=32)


@pytest.fixture(scope="module")
def model_dir():
    return shared_small_llama()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    proc = ServerProcess(model_dir, str(tmp_path_factory.mktemp("server_run")), "--max_waiting_requests=512",
                         "--max_request_bytes=65536")
    try:
        yield proc.wait_ready()
    finally:
        rc = proc.terminate()
        assert rc == 0, f"the server exited with {rc}:\n{proc.log()[-4000:]}"


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target, timeout=60) as c:
        yield c


def scrape(server) -> dict:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def test_health_model_info_tokenize(client, model_dir):
    assert client.health() == "SERVING" and client.health("meshserve.v1.Inference") == "SERVING"
    info = client.model_info()
    assert info.vocab_size == 512 and info.max_model_len == 512 and info.architecture == "llama"
    assert list(info.token_buckets) == [32]
    assert info.compile_count >= len(info.token_buckets) and info.compile_time_s > 0  # warmed up before SERVING
    from models.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(model_dir)
    assert client.tokenize("Hello, world!") == tok.encode("Hello, world!")
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert client.tokenize(messages=chat) == tok.encode_chat(chat, add_generation_prompt=True)


def test_streaming_matches_offline_engine(client, model_dir):
    from serving.core.llm import LLM
    from serving.core.sampling_params import SamplingParams
    llm = LLM(model_dir, warmup=False, **ENGINE_OPTIONS)
    tok = llm.tokenizer
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, how are you today?"}]
    cases = [  # (client prompt kwargs, offline prompt, sampling)
        (dict(prompt="The quick brown fox"), "The quick brown fox", dict(temperature=0.0, max_tokens=20)),
        (dict(prompt=[0, 17, 99, 301, 5, 44]), [0, 17, 99, 301, 5, 44],
         dict(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)),
        (dict(messages=chat), tok.encode_chat(chat, add_generation_prompt=True),
         dict(temperature=1.0, top_k=20, seed=11, max_tokens=12, repetition_penalty=1.2)),
        (dict(prompt="Serving large language models"), "Serving large language models",
         dict(temperature=0.0, max_tokens=8, logprobs=3)),
    ]
    expected = llm.generate([c[1] for c in cases], [SamplingParams(**c[2]) for c in cases])
    for (kw, _, sampling), exp in zip(cases, expected):
        pieces, ids, responses = [], [], list(client.generate(**kw, **sampling))
        for r in responses:
            pieces.append(r.text)
            ids.extend(r.token_ids)
        assert ids == exp.token_ids and "".join(pieces) == exp.text
        last = responses[-1]
        assert last.usage.completion_tokens == len(exp.token_ids)
        assert last.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert last.finish_reason != 0 and all(r.finish_reason == 0 for r in responses[:-1])
        if sampling.get("logprobs"):
            lps = [lp for r in responses for lp in r.logprobs]
            assert [lp.token_id for lp in lps] == exp.token_ids
            assert [len(lp.top) for lp in lps] == [3] * len(exp.token_ids)
            assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(lps, exp.logprobs))
    # A stop string ends the stream with the right reason and text.
    full = client.complete("The quick brown fox", temperature=0.0, max_tokens=20)
    stop = full.text[3:6]
    if stop.strip():
        got = client.complete("The quick brown fox", temperature=0.0, max_tokens=20, stop=[stop])
        assert got.finish_reason == "stop" and got.stop_reason == stop and got.text == full.text[:full.text.find(stop)]


BAD_INPUTS = [  # (kwargs, field named in the message)
    (dict(prompt=""), "text"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=[3, 512]), "token_ids"),
    (dict(prompt=[3, -1]), "token_ids"),
    (dict(prompt=[5] * 500, max_tokens=20), "max_tokens"),
    (dict(prompt=[5] * 512), "token_ids"),
    (dict(prompt="hi", temperature=-0.5), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top_p"),
    (dict(prompt="hi", top_k=-3), "top_k"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", min_p=1.5), "min_p"),
    (dict(prompt="hi", presence_penalty=3.0), "presence_penalty"),
    (dict(prompt="hi", repetition_penalty=0.0), "repetition_penalty"),
    (dict(prompt="hi", logprobs=50), "logprobs"),
    (dict(prompt="hi", stop_token_ids=[100000]), "stop_token_ids"),
    (dict(prompt="hi", max_tokens=4, min_tokens=8), "min_tokens"),
    (dict(prompt="x" * 70000), "text"),
    (dict(prompt=[5] * 20000), "token_ids"),
    (dict(messages=[{"role": "robot", "content": "beep"}]), "role"),
    (dict(messages=[]), "chat.messages"),
    (dict(prompt="hi", priority=7), "priority"),
    (dict(prompt="hi", n=0), "sampling.n"),
    (dict(prompt="hi", n=17), "sampling.n"),
    (dict(prompt="hi", logit_bias={5: 150.0}), "sampling.logit_bias[5]"),
    (dict(prompt="hi", logit_bias={512: 1.0}), "sampling.logit_bias: token id 512"),
    (dict(prompt="hi", logit_bias={t: 1.0 for t in range(301)}), "sampling.logit_bias"),
]


@pytest.mark.parametrize("kwargs, field", BAD_INPUTS, ids=[f"{i}-{f}" for i, (_, f) in enumerate(BAD_INPUTS)])
def test_bad_input_is_invalid_argument_naming_the_field(client, kwargs, field):
    with pytest.raises(ClientError) as e:
        client.complete(**kwargs)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert field in e.value.details, e.value.details
    # ... and the server keeps serving.
    assert client.complete([7, 8, 9], max_tokens=2, temperature=0).completion_tokens == 2


def test_n_samples_stream_with_their_index(server, client, model_dir):
    """n=2 streams both samples, told apart by index, each ending with its own finish_reason and usage; they are the
    offline engine's samples for the same seed; the async client joins them too."""
    from serving.core.llm import LLM
    from serving.core.sampling_params import SamplingParams
    prompt = [0, 17, 99, 301, 5, 44, 12, 9, 250]
    sampling = dict(temperature=1.0, seed=21, max_tokens=10, ignore_eos=True)
    responses = list(client.generate(prompt, n=2, **sampling))
    by_index = {0: [], 1: []}
    for r in responses:
        by_index[r.index].append(r)
    assert all(by_index.values()) and responses[0].usage.prompt_tokens == len(prompt)
    expected = LLM(model_dir, warmup=False, **ENGINE_OPTIONS).generate([prompt], SamplingParams(n=2, **sampling))[0]
    for i, rs in by_index.items():
        assert [t for r in rs for t in r.token_ids] == expected.outputs[i].token_ids
        assert [r.finish_reason for r in rs][-1] == 2 and all(r.finish_reason == 0 for r in rs[:-1])  # LENGTH
        assert rs[-1].usage.completion_tokens == 10
    assert expected.outputs[0].token_ids != expected.outputs[1].token_ids
    joined = client.complete(prompt, n=2, **sampling)
    assert [o.index for o in joined.outputs] == [0, 1] and joined.token_ids == expected.outputs[0].token_ids
    assert [o.token_ids for o in joined.outputs] == [o.token_ids for o in expected.outputs]

    async def main():
        async with AsyncClient(server.target, timeout=60) as c:
            return await c.complete(prompt, n=2, **sampling)
    assert [o.token_ids for o in asyncio.run(main()).outputs] == [o.token_ids for o in expected.outputs]
    # A client cancel ends every sample; no page is left behind.
    stream = client.generate(prompt, n=3, temperature=1.0, max_tokens=400, ignore_eos=True)
    next(stream)
    stream.close()
    load = wait_idle(client)
    assert load.invariant_error == "" and load.kv_pages_free == load.kv_pages_total


def test_logit_bias_forces_a_token(client):
    for sampling in (dict(temperature=0.0), dict(temperature=1.0, top_p=0.9, seed=4)):
        out = client.complete([3, 4, 5, 6], max_tokens=5, logit_bias={42: 100.0}, **sampling)
        assert out.token_ids == [42] * 5
    free = client.complete([3, 4, 5, 6], max_tokens=5, temperature=0.0)
    banned = client.complete([3, 4, 5, 6], max_tokens=5, temperature=0.0, logit_bias={free.token_ids[0]: -100.0})
    assert banned.token_ids[0] != free.token_ids[0]


def test_concurrent_streams_with_client_cancels_leak_no_pages(server, client):
    rng = random.Random(0)
    plans = [(rng.randint(1, 40), rng.randint(4, 24), rng.random() < 0.4, rng.randint(1, 6)) for _ in range(200)]

    async def one(c: AsyncClient, i, plan):
        prompt_len, max_tokens, cancel, cancel_after = plan
        prompt = [rng.randint(3, 511) for _ in range(prompt_len)]
        got = 0
        stream = c.generate(prompt, max_tokens=max_tokens, temperature=0.0 if i % 2 else 1.0, seed=i,
                            ignore_eos=True, request_id=f"stream-{i}")
        async for r in stream:
            got += len(r.token_ids)
            if cancel and got >= cancel_after:
                await stream.aclose()  # the client goes away mid-stream
                return "cancelled"
            if r.finish_reason:
                assert got == max_tokens
                return "done"
        return "cancelled" if cancel else "short"

    async def main():
        async with AsyncClient(server.target, timeout=600) as c:
            return await asyncio.gather(*[one(c, i, p) for i, p in enumerate(plans)])

    results = asyncio.run(main())
    assert "short" not in results and results.count("cancelled") > 20
    load = wait_idle(client)
    assert load.invariant_error == ""
    assert load.num_running == 0 and load.num_waiting == 0
    assert load.kv_pages_free == load.kv_pages_total, "KV pages leaked"


def test_metrics_parse_and_counters_match(server, client, model_dir):
    before = scrape(server)
    prompts = [[3 + i] * (5 + i) for i in range(6)]
    outs = [client.complete(p, max_tokens=3 + i, temperature=0.0, ignore_eos=True) for i, p in enumerate(prompts)]
    with pytest.raises(ClientError):
        client.complete("hi", temperature=-1.0)
    stream = client.generate([4] * 9, max_tokens=400, ignore_eos=True)
    next(stream)
    stream.close()  # a client cancel counts as finished_reason="abort"
    deadline = time.monotonic() + 60
    while True:
        after = scrape(server)
        key = ("meshserve:request_success_total", (("finished_reason", "abort"),))
        # The abort is counted when the stream ends; the engine thread frees the request between steps.
        idle = all(after.get((g, ()), 1.0) == 0.0 for g in ("meshserve:num_requests_running",
                                                             "meshserve:kv_cache_usage_perc"))
        if after.get(key, 0) - before.get(key, 0) >= 1 and idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("meshserve:request_success_total", finished_reason="length") == 6
    assert delta("meshserve:request_success_total", finished_reason="abort") == 1
    assert delta("meshserve:prompt_tokens_total") == sum(len(p) for p in prompts) + 9
    assert delta("meshserve:generation_tokens_total") >= sum(o.completion_tokens for o in outs) == sum(
        3 + i for i in range(6))  # plus what the cancelled stream had generated
    assert delta("meshserve:request_errors_total", code="INVALID_ARGUMENT") == 1
    assert delta("meshserve:time_to_first_token_seconds_count") == 7
    assert delta("meshserve:e2e_request_latency_seconds_count") == 7
    assert delta("meshserve:request_queue_time_seconds_count") == 7
    assert delta("meshserve:prefix_cache_queries_total") >= sum(len(p) for p in prompts)
    assert delta("meshserve:step_time_seconds_count", device="cpu:0") > 0
    for name in ("meshserve:num_requests_waiting", "meshserve:num_requests_running",
                 "meshserve:kv_cache_usage_perc"):
        assert after[(name, ())] == 0.0
    # What the GIE / llm-d endpoint picker reads (docs/routers.md): gauges, and the KV geometry in vLLM's labels.
    families = {f.name: f for f in text_string_to_metric_families(
        urllib.request.urlopen(server.metrics_url, timeout=10).read().decode())}
    for name in ("meshserve:num_requests_waiting", "meshserve:num_requests_running", "meshserve:kv_cache_usage_perc",
                 "meshserve:cache_config_info"):
        assert families[name].type == "gauge", name
    info = client.model_info()
    (cache_config,) = families["meshserve:cache_config_info"].samples
    assert cache_config.value == 1.0
    assert cache_config.labels == {"model_name": os.path.basename(os.path.normpath(model_dir)),
                                   "block_size": str(info.page_size), "num_gpu_blocks": str(info.num_pages),
                                   "cache_dtype": info.kv_cache_dtype}
    assert (info.page_size, info.num_pages) == (8, 512)  # serving.process.SMALL_ENGINE_FLAGS
    assert (info.quantization, info.kv_cache_dtype) == ("none", "float32")
    (model_config,) = families["meshserve:model_config_info"].samples
    assert model_config.labels == {"model_name": cache_config.labels["model_name"], "dtype": "float32",
                                   "quantization": "none"}
    assert after[("meshserve:compile_count", ())] == client.model_info().compile_count > 0
    for name in ("meshserve:num_preemptions_total", "meshserve:prefix_cache_hits_total",
                 "meshserve:request_prefill_time_seconds_count", "meshserve:request_decode_time_seconds_count"):
        assert any(k[0] == name for k in after), name


def test_load_report_watch_and_drain(server, client):
    stream = client.watch_load(interval_ms=20)
    reports = [next(stream) for _ in range(3)]
    stream.close()
    assert all(r.serving and not r.draining and r.kv_pages_total == 512 for r in reports)
    assert reports[-1].timestamp > reports[0].timestamp
    client.complete([5, 6, 7], max_tokens=4)
    load = client.get_load()
    assert load.steps > 0 and load.step_time_p99_s >= load.step_time_p50_s > 0 and len(load.device_step_times) == 1
    assert client.drain().draining
    try:
        assert client.get_load().draining and client.health() == "NOT_SERVING"
        with pytest.raises(ClientError) as e:
            client.complete([5, 6, 7], max_tokens=2)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details
    finally:
        assert not client.drain(resume=True).draining
    assert client.health() == "SERVING" and client.complete([5, 6, 7], max_tokens=2).completion_tokens == 2


def test_duplicate_request_id_and_async_client(server):
    async def main():
        async with AsyncClient(server.target, timeout=60) as c:
            first = c.generate([9, 10, 11], request_id="same", max_tokens=50, ignore_eos=True)
            await first.__anext__()
            with pytest.raises(ClientError) as e:
                await c.complete([9, 10], request_id="same", max_tokens=2)
            assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
            await first.aclose()
            info = await c.model_info()
            assert await c.health() == "SERVING" and info.vocab_size == 512
            return await c.complete("Hello", max_tokens=5, temperature=0.0)

    out = asyncio.run(main())
    assert out.completion_tokens == 5 and out.finish_reason == "length"


def test_cli_streams_a_completion(server, client):
    expected = client.complete("Hello, world!", max_tokens=10, temperature=0.0)
    run = subprocess.run([sys.executable, "-m", "serving.client", f"--target={server.target}", "--max_tokens=10",
                          "--temperature=0", "Hello, world!"], cwd=REPO_ROOT, capture_output=True, timeout=60)
    assert run.returncode == 0, run.stderr.decode()
    assert run.stdout.decode().rstrip("\n") == expected.text
    assert "finish_reason=length" in run.stderr.decode()
