"""Weights in llama.cpp's Q4_1 and Q8_0 blocks times int8 activations (model/quant.py
`BlockMatrix`, csrc/q4_linear.cc): a GGUF's blocks reach the kernel unchanged; the
kernel against its definition in numpy (integer block sums, then the f32 steps in
order) in both formats; a row's result independent of its batch and of the zero rows
beside it; every native target bit for bit the same as the default build; the runner
(`quantization = "q4_1"`) on a tiny random model against the f32 runner."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from model.quant import (PROJECTIONS, Q4_1, Q8_0, BlockMatrix, blocks, dequantize_blocks,
                         quantize_q4, quantize_q8_0)
from model.runner import ModelRunner
from cpu_kernels import native
from tests.cpu_kernels import native_targets as targets
from tests.model.test_quant import _step_logits
from tests.model.test_runner import TINY, random_params

pytestmark = pytest.mark.skipif(not native.available()[0],
                                reason=f"native kernel: {native.available()[1]}")


def _gguf_q4_1(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The GGUF bytes of Q4_1 blocks (ggml's block_q4_1: f16 d, f16 m, then 16 bytes,
    byte j holding value j in its low nibble and value j + 16 in its high one), written
    here from the format's definition, not by the code under test."""
    rows, nb, _ = q.shape
    out = np.zeros((rows, nb, 20), np.uint8)
    out[..., 0:2] = d.astype(np.float16)[..., None].view(np.uint8)
    out[..., 2:4] = m.astype(np.float16)[..., None].view(np.uint8)
    out[..., 4:] = q[..., :16] | (q[..., 16:] << 4)
    return out.reshape(rows, nb * 20)


def test_a_gguf_files_q4_1_blocks_reach_the_kernel_unchanged():
    """The loader hands over f32 (gguf's own dequantization); quantize_q4 finds the very
    blocks again: same q, same f16 scales and minimums."""
    rng = np.random.default_rng(0)
    rows, nb = 24, 3
    q = rng.integers(0, 16, (rows, nb, 32)).astype(np.uint8)
    q[..., 0], q[..., 1] = 0, 15  # as llama.cpp quantizes: each block spans 0..15
    d = (rng.uniform(1e-3, 3e-2, (rows, nb))).astype(np.float16).astype(np.float32)
    m = (-7.5 * d + rng.normal(0, 1e-3, (rows, nb))).astype(np.float16).astype(np.float32)
    w = dequantize(_gguf_q4_1(q, d, m), GGMLQuantizationType.Q4_1).reshape(1, rows, nb * 32)
    got = quantize_q4(w)
    gq, gd, gm = blocks(got)
    np.testing.assert_array_equal(gq[0], q.reshape(rows, nb * 32))
    np.testing.assert_array_equal(gd[0], d)
    np.testing.assert_array_equal(gm[0], m)
    np.testing.assert_array_equal(dequantize_blocks(got), w)


def test_a_gguf_files_q8_0_blocks_reach_the_kernel_unchanged():
    """block_q8_0: f16 d, then 32 int8 values (the embedded GGUF's token embeddings, tied
    to its lm_head)."""
    rng = np.random.default_rng(2)
    rows, nb = 20, 2  # 20 columns: packed as 24, 4 of them zero
    q = rng.integers(-127, 128, (rows, nb, 32)).astype(np.int8)
    q[..., 0] = 127  # as llama.cpp quantizes: each block reaches |q| = 127
    d = rng.uniform(1e-3, 3e-2, (rows, nb)).astype(np.float16)
    raw = np.zeros((rows, nb, 34), np.uint8)
    raw[..., 0:2] = d[..., None].view(np.uint8)
    raw[..., 2:] = q.view(np.uint8)
    w = dequantize(raw.reshape(rows, nb * 34), GGMLQuantizationType.Q8_0)[None]
    got = quantize_q8_0(w)
    assert got.format == Q8_0 and got.n == rows and got.q.shape == (1, 3, nb, 272)
    gq, gd, _ = blocks(got)
    np.testing.assert_array_equal(gq[0], q.reshape(rows, nb * 32))
    np.testing.assert_array_equal(gd[0], d.astype(np.float32))
    np.testing.assert_array_equal(dequantize_blocks(got), w)


def test_quantize_packs_blocks_within_half_a_step():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 16, 96)).astype(np.float32)
    w[1, 3, 32:64] = 0.25  # a constant block: d = 0, every value its minimum
    m = quantize_q4(w)
    assert isinstance(m, BlockMatrix) and m.q.dtype == jnp.uint8 and m.format == Q4_1
    assert m.q.shape == (2, 2, 3, 160) and m.n == 16 and m.nbytes == 2 * 16 * 96 * 5 // 8
    back = dequantize_blocks(m)
    blocks = w.reshape(2, 16, 3, 32)
    step = (blocks.max(-1) - blocks.min(-1)) / 15
    err = np.abs(back - w).reshape(2, 16, 3, 32)
    assert (err <= step[..., None] * 0.5 + np.abs(blocks) * 2e-3 + 1e-6).all()  # + f16's
    assert (back[1, 3, 32:64] == 0.25).all()
    with pytest.raises(ValueError, match="block weights need"):
        quantize_q4(np.zeros((1, 16, 40), np.float32))


def _definition(x: np.ndarray, m: BlockMatrix, layer: int) -> np.ndarray:
    """The kernel's definition: x [T, K] rounded to int8 per row and block of 32 (dx =
    max |x| / 127), integer products with the blocks' q, scaled per block by d dx, plus
    (Q4_1) m times the block's sum of x (float64 here: the kernel's f32 steps within
    1e-5)."""
    q, d, mn = blocks(m)
    q, d, mn = q[layer], d[layer], mn[layer]
    t, k = x.shape
    xb = x.reshape(t, k // 32, 32)
    dx = np.abs(xb).max(-1) / np.float32(127)
    inv = np.where(dx > 0, np.float32(1) / np.where(dx > 0, dx, 1), 0).astype(np.float32)
    qx = np.round(xb * inv[..., None]).astype(np.int64)
    isum = np.einsum("tbi,nbi->tnb", qx, q.reshape(-1, k // 32, 32).astype(np.int64))
    return ((isum * (d[None] * dx[:, None]).astype(np.float64)).sum(-1)
            + (mn[None].astype(np.float64) * xb.sum(-1)[:, None]).sum(-1))


def _call(x, m, layer, fm, target=native.Q4_TARGET):
    xin = jnp.asarray(x.T if fm else x)
    f = jax.jit(lambda x, w, i: native.q4_linear(x, w, i, feature_major=fm, n=m.n,
                                                 format=m.format, target=target))
    out = np.asarray(f(xin, m.q, jnp.int32(layer)))
    return out.T if fm else out


QUANTIZE = {Q4_1: quantize_q4, Q8_0: quantize_q8_0}


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 17])
@pytest.mark.parametrize("feature_major", [False, True])
@pytest.mark.parametrize("fmt", [Q4_1, Q8_0])
def test_kernel_is_its_definition_and_close_to_f32(fmt, feature_major, rows):
    rng = np.random.default_rng(rows)
    # 3 blocks; 85 columns: 11 groups of 8, the last padded (work items of 8 groups,
    # then 4 at a time, then 1)
    w = (rng.standard_normal((3, 85, 96)) * 0.05).astype(np.float32)
    m = QUANTIZE[fmt](w)
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    got = _call(x, m, 2, feature_major)
    assert got.shape == (rows, 85)
    want = _definition(x, m, 2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    exact = x @ dequantize_blocks(m)[2].T  # the weights as they are, x unrounded
    assert np.abs(got - exact).max() < 0.02 * np.abs(exact).max()


@pytest.mark.parametrize("fmt", [Q4_1, Q8_0])
def test_a_rows_result_does_not_depend_on_its_batch_or_on_zero_rows(fmt):
    rng = np.random.default_rng(3)
    m = QUANTIZE[fmt](rng.standard_normal((1, 72, 128)).astype(np.float32))
    x = rng.standard_normal((23, 128)).astype(np.float32)
    batch = _call(x, m, 0, True)
    for i in (0, 4, 10, 22):
        np.testing.assert_array_equal(_call(x[i:i + 1], m, 0, True), batch[i:i + 1])
    for lo, hi in ((0, 2), (3, 6), (5, 13), (6, 23)):
        np.testing.assert_array_equal(_call(x[lo:hi], m, 0, False), batch[lo:hi])
    dead = [1, 2, 7, 20, 21, 22]
    xz = x.copy()
    xz[dead] = 0.0
    got = _call(xz, m, 0, True)
    assert (got[dead] == 0).all()
    live = [i for i in range(23) if i not in dead]
    np.testing.assert_array_equal(got[live], batch[live])
    assert (_call(np.zeros_like(x), m, 0, False) == 0).all()


@pytest.mark.parametrize("target", targets.TARGETS)
def test_each_target_is_the_default_build_bit_for_bit(target):
    """The portable loop and the AVX2 path run the same f32 steps on the same exact
    integer sums (csrc/q4_linear.cc); the AVX-512 targets take the AVX2 path."""
    b = targets.build(target)
    assert b.lib.sluice_q4_avx2() == (target != "portable")
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((2, 22, 64)) * 0.1).astype(np.float32)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    for fm, m in ((False, quantize_q4(w)), (True, quantize_q4(w)), (True, quantize_q8_0(w))):
        got = _call(x, m, 1, fm, target=b[native.Q4_TARGET])
        want = _definition(x, m, 1)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        np.testing.assert_array_equal(got, _call(x, m, 1, fm))


def _q4_born(params: dict) -> dict:
    """The random model with its projections' weights made Q4_1 values, as a Q4_1 GGUF's
    are when loaded: then f32 and q4_1 differ only by the activations' rounding."""
    def born(w):  # (in, out)
        return dequantize_blocks(quantize_q4(np.asarray(w, np.float32).T[None]))[0].T

    names = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    layers = [{k: born(v) if k in names else v for k, v in lp.items()}
              for lp in params["layers"]]
    return {**params, "layers": layers}


@pytest.mark.parametrize("feature_major", [False, True])
def test_runner_with_q4_1_weights_is_close_to_f32(feature_major):
    kw = dict(page_size=8, num_pages=40, max_context=256, decode_buckets=(1,),
              prefill_buckets=(16, 64), mixed_decode_buckets=(0,), block_q=8,
              max_prefill_seqs=4, feature_major=feature_major)
    params = _q4_born(random_params(TINY))
    f32 = ModelRunner(TINY, params, **kw)
    q4 = ModelRunner(TINY, params, quantization="q4_1", **kw)
    f32.warmup()
    q4.warmup()
    assert q4.describe()["quantization"] == "q4_1" and q4.kv_storage != jnp.float32
    held = [v for g in q4.params["layers"].values() for k, v in g.items() if k in PROJECTIONS]
    assert len(held) == 4 and all(isinstance(v, BlockMatrix) for v in held)
    assert q4.params["head_int8"].format == Q8_0
    for rows in (1, 4):
        a, b = _step_logits(q4, rows), _step_logits(f32, rows)
        # int8 activations, the int8 lm_head and the int8 pool: a few % of the largest
        # logit; where the lane walk scores the int8 pool with int8 dots (AVX-512 VNNI:
        # the queries rounded to int8 too) up to ~6% on this random model of head_dim 16
        # (the embedded model's accuracy is unchanged: docs/benchmarks.md)
        tol = 0.075 if native.int8_dots() else 0.05
        np.testing.assert_allclose(a, b, atol=tol * np.abs(b).max())
        top5 = np.argsort(b, -1)[:, -5:]
        assert all(a[i].argmax() in top5[i] for i in range(rows))


def test_q4_1_keeps_adapter_slots_in_bf16_beside_it():
    """The LoRA kernel reads its slots in bf16 beside either kind of native base weights."""
    from model.adapter_slots import native_available

    if not native_available():
        pytest.skip("the native LoRA kernel is not fast here")
    r = ModelRunner(TINY, _q4_born(random_params(TINY)), quantization="q4_1", page_size=8,
                    num_pages=8, max_context=64, decode_buckets=(1,), prefill_buckets=(16,),
                    max_prefill_seqs=1, adapter_slots=2)
    assert r.lora.native and r.lora.dtype == jnp.bfloat16
