"""The native attention kernels' portable build (no AVX-512: a CI machine may be one)
against the dense reference: prefill blocks, and a shared prefix then each row's own
pages, over f32 pools and over pools of bf16 bit patterns. The default build is checked through the CPU backend (test_backends.py);
here too where it reads a bf16 pool through the AMX tile unit (queries and weights
rounded to bf16: within bf16's precision of the reference, and the build without AMX
exactly as before)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import native, paged_attention_dense


def _case(rows, queries, seed, bits=False, d=16, ps=4, width=8, g=3, ctx=()):
    """`bits`: the pools hold bf16 bit patterns (uint16), the reference reads the same
    values widened to f32. `ctx`: the first rows' context lengths (else random)."""
    rng = np.random.default_rng(seed)
    kvh = 2
    pages = 3 + rows * (width - 2)
    pool = (pages, ps, kvh, d)
    k, v = (rng.standard_normal(pool).astype(np.float32) for _ in range(2))
    if bits:
        k, v = (np.asarray(jnp.asarray(a, jnp.bfloat16)) for a in (k, v))
    ids = rng.permutation(np.arange(1, pages))
    tables = np.zeros((rows, width), np.int32)
    tables[:, :2] = ids[:2]  # every row starts with the same two pages (2 ps keys)
    tables[:, 2:] = ids[2:2 + rows * (width - 2)].reshape(rows, width - 2)
    ctx_of = ctx
    ctx = rng.integers(2 * ps + queries, width * ps, rows).astype(np.int32)
    ctx[:len(ctx_of)] = ctx_of
    ql = np.full(rows, queries, np.int32)
    ctx[-1] = ql[-1] = 0  # a padding row
    q = rng.standard_normal((rows, queries, kvh * g, d)).astype(np.float32)
    ref = np.asarray(paged_attention_dense(q, k, v, tables, ctx, ql))
    qg = jnp.asarray(q * d ** -0.5).reshape(rows, queries, kvh, g, d)
    if bits:
        k, v = k.view(np.uint16), v.view(np.uint16)
    return qg, jnp.asarray(k), jnp.asarray(v), tables, ctx, ql, ref


@pytest.mark.parametrize("bits", [False, True], ids=["f32-pool", "bf16-bits-pool"])
def test_portable_prefill_matches_dense(portable, bits):
    qg, k, v, tables, ctx, ql, ref = _case(5, 7, 0, bits)
    for target in (native.PREFILL_TARGET, portable[native.PREFILL_TARGET]):
        out = native.prefill_attention(qg, k, v, 0, tables, ctx, ql, target=target)
        np.testing.assert_allclose(np.asarray(out).reshape(ref.shape), ref,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [False, True], ids=["f32-pool", "bf16-bits-pool"])
def test_portable_prefix_then_own_pages_match_dense(portable, bits):
    qg, k, v, tables, ctx, ql, ref = _case(20, 1, 1, bits)  # 20 rows x 3 heads: two tasks
    shared = np.zeros((2, tables.shape[1]), np.int32)
    shared[0, :2] = tables[0, :2]
    rows_of = np.where(ql > 0, 1, 0).astype(np.int32)
    rows_of[::3] = 0  # some rows walk the prefix themselves
    start = np.where(rows_of > 0, 8, 0).astype(np.int32)
    for pre, dec in ((native.PREFIX_TARGET, native.ATTENTION_TARGET),
                     (portable[native.PREFIX_TARGET], portable[native.ATTENTION_TARGET])):
        m, l, acc = native.prefix_attention(qg[:, 0], k, v, 0, shared,
                                            np.array([8, 0], np.int32), rows_of, target=pre)
        out = native.decode_attention(qg[:, 0], k, v, 0, tables, start, ctx, m, l, acc,
                                      target=dec)
        np.testing.assert_allclose(np.asarray(out).reshape(ref.shape), ref,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("g", [3, 9], ids=["group-of-3", "group-of-9-read-at-run-time"])
def test_long_rows_walk_in_spans_merged_and_independent_of_their_batch(g):
    """Rows of up to 2,500 keys: their own keys walked in spans of 1,024 positions shared
    by the threads and merged (one row continuing a 16-key prefix, so that its first
    span starts mid-span), as the dense reference; each row's result bit for bit what it
    is alone (its spans do not depend on the other rows)."""
    qg, k, v, tables, ctx, ql, ref = _case(4, 1, 5, True, d=64, ps=16, width=160, g=g,
                                           ctx=[2500, 700, 1030])
    shared = np.zeros((2, tables.shape[1]), np.int32)
    shared[0, :1] = tables[0, :1]
    rows_of = np.array([0, 0, 1, 0], np.int32)
    start = np.array([0, 0, 16, 0], np.int32)
    m, l, acc = native.prefix_attention(qg[:, 0], k, v, 0, shared,
                                        np.array([16, 0], np.int32), rows_of)
    out = np.asarray(native.decode_attention(qg[:, 0], k, v, 0, tables, start, ctx, m, l,
                                             acc))
    np.testing.assert_allclose(out.reshape(ref.shape), ref, atol=1e-5, rtol=1e-5)
    for r in range(4):
        one = slice(r, r + 1)
        alone = native.decode_attention(qg[one, 0], k, v, 0, tables[one], start[one],
                                        ctx[one], m[one], l[one], acc[one])
        np.testing.assert_array_equal(np.asarray(alone)[0], out[r])


def _bf16_close(out, ref):
    """Within what rounding the queries and the softmax weights to bf16 costs."""
    out = np.asarray(out).reshape(ref.shape)
    assert np.abs(out - ref).max() <= 2e-2 * np.abs(ref).max()


@pytest.mark.parametrize("ps", [16, 4], ids=["pages-of-16", "blocks-across-pages"])
def test_amx_prefill_on_bf16_pool(noamx, ps):
    """d = 64 (the tile unit's path where the CPU has it): 7 queries x 3 heads per row
    (NV = 2), causal within the block, keys gathered across pages."""
    qg, k, v, tables, ctx, ql, ref = _case(5, 7, 2, True, d=64, ps=ps, width=64 // ps * 3)
    amx = native.prefill_attention(qg, k, v, 0, tables, ctx, ql)
    _bf16_close(amx, ref)
    out = native.prefill_attention(qg, k, v, 0, tables, ctx, ql,
                                   target=noamx[native.PREFILL_TARGET])
    np.testing.assert_allclose(np.asarray(out).reshape(ref.shape), ref, atol=1e-5, rtol=1e-5)
    if native.available()[1] == "amx":  # the tile unit's path was the one taken
        assert np.abs(np.asarray(amx) - np.asarray(out)).max() > 1e-5


@pytest.mark.parametrize("rows", [20, 5], ids=["three-vectors", "one-vector"])
def test_amx_prefix_then_own_pages_on_bf16_pool(noamx, rows):
    qg, k, v, tables, ctx, ql, ref = _case(rows, 1, 3, True, d=64, ps=16, width=6)
    shared = np.zeros((2, tables.shape[1]), np.int32)
    shared[0, :2] = tables[0, :2]
    rows_of = np.where(ql > 0, 1, 0).astype(np.int32)
    start = np.where(rows_of > 0, 32, 0).astype(np.int32)
    for pre, dec, check in (
            (native.PREFIX_TARGET, native.ATTENTION_TARGET, _bf16_close),
            (noamx[native.PREFIX_TARGET], noamx[native.ATTENTION_TARGET],
             lambda out, ref: np.testing.assert_allclose(
                 np.asarray(out).reshape(ref.shape), ref, atol=1e-5, rtol=1e-5))):
        m, l, acc = native.prefix_attention(qg[:, 0], k, v, 0, shared,
                                            np.array([32, 0], np.int32), rows_of, target=pre)
        check(native.decode_attention(qg[:, 0], k, v, 0, tables, start, ctx, m, l, acc,
                                      target=dec), ref)


def test_amx_walks_split_in_parts_read_their_blocks_in_place():
    """Walks of ~1,600 keys over pages of 16: split over the thread pool in parts that
    start at multiples of 32 keys, each part's whole blocks read in place in the pool and
    its tail gathered; merged, within bf16's precision of the reference."""
    qg, k, v, tables, ctx, ql, ref = _case(3, 5, 4, True, d=64, ps=16, width=100)
    assert ctx.max() > 2 * 512
    _bf16_close(native.prefill_attention(qg, k, v, 0, tables, ctx, ql), ref)
