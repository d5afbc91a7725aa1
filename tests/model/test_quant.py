"""int8 weights (model/quant.py) and the CPU's native kernel (cpu_kernels/native.py):
the kernel against its definition in numpy, for every tile shape, each native target this
CPU can run (tests/cpu_kernels/native_targets.py: portable, AVX2, AVX-512, AVX-512 BF16, AMX) and each
block order the target reads, the one it packs first; a row's result independent of its batch;
the runner on a tiny random model against the f32 runner, holding no f32 projections."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.quant import (PROJECTIONS, Int8Matrix, dequantize_int8, linear, native_layout,
                         quantize_int8, quantized_bytes)
from model.runner import ModelRunner
from cpu_kernels import native
from scheduler.protocol import SamplingParams, SeqChunk, StepPlan
from tests.cpu_kernels import native_targets as targets
from tests.model.test_runner import TINY, random_params

pytestmark = pytest.mark.skipif(not native.available()[0],
                                reason=f"native kernel: {native.available()[1]}")


def _bf16(a: np.ndarray) -> np.ndarray:
    """Round to bf16 (nearest even), as the kernel does, kept in float64."""
    b = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return b.view(np.float32).astype(np.float64)


def _definition(x: np.ndarray, m: Int8Matrix, layer: int, rounds_bf16: bool) -> np.ndarray:
    """x [T, in] times layer `layer`'s dequantized weights, both rounded to bf16 where the
    build's dots are bf16 (the AMX and AVX-512 BF16 paths, and the portable loop that
    matches them); the AVX2 path has no bf16 dot and rounds neither."""
    w = dequantize_int8(m)[layer]  # [out, in]
    if not rounds_bf16:
        return x.astype(np.float64) @ w.astype(np.float64).T
    return _bf16(x) @ _bf16(w).T


def _call(x, m, layer, fm, target=native.TARGET):
    xin = jnp.asarray(x.T if fm else x)
    f = jax.jit(lambda x, q, s, i: native.q8_linear(x, q, s, i, feature_major=fm, n=m.n,
                                                    layout=m.layout, target=target))
    out = np.asarray(f(xin, m.q, m.scale, jnp.int32(layer)))
    return out.T if fm else out


def test_quantize_packs_blocks_and_dequantizes_within_half_a_step():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 24, 96)).astype(np.float32)
    w[1, 3, 32:64] = 0.0  # an all-zero block
    m = quantize_int8(w, 0)  # 24 columns packed as 32: two groups of 16, 8 of them zero
    assert m.q.dtype == jnp.uint8 and m.q.shape == (2, 32, 96) and m.scale.shape == (2, 32, 3)
    assert m.n == 24
    back = dequantize_int8(m)
    assert back.shape == w.shape
    step = np.abs(w).reshape(2, 24, 3, 32).max(-1, keepdims=True) / 127
    assert (np.abs(back - w).reshape(2, 24, 3, 32) <= step / 2 + 1e-7).all()
    assert (back[1, 3, 32:64] == 0).all()
    k16 = quantize_int8(w, 1)  # the AVX2 path's order: a block's 16 columns of one k together
    assert k16.layout == 1 and k16.q.shape == m.q.shape
    np.testing.assert_array_equal(np.asarray(k16.q).reshape(2, 2, 3, 32, 16),
                                  np.asarray(m.q).reshape(2, 2, 3, 16, 32).swapaxes(3, 4))
    np.testing.assert_array_equal(dequantize_int8(k16), back)
    with pytest.raises(ValueError, match="int8 weights need"):
        quantize_int8(np.zeros((1, 16, 40), np.float32))


def _cases():
    """(target, layout) for every native target and each block order it reads."""
    return [(t, lay) for t in targets.TARGETS for lay in targets.READS[t]]


def _row_cases():
    """Every row count (each tile shape's edges) for the paths' own packed layouts: the
    AVX2 path (avx2), the bf16-dot path (avx512-bf16) and the AMX tiles; the forms'
    edges elsewhere (the portable loop, avx512's build of the AVX2 path, the layout a
    target reads but does not pack)."""
    all_rows = [1, 3, 4, 5, 7, 8, 13, 16, 17, 40, 70]
    sweep = ("avx2", "avx512-bf16", "amx")
    return [(t, lay, r) for t, lay in _cases()
            for r in (all_rows if t in sweep and lay == targets.PACKS[t] else [1, 7, 16, 17])]


@pytest.mark.parametrize("target", targets.TARGETS)
def test_each_target_packs_the_layout_it_reads(target):
    """What a build says of itself (csrc/q8_linear.cc) is what the tests and
    model/quant.py assume; another block order than it reads is refused, never misread."""
    b = targets.build(target)
    assert b.q8_layout == targets.PACKS[target]
    assert [lay for lay in (0, 1) if b.reads_layout(lay)] == targets.READS[target]
    m = quantize_int8(np.ones((1, 16, 32), np.float32), 1 - b.q8_layout)
    if not b.reads_layout(m.layout):
        with pytest.raises(Exception, match="reads layout 0 only"):
            _call(np.ones((1, 32), np.float32), m, 0, False, b[native.TARGET])


def test_the_default_build_is_one_of_the_targets_and_packs_its_layout():
    """The build a server loads (-march=native) reads the layout model/quant.py packs."""
    kind = native.available()[1]
    lib = native.load()
    assert native_layout() == lib.sluice_q8_layout() and lib.sluice_q8_reads_layout(
        native_layout())
    assert quantize_int8(np.ones((1, 16, 32), np.float32)).layout == native_layout()
    assert kind in ("amx", "avx512", "avx2", "portable")
    assert native_layout() == (1 if kind == "avx2" else 0)


@pytest.mark.parametrize("target,layout,rows", _row_cases())
@pytest.mark.parametrize("feature_major", [False, True])
def test_kernel_is_its_definition_and_close_to_f32(target, layout, feature_major, rows):
    b = targets.build(target)
    rng = np.random.default_rng(rows)
    # 3 blocks (odd); 40 columns: two groups of 16 and one padded to 16
    w = (rng.standard_normal((3, 40, 96)) * 0.05).astype(np.float32)
    m = quantize_int8(w, layout)
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    got = _call(x, m, 2, feature_major, b[native.TARGET])
    want = _definition(x, m, 2, b.q8_rounds_to_bf16)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    exact = x @ w[2].T
    assert np.abs(got - exact).max() < 0.02 * np.abs(exact).max()  # int8 is close


@pytest.mark.parametrize("target,layout", _cases())
def test_a_rows_result_does_not_depend_on_its_batch(target, layout):
    target = targets.build(target)[native.TARGET]
    rng = np.random.default_rng(3)
    m = quantize_int8(rng.standard_normal((1, 64, 128)).astype(np.float32), layout)
    x = rng.standard_normal((37, 128)).astype(np.float32)
    batch = _call(x, m, 0, True, target)
    # register tiles, dequantized tiles, AMX tiles; AVX2 layout 1: rows as lanes from
    # 16 rows, columns as lanes under 16, in passes of up to 6 rows: same sums
    for i in (0, 4, 10, 36):
        np.testing.assert_array_equal(_call(x[i:i + 1], m, 0, True, target),
                                      batch[i:i + 1])
    for lo, hi in ((0, 7), (3, 16), (20, 37)):
        np.testing.assert_array_equal(_call(x[lo:hi], m, 0, True, target), batch[lo:hi])


@pytest.mark.parametrize("target,layout", _cases())
@pytest.mark.parametrize("feature_major", [False, True])
def test_zero_rows_are_skipped_and_the_others_keep_their_bits(target, layout, feature_major):
    """A bucket's padding rows are zero (model/llama.py): the kernel multiplies only the
    other rows, writes exact zeros for these, and changes no other row's result."""
    target = targets.build(target)[native.TARGET]
    rng = np.random.default_rng(5)
    m = quantize_int8((rng.standard_normal((1, 40, 96)) * 0.1).astype(np.float32), layout)
    x = rng.standard_normal((19, 96)).astype(np.float32)
    full = _call(x, m, 0, feature_major, target)
    dead = [1, 2, 7, 12, 13, 14, 15, 16, 17, 18]  # between, and a run at the end
    xz = x.copy()
    xz[dead] = 0.0
    xz[3, :95] = 0.0  # one value is enough to be a live row
    got = _call(xz, m, 0, feature_major, target)
    assert (got[dead] == 0).all()
    live = [i for i in range(19) if i not in dead and i != 3]
    np.testing.assert_array_equal(got[live], full[live])
    np.testing.assert_array_equal(got[3], _call(xz[3:4], m, 0, feature_major, target)[0])
    assert (_call(np.zeros_like(x), m, 0, feature_major, target) == 0).all()


@pytest.mark.parametrize("layout", [0, 1])
def test_the_portable_build_computes_what_the_default_build_does(layout):
    """Where the default build reads the same block order and rounds as the portable loop
    does (the bf16-dot paths), the same values; always the definition."""
    portable = targets.build("portable")
    default = native.load()
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((2, 12, 64)) * 0.1).astype(np.float32)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    m = quantize_int8(w, layout)
    for fm in (False, True):
        got = _call(x, m, 1, fm, target=portable[native.TARGET])
        want = _definition(x, m, 1, rounds_bf16=True)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        if not default.sluice_q8_avx2() and default.sluice_q8_reads_layout(layout):
            np.testing.assert_allclose(got, _call(x, m, 1, fm), rtol=1e-5, atol=1e-5)


def _step_logits(r: ModelRunner, rows: int) -> np.ndarray:
    chunks = [SeqChunk(seq_id=i, token_ids=[3 + i, 40 + i, 90 + i], start_pos=0,
                       page_table=[1 + i], sample=True,
                       sampling=SamplingParams(temperature=0.0)) for i in range(rows)]
    res = r.step(StepPlan(chunks), return_logits=True)
    return np.stack([res.logits[i] for i in range(rows)])


@pytest.mark.parametrize("feature_major", [False, True])
def test_runner_with_int8_weights_is_close_to_f32_and_holds_no_f32_projections(
        feature_major):
    kw = dict(page_size=8, num_pages=40, max_context=256, decode_buckets=(1,),
              prefill_buckets=(16, 64), mixed_decode_buckets=(0,), block_q=8,
              max_prefill_seqs=4, feature_major=feature_major)
    f32 = ModelRunner(TINY, random_params(TINY), **kw)
    i8 = ModelRunner(TINY, random_params(TINY), quantization="int8", **kw)
    f32.warmup()
    i8.warmup()
    assert i8.describe()["quantization"] == "int8"
    held = [v for g in i8.params["layers"].values() for k, v in g.items() if k in PROJECTIONS]
    assert len(held) == 4 and all(isinstance(v, Int8Matrix) for v in held)
    assert "head_int8" in i8.params
    f32_bytes = sum(leaf.nbytes for g in f32.params["layers"].values()
                    for d in (g if isinstance(g, tuple) else (g,))
                    for k, leaf in d.items() if k in PROJECTIONS)
    f32_bytes += f32.params["embed"].nbytes  # the tied lm_head
    assert f32_bytes / 4 <= quantized_bytes(i8.params) <= f32_bytes / 4 * 1.2  # + scales
    for rows in (1, 4):  # a 16-token and a 64-token shape
        a, b = _step_logits(i8, rows), _step_logits(f32, rows)
        # int8 weights and bf16 products: ~2% of the largest logit on this random model
        # (1% against the f32 forward of the dequantized weights)
        np.testing.assert_allclose(a, b, atol=0.05 * np.abs(b).max())
        top5 = np.argsort(b, -1)[:, -5:]  # a random model's logits are close to flat
        assert all(a[i].argmax() in top5[i] for i in range(rows))
    with pytest.raises(ValueError, match="quantization"):
        ModelRunner(TINY, random_params(TINY), quantization="int4", **kw)


@pytest.mark.parametrize("feature_major", [False, True])
def test_padding_rows_stay_zero_and_cost_nothing_to_the_real_rows(feature_major):
    """Padding rows (decode rows past the step's, a prompt block's tail) are zero through
    every layer, so the kernel skips them; the real rows' logits are those of a step
    without that padding (bitwise: the kernel's rows do not depend on each other)."""
    r = ModelRunner(TINY, random_params(TINY), quantization="int8", page_size=8,
                    num_pages=40, max_context=256, decode_buckets=(2, 4),
                    prefill_buckets=(16,), mixed_decode_buckets=(4,), block_q=8,
                    max_prefill_seqs=2, feature_major=feature_major)
    r.warmup()

    def dec(i):
        return SeqChunk(seq_id=i, token_ids=[7 + i], start_pos=9, page_table=[1 + 2 * i, 2 + 2 * i],
                        sample=True, sampling=SamplingParams(temperature=0.0))

    prompt = SeqChunk(seq_id=9, token_ids=[5, 6, 7], start_pos=0, page_table=[30],
                      sample=True, sampling=SamplingParams(temperature=0.0))
    res = r.step(StepPlan([dec(0), dec(1), dec(2), prompt]), return_logits=True)
    hidden = np.asarray(r._last[1])
    hidden = hidden.T if feature_major else hidden  # [T, hidden]: 4 decode rows, 16 prompt
    real = [0, 1, 2, 4, 5, 6]
    pad = [i for i in range(hidden.shape[0]) if i not in real]
    assert (hidden[pad] == 0).all() and (np.abs(hidden[real]).max(-1) > 0).all()
    two = r.step(StepPlan([dec(0), dec(1)]), return_logits=True)  # bucket 2: no padding
    for i in (0, 1):
        np.testing.assert_array_equal(res.logits[i], two.logits[i])


def test_int8_without_the_native_kernel_is_refused_clearly(monkeypatch):
    monkeypatch.setattr(native, "available", lambda: (False, "no C++ compiler found"))
    with pytest.raises(native.NativeUnavailable, match="no C\\+\\+ compiler"):
        ModelRunner(TINY, random_params(TINY), quantization="int8", page_size=8,
                    num_pages=8, max_context=64, decode_buckets=(1,), prefill_buckets=(16,),
                    max_prefill_seqs=1)


def test_auto_serves_f32_where_only_the_portable_build_runs(monkeypatch):
    """x86 without AVX2: the portable loops are right but far slower than XLA's f32, so
    "auto" keeps f32 weights, an f32 pool and the LoRA delta in jnp; int8 asked for
    explicitly still runs."""
    from model import adapter_slots
    from pallas_kernels.cpu import CpuBackend

    monkeypatch.setattr(native, "available", lambda: (True, "portable"))
    assert not native.fast()[0] and "portable" in native.fast()[1]
    kw = dict(page_size=8, num_pages=8, max_context=64, decode_buckets=(1,),
              prefill_buckets=(16,), max_prefill_seqs=1)
    r = ModelRunner(TINY, random_params(TINY), quantization="auto", **kw)
    assert r.quantization == "none" and r.kv_storage == jnp.float32
    assert not adapter_slots.native_available()
    assert not CpuBackend(r.pool).native
    assert ModelRunner(TINY, random_params(TINY), quantization="int8", **kw).quantization \
        == "int8"
    monkeypatch.setattr(native, "available", lambda: (True, "avx2"))
    assert native.fast() == (True, "avx2")


def test_linear_passes_float_weights_through():
    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    np.testing.assert_array_equal(linear(x, w, feature_major=False), x @ w)
