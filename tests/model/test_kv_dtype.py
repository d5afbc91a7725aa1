"""A KV pool of bf16 on the CPU (`kv_cache_dtype = "bfloat16"`): stored as bf16 bit
patterns in uint16 and widened by the native attention kernels as they read; and of int8
(`"int8"`): each token's row of a KV head rounded over its largest magnitude, its scale
beside it. Twice (int8: 4 x 16 / 20, with this model's 16-wide heads) the tokens in the
same bytes, the numpy oracle's logits within the format's reach, no full copies of the
pool in the compiled steps, a clear refusal where nothing could read it, and "auto"
choosing bf16 beside int8 weights."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

from model.runner import ModelRunner
from cpu_kernels.native import available
from scheduler.protocol import StepPlan

from . import numpy_llama
from .test_runner import TINY, chunk, random_params

PARAMS = random_params(TINY)
KW = dict(page_size=8, kv_cache_bytes=1 << 20, max_context=512, decode_buckets=(1, 4),
          prefill_buckets=(32, 64), block_q=8, max_prefill_seqs=3)

pytestmark = pytest.mark.skipif(not available()[0], reason="the native kernels do not build")


@pytest.fixture(scope="module")
def runners():
    out = {}
    for name in ("float32", "bfloat16", "int8"):
        out[name] = ModelRunner(TINY, PARAMS, kv_cache_dtype=name, **KW)
        out[name].warmup()
    return out


def test_the_pool_holds_bf16_bits_and_twice_the_tokens(runners):
    f32, bf16 = runners["float32"], runners["bfloat16"]
    assert bf16.kv[0].dtype == jnp.uint16 and f32.kv[0].dtype == jnp.float32
    d32, d16 = f32.describe(), bf16.describe()
    assert d16["kv_cache_dtype"] == "bfloat16" and d32["kv_cache_dtype"] == "float32"
    assert d16["kv_bytes_per_token"] * 2 == d32["kv_bytes_per_token"]
    assert bf16.num_pages == 2 * f32.num_pages
    i8 = runners["int8"]
    assert i8.kv[0].dtype == jnp.int8 and i8.kv[0].shape[-1] == TINY.head_dim + 4
    assert i8.describe()["kv_bytes_per_token"] * 4 * 16 == d32["kv_bytes_per_token"] * 20


@pytest.mark.parametrize("name,tol", [("bfloat16", 0.02), ("int8", 0.03)])
def test_prefill_then_decode_match_the_oracle_within_the_format(runners, name, tol):
    """Three prompts prefilled side by side, then decoded: the logits of the bf16 and
    int8 pools stay as close to the numpy forward as their keys and values allow (bf16:
    0.2% of the largest logit here, int8: 0.7%), and the greedy tokens are the f32
    pool's."""
    rng = np.random.default_rng(3)
    ps = [rng.integers(3, 300, n).tolist() for n in (13, 30, 7)]
    pages = [[1 + 8 * i + j for j in range(8)] for i in range(3)]
    got = {}
    for key in ("float32", name):
        r = runners[key]
        res = r.step(StepPlan([chunk(i, p, 0, pages[i]) for i, p in enumerate(ps)]),
                     return_logits=True)
        seqs = [p + [res.sampled[i].token_id] for i, p in enumerate(ps)]
        dec = r.step(StepPlan([chunk(i, [s[-1]], len(s) - 1, pages[i])
                               for i, s in enumerate(seqs)]), return_logits=True)
        got[key] = (res, dec, seqs)
    res, dec, seqs = got[name]
    for i, s in enumerate(seqs):
        want = numpy_llama.forward(PARAMS, TINY, s, last_only=True)[-1]
        np.testing.assert_allclose(dec.logits[i], want, atol=tol * np.abs(want).max())
        assert dec.sampled[i].token_id == got["float32"][1].sampled[i].token_id
    assert seqs == got["float32"][2]


@pytest.mark.parametrize("name", ["bfloat16", "int8"])
def test_no_full_pool_copies_in_compiled_steps(runners, name):
    """The bit patterns and int8 rows are written with a plain scatter: no copy of the
    pool per layer (tests/model/test_runner.py has the f32 check)."""
    r = runners[name]
    rows = TINY.num_layers * r.num_pages
    ps, kvh, d = r.page_size, TINY.num_kv_heads, r.kv[0].shape[-1]
    shapes = "|".join(",".join(map(str, s)) for s in [
        (rows, ps, kvh, d), (rows, ps * kvh * d), (rows * ps, kvh, d), (rows * ps, kvh * d)])
    for b in r.programs.ready:
        text = r._steps[b].as_text()
        assert not re.findall(rf"= (?:u16|s8|bf16|f32)\[(?:{shapes})\]\S* copy\(", text), b


@pytest.mark.parametrize("name", ["bfloat16", "int8"])
def test_where_nothing_reads_the_pool_it_is_refused(name):
    with pytest.raises(ValueError, match="native kernels"):
        ModelRunner(TINY, PARAMS, kv_cache_dtype=name, attention="dense", **KW)
    with pytest.raises(ValueError, match="native kernels"):
        ModelRunner(TINY, PARAMS, kv_cache_dtype=name, attention_options={"native": False},
                    **KW)


def test_auto_is_int8_beside_native_weights():
    """The CPU's default preset (int8 weights, the native kernels there) gets the int8
    pool, and so do q4_1 weights; f32 weights keep the exact f32 pool, and "float32" or
    "bfloat16" opt out."""
    def pool(**kw):
        return ModelRunner(TINY, PARAMS, **KW, **kw).describe()["kv_cache_dtype"]
    assert pool(quantization="int8") == "int8"
    assert pool(quantization="auto") == "int8"
    assert pool(quantization="q4_1") == "int8"
    assert pool(quantization="none") == "float32"
    assert pool(quantization="int8", kv_cache_dtype="float32") == "float32"
    assert pool(quantization="int8", kv_cache_dtype="bfloat16") == "bfloat16"
    # the jnp attention reads no bit patterns: int8 weights beside it keep the f32 pool
    assert pool(quantization="int8", attention_options={"native": False}) == "float32"
