"""KVTransfers between two real engines (the engine-thread side of prefill/decode disaggregation): a prompt prefilled
on a tp=1 engine with an int8 KV cache and 8-token pages, its held pages read out (values and scales as stored),
repacked into 16-token pages, written into a tp=2 engine's pages and prefix cache, and the decode there continues with
the greedy tokens of the prefill engine's own whole run; then the same chunk by chunk (a streaming transfer of a
prompt of 3 prefill steps: each step's blocks held, read and written on as it ends); both engines end with every page
free."""
import numpy as np
import pytest

from serving.core.kv_transfer import KVTransfers, PageHolder, Repacker, compatible, repack
from serving.core.llm import LLM
from serving.core.sampling_params import SamplingParams
from tests.support import hf_models
from tests.support.tiny import model_dir

PS = 8
BASE = dict(max_num_seqs=4, max_num_batched_tokens=64, min_token_bucket=64, num_pages=64,
            kv_cache_dtype="int8")


@pytest.fixture(scope="module")
def llama():
    return model_dir("target")  # the shipped tiny model (2 KV heads: tp=2 splits them)


def _run(engine, request) -> list[int]:
    engine.add_request(request)
    engine.run_until_idle()
    return list(request.output_token_ids)


def test_int8_pages_move_from_tp1_to_tp2_and_page_size_8_to_16_and_decode_continues_the_same_tokens(llama):
    prefill = LLM(llama, warmup=False, tp=1, page_size=PS, **BASE)
    decode = LLM(llama, warmup=False, tp=2, page_size=2 * PS, **BASE)
    pe, de = prefill.engine, decode.engine
    prompt = hf_models.random_prompt(5 * PS + 3, 8000, seed=7)  # 5 full blocks and a partial one
    greedy = dict(temperature=0.0, ignore_eos=True)
    reference = _run(pe, pe.make_request("ref", prompt, SamplingParams(max_tokens=6, **greedy)))
    pe.scheduler.block_manager.reset_prefix_cache()  # the prefill below computes its pages afresh

    first = pe.make_request("p", prompt, SamplingParams(max_tokens=1, **greedy))
    t0 = _run(pe, first)
    assert t0 == reference[:1]
    out, into = KVTransfers(pe), KVTransfers(de)
    # values int8 plus their scales; the same leaves and rows, the page size differs (tp does not show: unsharded)
    assert compatible(out.layout(), into.layout()) and out.layout() != into.layout()
    assert {d for _, d in out.layout()} >= {"int8"}
    tid, n = out.hold(first)
    assert n == 5 and pe.scheduler.block_manager.num_free_pages == pe.num_pages - 5  # held: not evictable
    pe.scheduler.check_invariants()
    data = out.read(tid, 0, n)
    assert [d.shape[0] for d in data] == [n] * len(data) and all(np.any(d) for d in data)
    assert out.release(tid) and not out.release(tid)

    cont = de.make_request("d", prompt, SamplingParams(max_tokens=6, **greedy))
    cont.token_ids += t0  # the first token, as an output token (serving.server.disagg.resume)
    repacked = repack(data, PS, 2 * PS)
    assert [d.shape[:2] for d in repacked] == [(2, 2 * PS)] * len(data)  # 40 tokens: 2 pages of 16, 8 recomputed
    assert np.array_equal(repacked[0][1, :PS], data[0][2])  # token 16.. of the prompt: 8-token page 2
    assert into.write(cont, repacked) == 2
    _run(de, cont)
    rest = list(cont.output_token_ids)[1:]
    assert cont.metrics.num_cached_prompt_tokens == 4 * PS  # the received pages served as its prefix
    assert t0 + rest == reference
    for engine in (pe, de):
        engine.scheduler.block_manager.check_idle()

    # chunk by chunk: a prompt of 3 prefill steps (64 tokens each); its blocks are held as each step ends, read in
    # pieces, repacked piece by piece into 16-token pages and written on the decode side as they come
    prompt = hf_models.random_prompt(3 * 64 - 5, 8000, seed=8)  # 187 tokens: 23 full 8-token blocks
    reference = _run(pe, pe.make_request("ref2", prompt, SamplingParams(max_tokens=5, **greedy)))
    pe.scheduler.block_manager.reset_prefix_cache()
    first = pe.make_request("p2", prompt, SamplingParams(max_tokens=1, **greedy))
    tid = out.open(first)
    pe.add_request(first)
    cont = de.make_request("d2", prompt, SamplingParams(max_tokens=5, **greedy))
    holder, repacker, pieces = PageHolder(), Repacker(PS, 2 * PS), []

    def pull():
        sent, _, _ = pieces[-1] if pieces else (0, 0, 0)
        held, running, _ = out.state(tid)
        if held > sent:
            start, blocks = repacker.add(out.read(tid, sent, held - sent))
            pieces.append((held, running, into.write(cont, blocks, holder=holder, first_block=start)))

    into.begin_import(holder)
    while pe.has_unfinished():
        pe.step()
        out.advance()  # (the prefill instance's step listener)
        pe.scheduler.check_invariants()
        pull()
    assert out.finish(tid, first.output_token_ids[-1]) == 23 and out.state(tid) == (23, False, reference[0])
    pull()
    # in pieces, the first while a later step ran (a step's blocks are cached when its output is processed: with
    # the engine's look-ahead, during the next step() call)
    held = [p[0] for p in pieces]
    assert len(held) >= 2 and held == sorted(set(held)) and held[-1] == 23 and pieces[0][1], pieces
    assert pieces[-1][2] == 11  # 184 tokens: 11 pages of 16 on the decode side (the last 8 tokens recomputed)
    de.scheduler.check_invariants()
    into.end_import(holder)
    into.end_import(holder)  # a no-op the second time
    assert out.release(tid)
    cont.token_ids += reference[:1]
    _run(de, cont)
    assert cont.metrics.num_cached_prompt_tokens == 11 * 2 * PS
    assert reference[:1] + list(cont.output_token_ids)[1:] == reference
    for engine in (pe, de):
        engine.scheduler.block_manager.check_idle()
