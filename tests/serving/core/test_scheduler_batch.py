"""The engine seam: scheduler outputs feed the batch builder (serving.core.batch) as they are, and it returns
exactly the arrays of a plain per-sequence loop (the oracle below), errors included."""
import numpy as np
import pytest

from serving.core import BatchBuilder, Request, SamplingParams, Scheduler, SchedulerConfig, SeqChunk, build_batch, build_layout
from serving.core.batch import micro_batch_tokens, split_micro_batches
from serving.core.fake_model import FakeModel


def oracle(chunks, *, page_size: int, num_tokens: int, num_seqs: int, max_pages: int) -> dict[str, np.ndarray]:
    """The layout written plainly, a Python loop per sequence: what the vectorised builder must equal."""
    total = sum(len(c.token_ids) for c in chunks)
    if total > num_tokens or len(chunks) > num_seqs:
        raise ValueError(f"{total} tokens / {len(chunks)} seqs do not fit bucket ({num_tokens}, {num_seqs})")
    input_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.full(num_tokens, -1, np.int32)
    kv_lens = np.zeros(num_seqs, np.int32)
    page_indices = np.zeros((num_seqs, max_pages), np.int32)
    cu_q_lens = np.zeros(num_seqs + 1, np.int32)
    logits_indices = np.zeros(num_seqs, np.int32)
    off = 0
    for i, c in enumerate(chunks):
        n = len(c.token_ids)
        if n == 0:
            raise ValueError(f"sequence {i} schedules no tokens")
        end = c.start + n
        pages_needed = -(-end // page_size)
        if pages_needed > max_pages or pages_needed > len(c.block_table):
            raise ValueError(f"sequence {i} needs {pages_needed} pages; block table has {len(c.block_table)},"
                             f" max_pages={max_pages}")
        pos = np.arange(c.start, end, dtype=np.int32)
        table = np.asarray(c.block_table[:pages_needed], np.int32)
        input_ids[off:off + n] = c.token_ids
        positions[off:off + n] = pos
        slot_mapping[off:off + n] = table[pos // page_size] * page_size + pos % page_size
        kv_lens[i] = end
        page_indices[i, :pages_needed] = table
        cu_q_lens[i + 1] = off + n
        logits_indices[i] = off + n - 1
        off += n
    cu_q_lens[len(chunks) + 1:] = off
    return dict(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, kv_lens=kv_lens,
                page_indices=page_indices, cu_q_lens=cu_q_lens, num_seqs=np.array([len(chunks)], np.int32),
                logits_indices=logits_indices)


def assert_same(chunks, builder=None, **shape):
    want = oracle(chunks, **shape)
    gots = [build_layout(chunks, **shape)]
    if builder is not None:
        gots.append(builder.layout(chunks, num_tokens=shape["num_tokens"], num_seqs=shape["num_seqs"]))
    batch = build_batch(chunks, **shape)  # the same arrays in the RaggedBatch the step takes
    np.testing.assert_array_equal(batch.input_ids, want["input_ids"])
    np.testing.assert_array_equal(batch.attention.page_indices, want["page_indices"])
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
    for build in (oracle, build_layout, build_batch):
        with pytest.raises(ValueError, match=match):
            build(chunks, page_size=4, num_tokens=8, num_seqs=2, max_pages=4)
    with pytest.raises(ValueError, match=match):
        BatchBuilder(page_size=4, max_pages=4, max_seqs=2).build(chunks, num_tokens=8, num_seqs=2)


@pytest.mark.parametrize("num_tokens, num_micro", [(16, 2), (16, 3), (10, 4), (17, 5), (7, 7), (9, 1)])
def test_split_micro_batches_pads_a_step_they_do_not_divide(num_tokens, num_micro):
    """The micro-batches of a pipelined step, laid end to end, are the step padded to num_micro x ceil(num_tokens /
    num_micro) tokens: the same ids, positions and KV slots at the same flat index (padding writes no KV), so the
    whole step's logits rows index the pipeline's output."""
    size = micro_batch_tokens(num_tokens, num_micro)
    assert size == -(-num_tokens // num_micro) and (size - 1) * num_micro < num_tokens <= size * num_micro
    rng = np.random.default_rng(num_tokens * 10 + num_micro)
    for _ in range(30):
        chunks, left = [], int(rng.integers(0, num_tokens + 1))
        while left:
            n = int(rng.integers(1, left + 1))
            start = int(rng.integers(0, 20))
            chunks.append(SeqChunk(rng.integers(0, 100, n).tolist(), start, list(range(-(-(start + n) // 4)))))
            left -= n
        parts = split_micro_batches(chunks, num_tokens, num_micro)
        assert len(parts) == num_micro
        sizes = [sum(len(c.token_ids) for c in p) for p in parts]
        assert all(s <= size for s in sizes)
        assert all(s == size for s in sizes[:max((i for i, s in enumerate(sizes) if s), default=0)])  # only the tail
        layouts = [build_layout(p, page_size=4, num_tokens=size, num_seqs=len(chunks) or 1, max_pages=16)
                   for p in parts]
        full = build_layout(chunks, page_size=4, num_tokens=size * num_micro, num_seqs=len(chunks) or 1,
                            max_pages=16)
        for key in ("input_ids", "positions", "slot_mapping"):
            assert np.array_equal(np.concatenate([p[key] for p in layouts]), full[key]), key


def test_split_micro_batches_rejects_an_overfull_step():
    with pytest.raises(ValueError, match="9 tokens do not fit a 8-token step"):
        split_micro_batches([SeqChunk([1] * 9, 0, [0, 1, 2])], 8, 3)
    with pytest.raises(ValueError, match="cannot be cut into 0 micro-batches"):
        split_micro_batches([], 8, 0)
