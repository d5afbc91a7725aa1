"""Every attention backend against the dense reference, over hypothesis-drawn steps.

A drawn case is one attention group of a step as the runner hands it to a backend: rows
(sequences or prefill blocks) sorted longest first, each with a scrambled page table of
one layer of a multi-layer pool, a context length and a query count, the rows sharing a
prefix of pages or not (or only some of them: others start with pages of their own, as
an adapter's or a batch job's request beside interactive ones), queries starting
mid-page, padding rows. Shapes come from a small
set (each new shape compiles); lengths, tables, prefixes and the layer are values.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels import GroupLayout, PoolLayout, make_backend, paged_attention_dense

LAYERS, PAGES, WIDTH = 2, 48, 12  # pool layers, pages per layer, table width (pages)
ATOL = RTOL = 1e-5


@dataclasses.dataclass
class Case:
    pool: PoolLayout
    q: np.ndarray  # [rows, queries, heads, head_dim]
    k: np.ndarray  # the pool [LAYERS * PAGES, page_size, kv_heads, head_dim]
    v: np.ndarray
    group: GroupLayout
    layer: int
    shared_pages: int  # pages the sharing rows' tables start with


@st.composite
def cases(draw, *, head_dims=(16, 32)):
    ps = draw(st.sampled_from([2, 4]))
    kvh = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 3]))  # query heads per KV head (GQA)
    d = draw(st.sampled_from(head_dims))
    queries = draw(st.sampled_from([1, 4]))  # decode rows, or prefill blocks of 4
    rows = 4
    real = draw(st.integers(1, rows))
    shared = draw(st.integers(0, 4))
    outsiders = draw(st.integers(0, 2))  # real rows whose tables do not start with it
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ids = iter(rng.permutation(np.arange(1, PAGES)))  # scrambled: any page, any order
    common = [int(next(ids)) for _ in range(shared)]
    tables = np.zeros((rows, WIDTH), np.int32)
    ctx = np.zeros(rows, np.int32)
    ql = np.zeros(rows, np.int32)
    for r in range(real):
        # Queries sit after the shared prefix, anywhere in a page (chunks start mid-page).
        q_len = draw(st.integers(1, queries))
        own = draw(st.integers(q_len, (WIDTH - shared) * ps - 1))
        ctx[r], ql[r] = shared * ps + own, q_len
        n = -(-int(ctx[r]) // ps)
        mine = common if r >= outsiders else []
        tables[r, :n] = mine + [int(next(ids)) for _ in range(n - len(mine))]
    order = np.argsort(-ctx, kind="stable")  # longest context first, padding last
    pool = PoolLayout(LAYERS, PAGES, ps, kvh, d, np.float32, WIDTH)
    shape = (rows, queries, kvh * group, d)
    return Case(pool, rng.standard_normal(shape).astype(np.float32),
                rng.standard_normal(pool.shape).astype(np.float32),
                rng.standard_normal(pool.shape).astype(np.float32),
                GroupLayout(tables[order], ctx[order], ql[order]),
                draw(st.integers(0, LAYERS - 1)), shared if real > 1 else 0)


def reference(c: Case) -> np.ndarray:
    tables = c.group.page_tables + c.layer * PAGES
    return np.asarray(paged_attention_dense(c.q, c.k, c.v, tables, c.group.context_lens,
                                            c.group.query_lens))


def attend(backend, c: Case, meta) -> np.ndarray:
    return np.asarray(backend.attend(jnp.asarray(c.q), jnp.asarray(c.k), jnp.asarray(c.v),
                                     jnp.int32(c.layer), meta, backend.state))


def prepared(backend, c: Case):
    """Metadata as the runner gets it: `prepare` with the group in its place."""
    empty = GroupLayout.empty(0, WIDTH)
    groups = (c.group, empty) if c.q.shape[1] == 1 else (empty, c.group)
    meta = backend.prepare((jnp.asarray(c.k), jnp.asarray(c.v)), groups,
                           np.zeros(1, np.int32), [])
    return meta[0] if c.q.shape[1] == 1 else meta[1]


CPU_OPTIONS = {
    "defaults": {},
    "no-copy-no-groups": dict(prefix_copy_tokens=0, decode_rows_per_group=64,
                              group_prefill_blocks=False),
    # Shared blocks of 2 pages read in blocks of 1: prefixes are big blocks plus tails.
    "small-blocks": dict(pages_per_block=1, shared_pages_per_block=2, decode_rows_per_group=2),
}

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("options", list(CPU_OPTIONS))
@SETTINGS
@given(c=cases())
def test_cpu_backend_matches_dense(options, c):
    backend = make_backend("cpu", c.pool, **CPU_OPTIONS[options])
    ref = reference(c)
    out = attend(backend, c, prepared(backend, c))
    np.testing.assert_allclose(out, ref, atol=ATOL, rtol=RTOL)
    assert not out[c.group.query_lens == 0].any()  # padding rows are zeros


@SETTINGS
@given(c=cases(), held=st.sampled_from(["all", "part", "none", "foreign"]))
def test_cpu_prefix_copy_holding_any_part_matches_dense(c, held):
    """The prefix copy holds all, part, none of the group's shared prefix, or another
    prefix; whatever it lacks is gathered from the pages: the same attention."""
    backend = make_backend("cpu", c.pool, shared_pages_per_block=2, pages_per_block=1)
    meta = backend.metadata(c.group)
    shared = meta.shared_pages[:int(meta.shared_len) // c.pool.page_size]
    keep = {"all": len(shared), "part": len(shared) // 2, "none": 0,
            "foreign": 0}[held]
    pages = shared[:keep]
    if held == "foreign":  # a prefix of other pages: nothing of this one
        pages = np.asarray([p % (PAGES - 1) + 1 for p in shared + 7], np.int32)
    backend.copy.fill((jnp.asarray(c.k), jnp.asarray(c.v)), pages)
    covered = keep if held != "foreign" else 0
    meta = meta._replace(buffered_len=np.int32(covered * c.pool.page_size))
    np.testing.assert_allclose(attend(backend, c, meta), reference(c), atol=ATOL, rtol=RTOL)


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(c=cases(head_dims=(16,)))
def test_pallas_interpret_matches_dense(c):
    backend = make_backend("pallas_interpret", c.pool)
    np.testing.assert_allclose(attend(backend, c, prepared(backend, c)), reference(c),
                               atol=ATOL, rtol=RTOL)


def test_dense_reference_by_hand():
    """The oracle itself, on a case small enough to write out: one KV head, two queries of
    a sequence of 3 keys in pages of 2 (page table [5, 2])."""
    k = np.zeros((8, 2, 1, 2), np.float32)
    v = np.zeros((8, 2, 1, 2), np.float32)
    k[5, 0, 0], k[5, 1, 0], k[2, 0, 0] = [1, 0], [0, 1], [1, 1]
    v[5, 0, 0], v[5, 1, 0], v[2, 0, 0] = [1, 0], [0, 1], [2, 2]
    q = np.array([[[[0, 0]], [[2, 0]]]], np.float32)  # queries at positions 1 and 2
    out = np.asarray(paged_attention_dense(q, k, v, np.array([[5, 2]], np.int32),
                                           np.array([3], np.int32), np.array([2], np.int32)))
    np.testing.assert_allclose(out[0, 0, 0], [0.5, 0.5], atol=1e-6)  # equal weights on 2 keys
    s = np.exp(np.array([2, 0, 2]) / np.sqrt(2))  # scores of query 2 against the 3 keys
    expect = (s[0] * np.array([1, 0]) + s[1] * np.array([0, 1]) + s[2] * 2) / s.sum()
    np.testing.assert_allclose(out[0, 1, 0], expect, atol=1e-6)


def test_the_cascade_serves_the_rows_most_tables_start_like():
    """Three rows after one system prompt (pages 5, 6), one of another prefix (a batch
    job's), one padding row: the three go first and share the cascade, the fourth walks
    its own table; the same attention."""
    from pallas_kernels.cpu import sharing_rows

    tables = np.array([[5, 6, 7, 0], [5, 6, 8, 0], [9, 10, 11, 0], [5, 6, 12, 0],
                       [0, 0, 0, 0]], np.int32)
    ctx = np.array([9, 10, 11, 12, 0], np.int32)
    ql = np.array([1, 1, 1, 1, 0], np.int32)
    assert sharing_rows(tables, ctx, ql, 4).tolist() == [True, True, False, True, False]
    pool = PoolLayout(1, 16, 4, 1, 8, np.float32, 4)
    backend = make_backend("cpu", pool, decode_rows_per_group=2)
    group = GroupLayout(tables, ctx, ql)
    meta = backend.metadata(group)
    assert int(meta.shared_len) == 8 and meta.shared_pages[:2].tolist() == [5, 6]
    assert meta.order.tolist() == [0, 1, 3, 2, 4] and meta.shared_rows.tolist() == [
        1, 1, 1, 0, 0]
    rng = np.random.default_rng(0)
    q = rng.standard_normal((5, 1, 1, 8)).astype(np.float32)
    k, v = (rng.standard_normal(pool.shape).astype(np.float32) for _ in range(2))
    out = np.asarray(backend.attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                    jnp.int32(0), meta, backend.state))
    ref = np.asarray(paged_attention_dense(q, k, v, tables, ctx, ql))
    np.testing.assert_allclose(out, ref, atol=ATOL, rtol=RTOL)
    # A fourth row as long as the others but of another prefix: sharing would walk as
    # many keys as not (one row group of 8), so no cascade.
    long = GroupLayout(tables, np.array([9, 10, 12, 12, 0], np.int32), ql)
    assert int(make_backend("cpu", pool).metadata(long).shared_len) == 0
