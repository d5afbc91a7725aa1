"""W8A8 (model/quant.py): the integer matmul against its definition, per-token
independence, and the runner's per-shape choice on a tiny random model."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from model.quant import PROJECTIONS, QuantizedMatrix, linear, quantize_matrix, quantized_bytes
from model.runner import ModelRunner
from scheduler.protocol import SamplingParams, SeqChunk, StepPlan
from tests.model.test_runner import TINY, random_params


def _reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """W8A8 of x [T, in] @ w [in, out] by the book, in numpy."""
    sw = np.abs(w).max(0) / 127.0
    wq = np.clip(np.rint(w / sw), -127, 127).astype(np.int64)
    sx = np.abs(x).max(1, keepdims=True) / 127.0
    xq = np.clip(np.rint(x / sx), -127, 127).astype(np.int64)
    return (xq @ wq).astype(np.float64) * sw[None, :] * sx


@pytest.mark.parametrize("feature_major", [False, True])
def test_w8a8_is_the_integer_product_rescaled_and_close_to_f32(feature_major):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 96)).astype(np.float32)
    w = (rng.standard_normal((96, 40)) * 0.05).astype(np.float32)
    q = quantize_matrix(w.T if feature_major else w, feature_major=feature_major)
    assert isinstance(q, QuantizedMatrix) and q.q.dtype == jnp.int8
    got = np.asarray(linear(jnp.asarray(x.T if feature_major else x), q,
                            feature_major=feature_major))
    got = got.T if feature_major else got
    np.testing.assert_allclose(got, _reference(x, w), rtol=1e-5, atol=1e-6)
    exact = x @ w
    assert np.abs(got - exact).max() < 0.02 * np.abs(exact).max()  # int8 is close
    # A token's result does not depend on the others in its batch.
    one = np.asarray(linear(jnp.asarray(x[2:3].T if feature_major else x[2:3]), q,
                            feature_major=feature_major))
    np.testing.assert_array_equal(one.T if feature_major else one, got[2:3])


def _projections(params):
    for group in params["layers"].values():
        for d in (group if isinstance(group, tuple) else (group,)):
            yield from ((k, v) for k, v in d.items() if k in PROJECTIONS)


def _step_logits(r: ModelRunner, rows: int) -> np.ndarray:
    chunks = [SeqChunk(seq_id=i, token_ids=[3 + i, 40 + i, 90 + i], start_pos=0,
                       page_table=[1 + i], sample=True,
                       sampling=SamplingParams(temperature=0.0)) for i in range(rows)]
    res = r.step(StepPlan(chunks), return_logits=True)
    return np.stack([res.logits[i] for i in range(rows)])


def test_runner_uses_w8a8_only_in_shapes_of_enough_rows():
    kw = dict(page_size=8, num_pages=40, max_context=256, decode_buckets=(1,),
              prefill_buckets=(16, 64), mixed_decode_buckets=(0,), block_q=8,
              max_prefill_seqs=4)
    f32 = ModelRunner(TINY, random_params(TINY), **kw)
    w8 = ModelRunner(TINY, random_params(TINY), quantization="w8a8", w8a8_min_rows=32, **kw)
    f32.warmup()
    w8.warmup()
    assert w8.describe()["quantization"] == "w8a8"
    f32_bytes = sum(leaf.nbytes for name, leaf in _projections(f32.params))
    assert f32_bytes / 4 <= quantized_bytes(w8.qparams) <= f32_bytes / 4 * 1.2  # + scales
    # One 3-token prompt: the 16-token shape, below the threshold: f32, bit for bit.
    np.testing.assert_array_equal(_step_logits(w8, 1), _step_logits(f32, 1))
    # Four prompts pad to 32 tokens: the 64-token shape, W8A8: close, not equal.
    a, b = _step_logits(w8, 4), _step_logits(f32, 4)
    assert not np.array_equal(a, b)
    np.testing.assert_allclose(a, b, atol=0.05 * np.abs(b).max())
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.75
    with pytest.raises(ValueError, match="quantization"):
        ModelRunner(TINY, random_params(TINY), quantization="int4", **kw)
