"""Prefill/decode disaggregation end to end: a real gateway in front of a --role=prefill and a --role=decode instance
(the shipped tiny model, API keys on both), driven over gRPC and through the real `openai` package: the greedy
output equals a single instance's token for token, both instances hold no page once idle, a second request with the
same prefix hits the decode instance's prefix cache, and the transfer RPC refuses callers without the instance key.
Long prompts (several prefill chunks) stream their pages while the prefill runs; the last test kills the prefill
instance mid-stream."""
from __future__ import annotations

import concurrent.futures
import time
import urllib.request

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.wire import meshserve_pb2 as pb
from serving.wire import meshserve_pb2_grpc as pb_grpc
from serving.wire.client import Client, ClientError
from tests.support.gateway import GatewayProcess, InstanceProcess, wait_for
from tests.support.tiny import model_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

INSTANCE_KEY = "instance-key-0123456789"
TENANT_KEY = "tenant-key-0123456789"
ADMIN_KEY = "admin-key-0123456789"
MODEL = "tiny"
HOLD_S = 4.0  # the prefill instance's --kv_transfer_timeout_s
PROMPT = "The quick brown fox jumps over the lazy dog and then it runs far away into the"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd")
    key_file = root / "instance.keys"
    key_file.write_text(INSTANCE_KEY + "\n")
    common = ("--http_port=-1", f"--served_model_name={MODEL}", f"--api_key_file={key_file}",
              f"--kv_transfer_timeout_s={HOLD_S}")
    procs = []
    try:
        procs.append(InstanceProcess(model_dir("target"), str(root / "p"), "--role=prefill", *common))
        procs[0].wait_ready()  # the second loads its programs from the compilation cache the first filled
        procs.append(InstanceProcess(model_dir("target"), str(root / "d"), "--role=decode",
                                     f"--kv_peer_key_file={key_file}", *common))
        procs[1].wait_ready()
        config = {"pools": [{"name": "prefill", "instances": [{"name": "p0", "target": procs[0].target}]},
                            {"name": "decode", "instances": [{"name": "d0", "target": procs[1].target}]}],
                  "disaggregation": {"prefill_pools": ["prefill"], "decode_pools": ["decode"]},
                  "isolation": {"enabled": False}, "instance_key_file": str(key_file),
                  "tenants": [{"name": "acme", "api_keys": [TENANT_KEY]}], "admin_keys": [ADMIN_KEY]}
        gw = GatewayProcess(str(root / "gw"), config, "--http_port=0")
        try:
            wait_for(lambda: all(i.report_age_s >= 0 for i in gw.instances(ADMIN_KEY).values()), 30,
                     what="load reports")
            yield procs[0], procs[1], gw
        finally:
            gw.stop()
    finally:
        for p in procs:
            p.terminate()


def _instance(proc) -> Client:
    return Client(proc.target, timeout=60)


MD = [("authorization", f"Bearer {INSTANCE_KEY}")]


def _load(proc) -> pb.LoadReport:
    with _instance(proc) as c:
        return c.stub.GetLoad(pb.GetLoadRequest(), timeout=10, metadata=MD)


def _idle(proc, timeout: float = 10.0) -> pb.LoadReport:
    """The load report once every page is free (or only cached), nothing running."""
    def idle():
        load = _load(proc)
        return load if load.num_running == 0 and load.kv_pages_free == load.kv_pages_total else None
    try:
        return wait_for(idle, timeout, interval=0.05, what="idle")
    except TimeoutError:
        return _load(proc)


def test_greedy_output_matches_a_single_instance_over_grpc_and_http(fleet):
    prefill, decode, gw = fleet
    with _instance(prefill) as c:  # the prefill instance serves plain requests like any instance: the reference
        ref = c.complete(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True, metadata=MD)
    assert len(ref.token_ids) == 12
    assert _load(decode).prefix_cache_hits == 0  # the decode instance never saw the prompt
    with Client(gw.target, timeout=60) as c:
        out = c.complete(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True,
                         metadata=[("authorization", f"Bearer {TENANT_KEY}")])
    assert out.token_ids == ref.token_ids and out.text == ref.text
    assert (out.prompt_tokens, out.completion_tokens, out.finish_reason) == (ref.prompt_tokens, 12, "length")
    # its prompt's full pages came from the prefill instance: the decode instance's prefix cache had them
    assert out.cached_prompt_tokens == ref.prompt_tokens // 8 * 8 > 0
    assert _load(decode).prefix_cache_hits == out.cached_prompt_tokens

    http = openai.OpenAI(base_url=f"http://127.0.0.1:{gw.info['http_port']}/v1", api_key=TENANT_KEY, max_retries=0)
    r = http.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.0,
                                extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref.text and r.usage.completion_tokens == 12
    chunks = http.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.0, stream=True,
                                     extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text

    metrics = urllib.request.urlopen(f"http://127.0.0.1:{gw.info['metrics_port']}/metrics", timeout=10).read()
    split = {s.labels["outcome"]: s.value for f in text_string_to_metric_families(metrics.decode())
             for s in f.samples if s.name == "meshserve:gateway_disaggregated_requests_total"}
    assert split.get("prefill_decode") == 3 and not split.get("decode_failed")  # all three went through both stages
    for proc in (prefill, decode):  # every transfer released, every request's pages back
        load = _idle(proc)
        assert load.kv_pages_free == load.kv_pages_total and load.num_running == 0, proc.target


def test_seeded_sampling_with_penalties_matches_a_single_instance(fleet):
    """The first token counts as output on the decode side: the seeded draw (by output index), the penalties and
    max_tokens go on as in one instance."""
    prefill, _, gw = fleet
    kw = dict(max_tokens=10, temperature=0.9, seed=11, presence_penalty=0.8, ignore_eos=True)
    with _instance(prefill) as c:
        ref = c.complete(PROMPT + " seeded", metadata=MD, **kw)
    with Client(gw.target, timeout=60) as c:
        out = c.complete(PROMPT + " seeded", metadata=[("authorization", f"Bearer {TENANT_KEY}")], **kw)
    assert out.token_ids == ref.token_ids and out.text == ref.text and len(out.token_ids) == 10


def test_same_prefix_hits_the_decode_instances_prefix_cache(fleet):
    _, decode, gw = fleet
    prompt = PROMPT + " old barn where the farmer keeps his tools and"
    with Client(gw.target, timeout=60) as c:
        md = [("authorization", f"Bearer {TENANT_KEY}")]
        first = c.complete(prompt, max_tokens=4, temperature=0.0, ignore_eos=True, metadata=md)
        before = _load(decode).prefix_cache_hits
        second = c.complete(prompt, max_tokens=4, temperature=0.0, ignore_eos=True, metadata=md)
    assert second.token_ids == first.token_ids
    after = _load(decode).prefix_cache_hits
    # the pages pulled again were already cached there: the decode instance's prompt (+ first token) hit them
    assert after - before == second.cached_prompt_tokens == second.prompt_tokens // 8 * 8 > 0


def test_transfer_rpcs_need_the_instance_key_and_a_prefill_role(fleet):
    prefill, decode, _ = fleet
    with grpc.insecure_channel(prefill.target) as ch:
        stub = pb_grpc.InferenceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.PullKV(pb.PullKVRequest(transfer_id="x"), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            list(stub.PullKV(pb.PullKVRequest(transfer_id="0" * 32), timeout=10, metadata=MD))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "0" * 32 in e.value.details()
        info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=10, metadata=MD)
        assert (info.role, info.kv_transport) == ("prefill", "grpc")
    with grpc.insecure_channel(decode.target) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.InferenceStub(ch).PullKV(pb.PullKVRequest(transfer_id="x"), timeout=10, metadata=MD))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "role is decode" in e.value.details()


def test_clients_cannot_set_the_transfer_fields(fleet):
    _, _, gw = fleet
    req = pb.GenerateRequest(text=PROMPT, kv_source=pb.KVSource(address="evil.example:1", transfer_id="t",
                                                                prompt_token_ids=[1]))
    with grpc.insecure_channel(gw.target) as ch, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.InferenceStub(ch).Generate(req, timeout=10, metadata=[("authorization", f"Bearer {TENANT_KEY}")]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kv_source" in e.value.details()


def test_unpulled_pages_are_released_after_the_timeout_and_a_failed_pull_is_an_explicit_error(fleet):
    prefill, decode, _ = fleet
    with grpc.insecure_channel(prefill.target) as ch:
        req = pb.GenerateRequest(text=PROMPT + " unpulled", kv_export=True,
                                 sampling=pb.SamplingParameters(max_tokens=8, temperature=0.0))
        out = list(pb_grpc.InferenceStub(ch).Generate(req, timeout=30, metadata=MD))
    handoff = out[-1].kv_transfer
    assert out[-1].finish_reason == pb.FINISH_REASON_UNSPECIFIED and len(out[-1].token_ids) == 1
    assert handoff.num_pages == len(handoff.prompt_token_ids) // 8 > 0 and handoff.transport == "grpc"
    held = _load(prefill)
    assert held.kv_pages_total - held.kv_pages_free == handoff.num_pages  # held (not evictable) until pulled
    # nobody pulls it (a decode instance that died): released after the timeout, and no longer pullable
    load = _idle(prefill, timeout=HOLD_S + 5)
    assert load.kv_pages_free == load.kv_pages_total
    src = pb.KVSource(address=prefill.target, transfer_id=handoff.transfer_id,
                      prompt_token_ids=handoff.prompt_token_ids, first_token_id=out[-1].token_ids[0])
    with Client(decode.target, timeout=30) as c:
        with pytest.raises(grpc.RpcError) as e:
            list(c.stub.Generate(pb.GenerateRequest(kv_source=src, sampling=pb.SamplingParameters(max_tokens=8)),
                                 timeout=30, metadata=MD))
        assert e.value.code() == grpc.StatusCode.ABORTED and handoff.transfer_id in e.value.details()
        src.address = "127.0.0.1:1"  # a prefill instance that is gone
        with pytest.raises(grpc.RpcError) as e:
            list(c.stub.Generate(pb.GenerateRequest(kv_source=src, sampling=pb.SamplingParameters(max_tokens=8)),
                                 timeout=30, metadata=MD))
        assert e.value.code() == grpc.StatusCode.ABORTED and "127.0.0.1:1" in e.value.details()
    load = _idle(decode)
    assert load.kv_pages_free == load.kv_pages_total and load.num_running == 0


STEP_S = 0.3  # the prefill instance's step delay while a test watches its chunks (tests.support.gateway_instance)


def _long(tag: str) -> str:
    """A prompt of several prefill chunks (the instances' --max_num_batched_tokens=32: 4 chunks, 15 full pages),
    new to every prefix cache (`tag` first)."""
    return f"{tag}: " + " ".join(f"{PROMPT} {w}" for w in ("one", "two", "three", "four"))


def _export(stub, prompt: str, **kw):
    return stub.Generate(pb.GenerateRequest(text=prompt, kv_export=True, sampling=pb.SamplingParameters(
        max_tokens=8, temperature=0.0, ignore_eos=True)), timeout=60, metadata=MD, **kw)


def test_a_long_prompts_pages_are_pullable_chunk_by_chunk_while_its_prefill_runs(fleet):
    prefill, _, _ = fleet
    prefill.set_delay(STEP_S)
    try:
        with grpc.insecure_channel(prefill.target) as ch:
            stub = pb_grpc.InferenceStub(ch)
            call = _export(stub, _long("Pieces"))
            early = next(call)  # before the prefill ran: names the transfer, no token yet
            handoff = early.kv_transfer
            assert handoff.streaming and not early.token_ids and handoff.transfer_id
            full = len(handoff.prompt_token_ids) // 8
            assert len(handoff.prompt_token_ids) > 3 * 32 and full >= 12
            pieces = list(stub.PullKV(pb.PullKVRequest(transfer_id=handoff.transfer_id), timeout=60, metadata=MD))
            rest = list(call)
    finally:
        prefill.set_delay(0.0)
    first_token = rest[-1].token_ids[0]
    assert rest[-1].kv_transfer.transfer_id == handoff.transfer_id and rest[-1].kv_transfer.num_pages == full
    with_pages = [m for m in pieces if m.num_pages]
    # the pages came in pieces as the chunks ended, several of them while later chunks still ran
    assert sum(not m.prefill_done for m in with_pages) >= 2, [(m.num_pages, m.prefill_done) for m in pieces]
    assert [m.first_page for m in with_pages] == [sum(m.num_pages for m in with_pages[:i])
                                                  for i in range(len(with_pages))]
    assert sum(m.num_pages for m in with_pages) == full
    assert pieces[-1].last and pieces[-1].first_token_id == first_token and not pieces[-1].num_pages
    with grpc.insecure_channel(prefill.target) as ch:  # pulled again once the prefill ended: the same bytes
        stub = pb_grpc.InferenceStub(ch)
        again = list(stub.PullKV(pb.PullKVRequest(transfer_id=handoff.transfer_id), timeout=60, metadata=MD))
        assert all(m.prefill_done for m in again)
        for k in range(len(with_pages[0].leaves)):
            assert (b"".join(m.leaves[k] for m in with_pages)
                    == b"".join(m.leaves[k] for m in again if m.num_pages))
        assert stub.ReleaseKV(pb.ReleaseKVRequest(transfer_id=handoff.transfer_id), timeout=10, metadata=MD).released
    load = _idle(prefill)
    assert load.kv_pages_free == load.kv_pages_total and load.num_running == 0


def test_a_long_prompt_through_the_gateway_starts_its_decode_stage_before_the_first_token(fleet):
    prefill, decode, gw = fleet
    prompt = _long("Gateway")
    salted = pb.GenerateRequest(text=prompt, cache_salt="reference", sampling=pb.SamplingParameters(
        max_tokens=8, temperature=0.0, ignore_eos=True))  # its own prefix-cache entries: the prompt stays new
    with grpc.insecure_channel(prefill.target) as ch:
        ref = [t for r in pb_grpc.InferenceStub(ch).Generate(salted, timeout=60, metadata=MD) for t in r.token_ids]
    assert len(ref) == 8
    seen: dict[str, float] = {}

    def run():
        out = []
        with Client(gw.target, timeout=60) as c:
            for r in c.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True,
                                metadata=[("authorization", f"Bearer {TENANT_KEY}")]):
                if r.token_ids and not out:
                    seen.setdefault("first_token", time.monotonic())
                out.extend(r.token_ids)
                if r.usage.cached_prompt_tokens:
                    seen["cached"] = r.usage.cached_prompt_tokens
        return out

    prefill.set_delay(STEP_S)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(run)
            wait_for(lambda: gw.instances(ADMIN_KEY)["d0"].inflight == 1 or None, 30, interval=0.02,
                     what="the decode stage")
            seen["decode_stage"] = time.monotonic()
            tokens = fut.result(timeout=60)
    finally:
        prefill.set_delay(0.0)
    assert tokens == ref
    # the decode stage was routed (and pulling) while the prefill's chunks still ran
    assert seen["decode_stage"] < seen["first_token"], seen
    assert seen["cached"] == len(_tokens(prefill, prompt)) // 8 * 8  # every full page came from the prefill
    for proc in (prefill, decode):
        load = _idle(proc)
        assert load.kv_pages_free == load.kv_pages_total and load.num_running == 0, proc.target


def test_a_prefill_cancelled_mid_stream_ends_its_decode_stage_cleanly(fleet):
    """The prefill request dies while the decode instance pulls its chunks: the decode side ends with ABORTED
    naming the transfer, and neither instance holds a page after."""
    prefill, decode, _ = fleet
    prompt = _long("Cancelled")
    prefill.set_delay(STEP_S)
    try:
        with grpc.insecure_channel(prefill.target) as pch, grpc.insecure_channel(decode.target) as dch:
            call = _export(pb_grpc.InferenceStub(pch), prompt)
            handoff = next(call).kv_transfer
            src = pb.KVSource(address=prefill.target, transfer_id=handoff.transfer_id,
                              prompt_token_ids=handoff.prompt_token_ids, streamed=True)
            dcall = pb_grpc.InferenceStub(dch).Generate(pb.GenerateRequest(
                kv_source=src, sampling=pb.SamplingParameters(max_tokens=8, temperature=0.0)), timeout=60,
                metadata=MD)
            time.sleep(1.5 * STEP_S)  # a chunk or so pulled
            call.cancel()
            with pytest.raises(grpc.RpcError) as e:
                list(dcall)
    finally:
        prefill.set_delay(0.0)
    assert e.value.code() == grpc.StatusCode.ABORTED and handoff.transfer_id in e.value.details(), e.value
    for proc in (prefill, decode):
        load = _idle(proc)
        assert load.kv_pages_free == load.kv_pages_total and load.num_running == 0, proc.target


def _tokens(proc, text: str) -> list[int]:
    with _instance(proc) as c:
        return list(c.stub.Tokenize(pb.TokenizeRequest(text=text), timeout=10, metadata=MD).token_ids)


def test_the_prefill_instance_killed_mid_stream_is_an_explicit_error(fleet):
    """LAST in this module: it kills the prefill instance (SIGKILL) while its chunked prefill runs and the decode
    instance already holds pieces it pulled: the client's stream ends with an explicit error, the decode instance
    holds no page, runs nothing and stays routable, and the gateway still answers."""
    prefill, decode, gw = fleet
    seen: dict = {"tokens": []}

    def run():
        with Client(gw.target, timeout=60) as c:
            for r in c.generate(_long("Killed"), max_tokens=8, temperature=0.0, ignore_eos=True,
                                metadata=[("authorization", f"Bearer {TENANT_KEY}")]):
                seen["tokens"].extend(r.token_ids)

    def pieces_held():  # pulled pieces are held by the pull until it ends: pages used on the decode side
        load = _load(decode)
        return load.kv_pages_total - load.kv_pages_free or None

    prefill.set_delay(3 * STEP_S)  # four chunks of 0.9 s: a wide window to kill in after the first piece
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(run)
        wait_for(lambda: gw.instances(ADMIN_KEY)["d0"].inflight == 1 or None, 30, interval=0.02,
                 what="the decode stage")
        held = wait_for(pieces_held, 30, interval=0.02, what="a piece pulled")
        assert prefill.proc.poll() is None and not seen["tokens"]  # the prefill still runs: no first token yet
        prefill.proc.kill()
        prefill.proc.wait(10)
        t_kill = time.monotonic()
        with pytest.raises(ClientError) as e:
            fut.result(timeout=30)
    ended_s = time.monotonic() - t_kill
    assert 0 < held < len(_tokens(decode, _long("Killed"))) // 8  # only part of the prompt's pages had come
    assert not seen["tokens"]
    err = e.value  # the prefill stage failed before its first token, with no other prefill instance to retry on
    assert err.code == grpc.StatusCode.UNAVAILABLE, err
    assert "prefill" in err.details and prefill.target in err.details, err.details
    assert ended_s < 10, ended_s
    load = _idle(decode)
    assert load.kv_pages_free == load.kv_pages_total and load.num_running == 0
    states = {name: i.state for name, i in gw.instances(ADMIN_KEY).items()}
    assert states == {"p0": "failed", "d0": "healthy"}, states
    with Client(decode.target, timeout=60) as c:  # the decode instance still serves
        assert len(c.complete(PROMPT, max_tokens=2, temperature=0.0, ignore_eos=True, metadata=MD).token_ids) == 2
    with Client(gw.target, timeout=30) as c, pytest.raises(ClientError) as e:  # the gateway answers: no prefill left
        c.complete(PROMPT, max_tokens=2, metadata=[("authorization", f"Bearer {TENANT_KEY}")])
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "no healthy" in e.value.details, e.value
