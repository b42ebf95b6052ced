"""KV write: every real token lands in its slot, padding slots (-1) are dropped, nothing else changes."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pallas_kernels
from pallas_kernels import reference, tpu

WRITERS = {
    "reference": reference.write_kv,
    "entry_point": pallas_kernels.write_kv,
    "tpu_interpret": functools.partial(tpu.write_kv_tpu, interpret=True),
}
NUM_PAGES, PAGE_SIZE, HKV, D = 5, 8, 2, 64


def _expected(cache, k, v, slots):
    want = cache.copy().reshape(NUM_PAGES * PAGE_SIZE, 2 * HKV, D)
    for t, slot in enumerate(slots):
        if slot >= 0:
            want[slot, 0::2] = k[t]
            want[slot, 1::2] = v[t]
    return want.reshape(cache.shape)


@st.composite
def writes(draw):
    t = draw(st.integers(1, 12))
    slots = draw(st.lists(st.integers(0, NUM_PAGES * PAGE_SIZE - 1), min_size=t, max_size=t, unique=True))
    padding = draw(st.lists(st.booleans(), min_size=t, max_size=t))
    return [(-1 if p else s) for s, p in zip(slots, padding)], draw(st.integers(0, 2**31 - 1))


def _check_writer(name, batch, dtype=np.float32):
    slots, seed = batch
    rng = np.random.default_rng(seed)
    cache = rng.standard_normal((NUM_PAGES, PAGE_SIZE, 2 * HKV, D)).astype(dtype)
    k = rng.standard_normal((len(slots), HKV, D)).astype(dtype)
    v = rng.standard_normal((len(slots), HKV, D)).astype(dtype)
    fn = jax.jit(WRITERS[name], donate_argnums=0)
    out = np.asarray(fn(jnp.asarray(cache), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots, np.int32)))
    np.testing.assert_array_equal(out, _expected(cache, k, v, slots))


@pytest.mark.parametrize("name", ["reference", "entry_point"])
@settings(max_examples=30, deadline=None, derandomize=True)
@given(batch=writes())
def test_write_lands_in_slots(name, batch):
    _check_writer(name, batch)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(batch=writes())
def test_write_lands_in_slots_tpu_interpret(batch):
    _check_writer("tpu_interpret", batch)


@pytest.mark.parametrize("name", WRITERS)
def test_write_bf16_and_all_padding(name):
    _check_writer(name, ([3, -1, 39, 8], 1), dtype=jnp.bfloat16)
    _check_writer(name, ([-1, -1], 2))


def test_write_is_in_place_when_donated():
    cache = jnp.zeros((NUM_PAGES, PAGE_SIZE, 2 * HKV, D), jnp.float32)
    k = jnp.ones((2, HKV, D), jnp.float32)
    fn = jax.jit(pallas_kernels.write_kv, donate_argnums=0)
    ptr = cache.unsafe_buffer_pointer()
    out = fn(cache, k, k, jnp.array([1, -1], jnp.int32))
    assert cache.is_deleted()
    assert out.unsafe_buffer_pointer() == ptr
