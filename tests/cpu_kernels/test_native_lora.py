"""The native LoRA kernel (csrc/lora_delta.cc) against numpy: each token takes its own
slot's delta (none for slot -1), in f32 and bf16 storage, feature-major and row-major, in
the default build and each native target this CPU runs (tests/cpu_kernels/native_targets.py); a token's result does not depend on its batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import native

L, S, K = 3, 4, 40  # K not a multiple of 16: the kernel's tails
OUTS = (48, 24, 20)  # three targets side by side (q/k/v-like; the last one's B is padded)


def _bf16(a):
    return np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))


def _case(t, seed, dtype, r=8):
    rng = np.random.default_rng(seed)
    n = sum(OUTS)
    a = rng.standard_normal((L, len(OUTS), S, r, K)).astype(np.float32)
    b = rng.standard_normal((L, S, r, n)).astype(np.float32) * 0.1
    if dtype == "bf16":
        a, b = _bf16(a), _bf16(b)
    x = rng.standard_normal((t, K)).astype(np.float32)
    y = rng.standard_normal((t, n)).astype(np.float32)
    slots = rng.integers(-1, S, t).astype(np.int32)
    slots[0] = -1
    bounds = np.concatenate([[0], np.cumsum(OUTS)]).astype(np.int32)
    return y, x, a, b, slots, bounds


def _want(y, x, a, b, slots, bounds, layer):
    out = y.copy()
    for i, s in enumerate(slots):
        if s < 0:
            continue
        for j in range(len(OUTS)):
            h = a[layer, j, s] @ x[i]  # [R]
            out[i, bounds[j]:bounds[j + 1]] += h @ b[layer, s][:, bounds[j]:bounds[j + 1]]
    return out


def _run(y, x, a, b, slots, bounds, layer, fm, dtype, target=native.LORA_TARGET):
    wd = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    args = (y.T, x.T) if fm else (y, x)
    b = native.pack_lora_b([b[..., lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])])
    got = jax.jit(lambda y, x, a, b, s, lay: native.lora_delta(
        y, x, a, b, s, lay, bounds, feature_major=fm, target=target))(
        *map(jnp.asarray, args), jnp.asarray(a, wd), jnp.asarray(b, wd), slots,
        np.int32(layer))
    got = np.asarray(got)
    return got.T if fm else got


@pytest.fixture(scope="module")
def built():
    ok, why = native.available()
    if not ok:
        pytest.skip(why)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("fm", [True, False], ids=["feature-major", "row-major"])
@pytest.mark.parametrize("t,r", [(21, 8), (70, 19)], ids=["decode-like", "prompt-like"])
def test_each_token_takes_its_own_slot(built, target_build, dtype, fm, t, r):
    """21 tokens of rank 8 run on one thread; 70 of rank 19 (more rank rows than one
    register block, not a multiple of the A passes) are split over the thread pool."""
    y, x, a, b, slots, bounds = _case(t, 0, dtype, r)
    want = _want(y, x, a, b, slots, bounds, 2)
    for target in (native.LORA_TARGET, target_build[native.LORA_TARGET]):
        got = _run(y, x, a, b, slots, bounds, 2, fm, dtype, target)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5, err_msg=target)
    assert np.array_equal(got[0], y[0])  # slot -1: the base projection, untouched


@pytest.mark.parametrize("t", [17, 70])
def test_a_token_gets_the_same_alone_and_in_a_batch(built, t):
    y, x, a, b, slots, bounds = _case(t, 1, "bf16")
    batch = _run(y, x, a, b, slots, bounds, 1, True, "bf16")
    for i in (3, 9, 16):
        alone = _run(y[i:i + 1], x[i:i + 1], a, b, slots[i:i + 1], bounds, 1, True, "bf16")
        assert np.array_equal(alone[0], batch[i])


def test_no_adapter_token_leaves_y_as_it_is(built):
    y, x, a, b, slots, bounds = _case(5, 2, "f32")
    got = _run(y, x, a, b, np.full(5, -1, np.int32), bounds, 0, True, "f32")
    assert np.array_equal(got, y)
