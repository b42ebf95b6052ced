"""The serving benchmark (serving/bench/serve.py, serve_backends.py): its datasets, arrivals, metrics, SSE decoding
and HTTP backend (against a canned aiohttp server) on their own, then `python -m serving.bench serve` against a real
small server (gRPC and the OpenAI-compatible HTTP API, prefix caching off): every request completes with the
requested output length, percentiles are ordered, the JSON result and the PNG plot are written, the three backends
run side by side, and n=2 computes less prefill than two separate requests by exactly the prompt pages its samples
share."""
import asyncio
import json
import math
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from serving.bench import serve
from models.synthetic import shared_small_llama
from serving.process import REPO_ROOT, ServerProcess


def test_random_requests_lengths_and_shared_prefix():
    reqs = serve.random_requests(200, input_len=40, output_len=10, range_ratio=0.5, prefix_len=7, vocab_size=100,
                                 seed=3, excluded_ids=[1, 2])
    in_lens = [r.prompt_len - 7 for r in reqs]
    out_lens = [r.output_len for r in reqs]
    assert min(in_lens) >= 20 and max(in_lens) <= 60 and len(set(in_lens)) > 10
    assert min(out_lens) >= 5 and max(out_lens) <= 15
    assert all(r.prompt[:7] == reqs[0].prompt[:7] and len(r.prompt) == r.prompt_len for r in reqs)
    assert not {1, 2} & {t for r in reqs for t in r.prompt} and max(t for r in reqs for t in r.prompt) < 100
    same = serve.random_requests(200, 40, 10, 0.5, 7, 100, seed=3, excluded_ids=[1, 2])
    assert [r.prompt for r in same] == [r.prompt for r in reqs]  # the seed fixes the dataset
    fixed = serve.random_requests(5, 16, 4, 0.0, 0, 100)
    assert [r.prompt_len for r in fixed] == [16] * 5 and [r.output_len for r in fixed] == [4] * 5
    with pytest.raises(ValueError, match="random_range_ratio"):
        serve.random_requests(1, 16, 4, 1.0, 0, 100)


def test_multiturn_requests_grow_each_conversation():
    """Turn-major chats: each turn's prompt is its conversation's previous prompt plus a reply's and a user turn's
    tokens, sent after that previous turn (`after`); excluded ids never appear."""
    reqs = serve.multiturn_requests(7, conversations=3, history_len=10, turn_len=2, output_len=3, vocab_size=50,
                                    seed=1, excluded_ids=[0])
    assert [r.after for r in reqs] == [-1, -1, -1, 0, 1, 2, 3]
    for i, r in enumerate(reqs):
        assert r.prompt_len == len(r.prompt) == 10 + 5 * (i // 3) and r.output_len == 3 and 0 not in r.prompt
        if r.after >= 0:
            prev = reqs[r.after].prompt
            assert r.prompt[:len(prev)] == prev
    assert reqs[0].prompt[:10] != reqs[1].prompt[:10]
    with pytest.raises(ValueError, match="multiturn"):
        serve.multiturn_requests(2, 0, 10, 2, 3, 50)


def test_arrivals_poisson_gamma_and_all_at_once():
    assert not serve.arrival_offsets(10, math.inf, 1.0).any()
    for burstiness in (1.0, 0.25, 4.0):
        t = serve.arrival_offsets(4000, 10.0, burstiness, seed=1)
        gaps = np.diff(t)
        assert t[0] == 0 and (gaps >= 0).all()
        assert abs(gaps.mean() - 0.1) < 0.02  # mean rate 10/s whatever the shape
        assert abs(gaps.std() / gaps.mean() - 1 / math.sqrt(burstiness)) < 0.15  # gamma: CV = 1/sqrt(shape)


def test_metrics_follow_vllm():
    def out(ttft, latency, n, itl=()):
        return serve.RequestOutput(10, n, success=True, output_len=n, ttft_s=ttft, latency_s=latency,
                                   itl_s=list(itl), chunk_times_s=[ttft], chunk_tokens=[n])
    outputs = [out(0.1, 1.1, 11, [0.1] * 10), out(0.3, 0.3, 1), out(0.2, 2.2, 5, [0.5] * 4),
               serve.RequestOutput(10, 4, error="UNAVAILABLE: draining")]
    m = serve.compute_metrics(outputs, duration=4.0, goodput=serve.parse_goodput("ttft:300 tpot:200"))
    assert m["completed"] == 3 and m["failed"] == 1 and m["total_output_tokens"] == 17
    assert m["total_input_tokens"] == 30 and m["request_throughput"] == 0.75
    assert m["mean_tpot_ms"] == pytest.approx((100 + 500) / 2)  # one-token requests have no TPOT
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["median_e2el_ms"] == pytest.approx(1100)
    assert m["mean_itl_ms"] == pytest.approx((10 * 100 + 4 * 500) / 14)
    assert m["request_goodput"] == pytest.approx(2 / 4.0)  # one token counts as TPOT 0; the third misses TPOT
    assert serve.compute_metrics(outputs, 4.0)["request_goodput"] is None
    with pytest.raises(ValueError, match="NAME one of"):
        serve.parse_goodput("latency:5")


def test_metrics_tpot_per_sample_with_n():
    two = serve.RequestOutput(10, 10, success=True, output_len=10, ttft_s=0.1, latency_s=1.0, num_samples=2,
                              chunk_times_s=[0.1], chunk_tokens=[10])
    assert serve.compute_metrics([two], 1.0)["mean_tpot_ms"] == pytest.approx(900 / 4)  # 5 tokens per sample


def test_parse_backends():
    assert serve.parse_backends("grpc, openai,openai-chat") == ["grpc", "openai", "openai-chat"]
    for bad in ("", "grpc,http", "openai,openai"):
        with pytest.raises(ValueError, match="--backend"):
            serve.parse_backends(bad)


SSE_STREAM = (b": keep-alive comment\r\n\r\n"
              b"data: {\"a\": 1}\n\n"
              b"event: message\r\nid: 7\r\ndata: line one\r\ndata:line two\r\n\r\n"
              b"data: caf\xc3\xa9\r\r"  # CR line ends; a two-byte character
              b"retry: 10\n\n"  # no data: no event
              b"data: [DONE]\n\n"
              b"data: cut off by the end")
SSE_EVENTS = ['{"a": 1}', "line one\nline two", "caf\u00e9", "[DONE]"]


def test_sse_decoder_any_split():
    assert serve.SSEDecoder().feed(SSE_STREAM) == SSE_EVENTS
    for cut in range(len(SSE_STREAM) + 1):  # every split point: inside CRLF, after a lone CR, inside a character
        d = serve.SSEDecoder()
        assert d.feed(SSE_STREAM[:cut]) + d.feed(SSE_STREAM[cut:]) == SSE_EVENTS, cut
    d = serve.SSEDecoder()
    assert [e for i in range(len(SSE_STREAM)) for e in d.feed(SSE_STREAM[i:i + 1])] == SSE_EVENTS


def _sse(*events) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


async def _canned_openai_server(routes):
    """An OpenAI-like HTTP server on 127.0.0.1 (aiohttp.web, on the running event loop): `routes` maps (method, path)
    to a handler; returns its runner and base URL."""
    from aiohttp import web
    app = web.Application()
    for (method, path), handler in routes.items():
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


async def _stream_sse(request, content: bytes, piece: int = 7):
    """`content` as a streamed text/event-stream in pieces of `piece` bytes (events cut anywhere)."""
    from aiohttp import web
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(0, len(content), piece):
        await resp.write(content[i:i + piece])
    await resp.write_eof()
    return resp


def test_openai_backend_stream_and_failed_requests():
    """Content chunks time the stream, usage gives the tokens; an HTTP error status, an error event in the stream or
    the request's deadline fails that request only. Chat: prepare() detokenizes, delta content makes the chunks."""
    from aiohttp import web
    bodies, release = [], asyncio.Event()

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "tiny"}]})

    async def completions(request):
        body = await request.json()
        bodies.append(body)
        if body["prompt"] == [3]:
            return web.json_response({"error": {"message": "prompt: too long", "param": "prompt"}}, status=400)
        if body["prompt"] == [4]:
            return await _stream_sse(request, _sse({"choices": [{"index": 0, "text": "a"}]},
                                                   {"error": {"message": "the engine failed"}}))
        if body["prompt"] == [7]:  # one chunk, then nothing until the test lets go
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
            await release.wait()
            return resp
        return await _stream_sse(request, _sse(
            {"choices": [{"index": 0, "text": ""}], "usage": None},  # no text: not a chunk
            {"choices": [{"index": 0, "text": "he"}], "usage": None},
            {"choices": [{"index": 0, "text": "llo", "finish_reason": "length"}], "usage": None},
            {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 5,
                                      "prompt_tokens_details": {"cached_tokens": 1}}}))

    async def detokenize(request):
        return web.json_response({"prompt": "text of " + str((await request.json())["tokens"])})

    async def chat_completions(request):
        body = await request.json()
        bodies.append(body)
        return await _stream_sse(request, _sse(
            {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},  # no content: not a chunk
            {"choices": [{"index": 0, "delta": {"content": "hi"}}]},
            {"choices": [{"index": 0, "delta": {"content": " there"}, "finish_reason": "length"}]},
            {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}))

    reqs = [serve.SampleRequest([1, 2], 2, 5), serve.SampleRequest([3], 1, 5), serve.SampleRequest([4], 1, 5),
            serve.SampleRequest([5, 6], 2, 5)]

    async def run():
        runner, url = await _canned_openai_server({
            ("GET", "/v1/models"): models, ("POST", "/v1/completions"): completions,
            ("POST", "/detokenize"): detokenize, ("POST", "/v1/chat/completions"): chat_completions})
        try:
            async with serve.OpenAIBackend(url, chat=False, max_connections=2) as b:
                outputs, _ = await serve.run_requests(b, reqs, progress=False)
            async with serve.OpenAIBackend(url, chat=False, timeout_s=0.3) as b:
                late = await b.send(serve.SampleRequest([7], 1, 5), time.perf_counter())
            release.set()
            chat_req = serve.SampleRequest([8, 9], 2, 2)
            async with serve.OpenAIBackend(url + "/", chat=True, model="served-name") as b:
                await b.prepare([chat_req, chat_req])
                chat = await b.send(chat_req, time.perf_counter())
            return outputs, late, chat_req, chat
        finally:
            release.set()
            await runner.cleanup()
    outputs, late, chat_req, chat = asyncio.run(run())
    ok, status, in_stream, ok2 = outputs
    assert ok.success and ok2.success and ok.output_len == 5 and ok.chunk_tokens == [1, 4] and len(ok.itl_s) == 1
    assert ok.prompt_len == 2 and ok.cached_tokens == 1 and 0 < ok.ttft_s <= ok.latency_s
    assert not status.success and status.error == "HTTP 400: prompt: too long"
    assert not in_stream.success and "the engine failed" in in_stream.error
    assert bodies[0] == {"model": "tiny", "stream": True, "stream_options": {"include_usage": True},
                         "temperature": 0.0, "ignore_eos": True, "prompt": [1, 2], "max_tokens": 5}
    m = serve.compute_metrics(outputs, 1.0)
    assert m["completed"] == 2 and m["failed"] == 2 and m["total_output_tokens"] == 10
    assert not late.success and late.error == "no answer within the request's deadline of 0.3 s"
    assert chat_req.prompt_text == "text of [8, 9]"
    assert bodies[-1]["model"] == "served-name" and bodies[-1]["messages"] == [{"role": "user",
                                                                               "content": "text of [8, 9]"}]
    assert chat.success and chat.output_len == 2 and chat.chunk_tokens == [1, 1] and chat.prompt_len == 9

    chat = serve.OpenAIBackend("http://test", chat=True, n=2, model="tiny")
    body = chat.body(serve.SampleRequest([1, 2], 2, 7, prompt_text="hi there"))
    assert body["messages"] == [{"role": "user", "content": "hi there"}] and body["max_completion_tokens"] == 7
    assert body["n"] == 2 and "max_tokens" not in body and "prompt" not in body
    with pytest.raises(ValueError, match="base_url"):
        serve.OpenAIBackend("127.0.0.1:8000", chat=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Prefix caching off: the backends' runs repeat the same prompts, and --compare_n's prefill is then exact.
    proc = ServerProcess(shared_small_llama(), str(tmp_path_factory.mktemp("bench_server")), "--http_port=0",
                         "--enable_prefix_caching=false")
    try:
        yield proc.wait_ready()
    finally:
        rc = proc.terminate()
        assert rc == 0, f"the server exited with {rc}:\n{proc.log()[-4000:]}"


def _check_result(r: dict, num_prompts: int) -> None:
    assert r["completed"] == num_prompts and r["failed"] == 0 and not any(r["errors"])
    assert r["output_lens"] == r["requested_output_lens"]
    assert r["total_output_tokens"] == sum(r["requested_output_lens"])
    assert r["total_input_tokens"] == sum(r["input_lens"])
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"])
    for key in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < r[f"median_{key}_ms"] <= r[f"p90_{key}_ms"] <= r[f"p99_{key}_ms"], key
    assert r["p99_ttft_ms"] <= r["p99_e2el_ms"]
    assert sum(len(itl) for itl in r["itls"]) <= r["total_output_tokens"] - num_prompts


@pytest.mark.e2e
def test_cli_random_dataset(server, tmp_path):
    result, plot = tmp_path / "result.json", tmp_path / "plot.png"
    cmd = [sys.executable, "-m", "serving.bench", "serve", f"--target={server.target}", "--num_prompts=8",
           "--random_input_len=24", "--random_output_len=8", "--random_range_ratio=0.5", "--random_prefix_len=8",
           "--request_rate=40", "--burstiness=0.5", "--max_concurrency=4", "--goodput=ttft:60000,tpot:60000",
           f"--result_json={result}", f"--plot={plot}"]
    p = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Serving Benchmark Result" in p.stdout and "P99 TPOT (ms):" in p.stdout
    assert "100%" in p.stderr  # the progress bar
    r = json.loads(result.read_text())
    _check_result(r, 8)
    assert r["request_rate"] == 40 and r["burstiness"] == 0.5 and r["max_concurrency"] == 4
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # SLOs of a minute: all good
    assert 1 <= r["max_concurrent_requests"] <= 4
    assert all(n >= 8 + 12 for n in r["input_lens"]) and set(r["requested_output_lens"]) <= set(range(4, 13))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.e2e
def test_cli_multiturn_dataset(server, tmp_path):
    """Two conversations of three turns (max concurrency 3, so only the dataset's order holds a turn back): each
    turn's prompt grows, and is sent once its conversation's previous turn has finished."""
    result = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "serving.bench", "serve", f"--target={server.target}", "--dataset=multiturn",
           "--num_prompts=6", "--multiturn_conversations=2", "--multiturn_history_len=20", "--multiturn_turn_len=4",
           "--random_output_len=4", "--max_concurrency=3", "--disable_tqdm", f"--result_json={result}"]
    p = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(result.read_text())
    _check_result(r, 6)
    assert r["input_lens"] == [20, 20, 28, 28, 36, 36]
    for i in range(2, 6):  # request i follows request i - 2 (its conversation's previous turn)
        assert r["start_times"][i] >= r["start_times"][i - 2] + r["e2els"][i - 2] - 1e-3, (i, r["start_times"])


@pytest.mark.e2e
def test_sharegpt_text_prompts(server, tmp_path):
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()
    rng = np.random.default_rng(0)
    data = [{"id": str(i), "conversations": [
        {"from": "human", "value": " ".join(rng.choice(words, 6 + 3 * i))},
        {"from": "gpt", "value": " ".join(rng.choice(words, 3 + i))}]} for i in range(6)]
    data.append({"id": "short", "conversations": [{"from": "human", "value": "hi"}]})  # one turn: skipped
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = serve.load_requests(server.target, "sharegpt", 8, dataset_path=str(path), seed=1)
    assert len(reqs) == 8 and all(isinstance(r.prompt, str) and r.output_len >= 4 for r in reqs)
    r = serve.benchmark(server.target, reqs, dataset="sharegpt", request_rate=math.inf, progress=False)
    _check_result(r, 8)
    assert r["request_rate"] == "inf"


def _base_url(server) -> str:
    return f"http://127.0.0.1:{server.info['http_port']}"


@pytest.mark.e2e
def test_cli_backends_side_by_side(server, tmp_path):
    result = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "serving.bench", "serve", f"--target={server.target}",
           f"--base_url={_base_url(server)}", "--backend=grpc,openai,openai-chat", "--rounds=2", "--num_prompts=6",
           "--random_input_len=20", "--random_output_len=6", "--max_concurrency=3", "--disable_tqdm",
           f"--result_json={result}"]
    p = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    table = p.stdout[p.stdout.index("Backends side by side"):]
    body = re.split(r"\n-+\n", table)[1]  # between the rules under the header and under the rows
    rows = {cells[0]: cells for cells in map(str.split, body.splitlines()) if cells and cells[0] in serve.BACKENDS}
    assert list(rows) == ["grpc", "openai", "openai-chat"] and rows["grpc"][4] == "1.000x"
    assert [cells[1] for cells in rows.values()] == ["12/0"] * 3, table  # 6 requests x 2 rounds, none failed
    r = json.loads(result.read_text())
    assert r["backends"] == ["grpc", "openai", "openai-chat"] and r["rounds"] == 2 and r["reference_backend"] == "grpc"
    for name in serve.BACKENDS:
        assert [run["backend"] for run in r["runs"][name]] == [serve.BACKEND_LABELS[name]] * 2
        for run in r["runs"][name]:
            _check_result(run, 6)
            assert run["output_lens"] == [6] * 6 and run["cached_prompt_tokens"] == 0
        s = r["summary"][name]
        assert s["completed"] == 12 and s["total_output_tokens"] == 72 and len(s["output_throughput_by_round"]) == 2
        assert s["relative_output_throughput"] == pytest.approx(s["output_throughput"]
                                                                / r["summary"]["grpc"]["output_throughput"])
    grpc, oai = r["runs"]["grpc"], r["runs"]["openai"]
    assert [run["output_lens"] for run in grpc] == [run["output_lens"] for run in oai]
    assert [run["input_lens"] for run in grpc] == [run["input_lens"] for run in oai] == [[20] * 6] * 2  # same ids
    assert all(n > 20 for n in r["runs"]["openai-chat"][0]["input_lens"])  # text in the chat template


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_cli_compare_n_prefill(server, tmp_path, backend):
    """n=2 shares each prompt's full KV pages between its samples: the second sample computes only the page holding
    the last prompt token, while two separate requests compute the whole prompt twice (prefix caching is off)."""
    prompt_len, result = 21, tmp_path / "result.json"
    cmd = [sys.executable, "-m", "serving.bench", "serve", f"--target={server.target}",
           f"--base_url={_base_url(server)}", f"--backend={backend}", "--compare_n=2",
           f"--metrics_url={server.metrics_url}", "--num_prompts=6", f"--random_input_len={prompt_len}",
           "--random_output_len=4", "--max_concurrency=3", "--disable_tqdm", f"--result_json={result}"]
    p = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "n=2 vs 2 separate requests" in p.stdout and "Prompt tokens computed (prefill)" in p.stdout
    r = json.loads(result.read_text())
    with_n, separate = r["runs"]["n"], r["runs"]["separate"]
    assert (with_n["completed"], with_n["samples"], separate["completed"], separate["samples"]) == (6, 12, 12, 12)
    assert with_n["output_tokens"] == separate["output_tokens"] == 12 * 4
    assert with_n["prompt_tokens_sent"] == 6 * prompt_len and separate["prompt_tokens_sent"] == 12 * prompt_len
    a, b = with_n["server"], separate["server"]
    assert a["prefix_cache_hits"] == b["prefix_cache_hits"] == 0 and a["num_preemptions"] == b["num_preemptions"] == 0
    assert a["prompt_tokens"] == 6 * prompt_len and b["prompt_tokens"] == 12 * prompt_len  # counted once per request
    last_page = prompt_len - (prompt_len - 1) // r["page_size"] * r["page_size"]  # 1..page_size tokens
    assert b["prefill_tokens_computed"] == 2 * 6 * prompt_len
    assert a["prefill_tokens_computed"] == 6 * (prompt_len + last_page) < b["prefill_tokens_computed"]


def test_requests_in_flight_is_a_time_weighted_count_and_the_peak_is_instantaneous():
    def done(start, latency):
        return serve.RequestOutput(prompt_len=4, requested_output_len=1, success=True, output_len=1, start_s=start,
                                   latency_s=latency, chunk_times_s=[start + latency], chunk_tokens=[1])
    # Five back-to-back requests in one 1 s bin, one at a time, then two overlapping ones.
    outputs = [done(0.2 * k, 0.2) for k in range(5)] + [done(1.0, 1.0), done(1.5, 0.5)]
    t = serve.throughput_over_time(outputs, 2.0, bin_s=1.0)
    assert t["max_in_flight"] == 2  # not 5: they never overlapped
    assert t["requests_in_flight"] == [1.0, 1.5]
    assert t["output_tokens_per_s"] == [4.0, 3.0]
