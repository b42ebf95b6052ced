"""KVTransfers between two real engines (the engine-thread side of prefill/decode disaggregation): a prompt prefilled
on a tp=1 engine with an int8 KV cache, its held pages read out (values and scales as stored), written into a tp=2
engine's pages and prefix cache, and the decode there continues with the greedy tokens of the prefill engine's own
whole run; both engines end with every page free."""
import numpy as np
import pytest

from serving.core.kv_transfer import KVTransfers
from serving.core.llm import LLM
from serving.core.sampling_params import SamplingParams
from tests.support import hf_models

PS = 8
BASE = dict(page_size=PS, max_num_seqs=4, max_num_batched_tokens=64, min_token_bucket=64, num_pages=64,
            kv_cache_dtype="int8")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("kvtransfer") / "llama")
    hf_models.save_hf_model("llama", d)
    return d


def _run(engine, request) -> list[int]:
    engine.add_request(request)
    engine.run_until_idle()
    return list(request.output_token_ids)


def test_int8_pages_move_from_tp1_to_tp2_and_decode_continues_the_same_tokens(llama):
    prefill, decode = LLM(llama, warmup=False, tp=1, **BASE), LLM(llama, warmup=False, tp=2, **BASE)
    pe, de = prefill.engine, decode.engine
    prompt = hf_models.random_prompt(5 * PS + 3, 160, seed=7)  # 5 full blocks and a partial one
    greedy = dict(temperature=0.0, ignore_eos=True)
    reference = _run(pe, pe.make_request("ref", prompt, SamplingParams(max_tokens=6, **greedy)))
    pe.scheduler.block_manager.reset_prefix_cache()  # the prefill below computes its pages afresh

    first = pe.make_request("p", prompt, SamplingParams(max_tokens=1, **greedy))
    t0 = _run(pe, first)
    assert t0 == reference[:1]
    out, into = KVTransfers(pe), KVTransfers(de)
    assert out.layout() == into.layout() and {d for _, d in out.layout()} >= {"int8"}  # values int8, plus scales
    tid, n = out.hold(first)
    assert n == 5 and pe.scheduler.block_manager.num_free_pages == pe.num_pages - 5  # held: not evictable
    pe.scheduler.check_invariants()
    data = out.read(tid, 0, n)
    assert [d.shape[0] for d in data] == [n] * len(data) and all(np.any(d) for d in data)
    assert out.release(tid) and not out.release(tid)

    cont = de.make_request("d", prompt + t0, SamplingParams(max_tokens=5, **greedy))
    assert into.write(cont, data) == 5
    rest = _run(de, cont)
    assert cont.metrics.num_cached_prompt_tokens == 5 * PS  # the received pages served as its prefix
    assert t0 + rest == reference
    for engine in (pe, de):
        engine.scheduler.block_manager.check_idle()
