"""The batched LoRA update (`pallas_kernels.lora.lora_delta`) on every backend against a float64 reference: tokens of
several adapters, of none (-1) and padding in one call, slots of different ranks (zero past their rank, as the slot
stacks hold them), float32 and bfloat16."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lora, native


def _case(dtype, tokens: int, seed: int = 0, k: int = 48, r: int = 16, n: int = 40):
    rng = np.random.default_rng(seed)
    s = 4
    ranks = np.array([r, 4, 0, 9], np.int32)
    a = rng.standard_normal((s, r, k)).astype(np.float32)
    b = rng.standard_normal((s, r, n)).astype(np.float32)
    for i, rank in enumerate(ranks):
        a[i, rank:], b[i, rank:] = 0, 0
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    slots = rng.integers(-1, s, tokens).astype(np.int32)
    cast = lambda v: np.asarray(jnp.asarray(v, dtype).astype(jnp.float32), np.float64)  # noqa: E731
    xd, ad, bd = cast(x), cast(a), cast(b)
    want = np.stack([xd[t] @ ad[sl].T @ bd[sl] if sl >= 0 else np.zeros(n) for t, sl in enumerate(slots)])
    return [jnp.asarray(v, dtype) for v in (x,)] + [jnp.asarray(slots)] + [jnp.asarray(v, dtype) for v in (a, b)] + \
        [jnp.asarray(ranks)], want


@pytest.mark.parametrize("backend", lora.BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_backend_matches_the_reference(backend, dtype, monkeypatch):
    if backend == "native":
        if native.machine_reason() is not None:
            pytest.skip(f"native CPU kernels cannot run here: {native.machine_reason()}")
        monkeypatch.delenv(native.ENV_VAR, raising=False)  # (MESHSERVE_CPU_KERNELS=xla: this test is the kernel's)
    monkeypatch.setenv(lora.LORA_ENV_VAR, backend)
    for tokens in (1, 3, 13):
        args, want = _case(dtype, tokens, seed=tokens)
        assert lora.lora_backend(args[0], args[2], args[3]) == backend
        got = np.asarray(jax.jit(lambda *z: lora.lora_delta(*z))(*args).astype(jnp.float32))
        tol = 1e-4 if dtype == jnp.float32 else 2e-2
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max(), err_msg=f"T={tokens}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_native_kernel_on_its_thread_pool(dtype, monkeypatch):
    """A call past the kernel's serial threshold (`kLoraSerialMacs` in native/lora.h: 2M multiply-adds; a decode
    step's rank-8 update stays under it) runs its A and B passes on the thread pool: same answer."""
    if native.machine_reason() is not None:
        pytest.skip(f"native CPU kernels cannot run here: {native.machine_reason()}")
    monkeypatch.delenv(native.ENV_VAR, raising=False)
    monkeypatch.setenv(lora.LORA_ENV_VAR, "native")
    args, want = _case(dtype, 256, seed=5, k=512, r=64, n=384)
    slots, ranks = np.asarray(args[1]), np.asarray(args[4])
    macs = sum(int(ranks[sl]) * (512 + 384) for sl in slots if sl >= 0)
    assert macs > 1 << 21, macs
    got = np.asarray(jax.jit(lambda *z: lora.lora_delta(*z))(*args).astype(jnp.float32))
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_automatic_choice():
    """Native on one CPU device where the kernels run; else a few tokens gather, more loop over the slots
    (XLA:CPU)."""
    args, _ = _case(jnp.float32, 13)
    few, _ = _case(jnp.float32, 2)
    if native.enabled():
        assert lora.lora_backend(args[0], args[2], args[3]) == "native"
    with native.env_var(native.ENV_VAR, "xla"):
        assert lora.lora_backend(few[0], few[2], few[3]) == "gather"
        assert lora.lora_backend(args[0], args[2], args[3]) == "loop"
