"""The serving benchmark (serving/bench/serve.py): its datasets, arrivals and metrics on their own, then
`python -m serving.bench serve` against a real small server: every request completes with the requested output
length, percentiles are ordered, and the JSON result and the PNG plot are written."""
import json
import math
import subprocess
import sys

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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(shared_small_llama(), str(tmp_path_factory.mktemp("bench_server")))
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
