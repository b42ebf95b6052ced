"""The engine seam: scheduler outputs feed models.batch.build_ragged_batch as they are, and the vectorised
build_batch_arrays returns exactly the same arrays."""
import numpy as np
import pytest

from models.batch import SeqChunk, build_ragged_batch
from serving.core import BatchBuilder, Request, SamplingParams, Scheduler, SchedulerConfig, build_batch_arrays
from serving.core.fake_model import FakeModel


def assert_same(chunks, builder=None, **shape):
    want = build_ragged_batch(chunks, **shape)
    gots = [build_batch_arrays(chunks, **shape)]
    if builder is not None:
        gots.append(builder.build(chunks, num_tokens=shape["num_tokens"], num_seqs=shape["num_seqs"]))
    for got in gots:
        assert want.keys() == got.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.parametrize("num_pages", [40, 128])  # 40: preemption and re-prefill replace block tables
def test_equal_on_scheduler_steps_mixing_prefill_and_decode(num_pages):
    cfg = SchedulerConfig(max_model_len=256, num_pages=num_pages, page_size=8, max_num_batched_tokens=64,
                          max_num_seqs=8)
    sched, model = Scheduler(cfg), FakeModel(num_pages, 8)
    builder = BatchBuilder(page_size=8, max_pages=32, max_seqs=8)
    rng = np.random.default_rng(1)
    shared = rng.integers(1, 500, size=60).tolist()
    for i in range(12):
        prompt = (shared[:int(rng.integers(0, 60))] + rng.integers(1, 500, size=int(rng.integers(1, 120))).tolist())
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=int(rng.integers(1, 30))),
                                  arrival_time=0.0))
    now, steps = 0.0, 0
    while sched.has_unfinished_requests():
        now += 1
        out = sched.schedule(now)
        assert_same(out.scheduled, builder, page_size=8, num_tokens=96, num_seqs=16, max_pages=32)
        if steps == 3:
            sched.abort("r3")  # its block table's row is recycled
        sched.update(out, model.step(out.scheduled), now)
        r1 = sched.requests.get("r1")
        if steps == 5 and r1 is not None and r1.status.value == "running" and r1.num_computed_tokens > 9:
            sched.truncate_computed("r1", r1.num_computed_tokens - 9)  # a roll-back shrinks the table
        steps += 1
    assert steps > 10 and (num_pages == 128 or sched.num_preemptions > 0)
    sched.block_manager.check_idle()


def test_equal_on_random_chunks_and_empty():
    rng = np.random.default_rng(0)
    for _ in range(50):
        chunks = []
        for _ in range(int(rng.integers(0, 6))):
            start, n = int(rng.integers(0, 40)), int(rng.integers(1, 10))
            pages = -(-(start + n) // 4) + int(rng.integers(0, 3))
            chunks.append(SeqChunk(rng.integers(0, 100, n).tolist(), start,
                                   rng.permutation(64)[:pages].tolist()))
        assert_same(chunks, BatchBuilder(page_size=4, max_pages=16, max_seqs=8),
                    page_size=4, num_tokens=64, num_seqs=8, max_pages=16)


@pytest.mark.parametrize("chunks,match", [
    ([SeqChunk([1] * 9, 0, [0, 1, 2])], "do not fit"),
    ([SeqChunk([], 0, [0])], "no tokens"),
    ([SeqChunk([1, 2], 7, [0])], "needs 3 pages"),
])
def test_same_errors(chunks, match):
    for build in (build_ragged_batch, build_batch_arrays):
        with pytest.raises(ValueError, match=match):
            build(chunks, page_size=4, num_tokens=8, num_seqs=2, max_pages=4)
    with pytest.raises(ValueError, match=match):
        BatchBuilder(page_size=4, max_pages=4, max_seqs=2).build(chunks, num_tokens=8, num_seqs=2)
