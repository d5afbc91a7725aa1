"""Every attention backend against the dense reference, over hypothesis-drawn steps.

A drawn case is one attention group of a step as the runner hands it to a backend: rows
(sequences or prefill blocks) sorted longest first, each with a scrambled page table of
one layer of a multi-layer pool, a context length and a query count, rows sharing one of
a few prefixes of pages (a system prompt under several adapters) or starting with pages
of their own (a batch job's request beside interactive ones), queries starting mid-page,
padding rows. Shapes come from a small
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

LAYERS, PAGES, WIDTH = 2, 72, 12  # pool layers, pages per layer (enough for 5 rows of WIDTH
# pages after three prefixes of 3), table width (pages)
ATOL = RTOL = 1e-5


@dataclasses.dataclass
class Case:
    pool: PoolLayout
    q: np.ndarray  # [rows, queries, heads, head_dim]
    k: np.ndarray  # the pool [LAYERS * PAGES, page_size, kv_heads, head_dim]
    v: np.ndarray
    group: GroupLayout
    layer: int


@st.composite
def cases(draw, *, head_dims=(16, 32)):
    ps = draw(st.sampled_from([2, 4]))
    kvh = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 3]))  # query heads per KV head (GQA)
    d = draw(st.sampled_from(head_dims))
    queries = draw(st.sampled_from([1, 4]))  # decode rows, or prefill blocks of 4
    rows = 5
    real = draw(st.integers(1, rows))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ids = iter(rng.permutation(np.arange(1, PAGES)))  # scrambled: any page, any order
    # Up to three prefixes (a system prompt under several adapters), each of 0-3 pages.
    commons = [[int(next(ids)) for _ in range(draw(st.integers(0, 3)))]
               for _ in range(draw(st.integers(1, 3)))]
    tables = np.zeros((rows, WIDTH), np.int32)
    ctx = np.zeros(rows, np.int32)
    ql = np.zeros(rows, np.int32)
    for r in range(real):
        # A row of one of the prefixes, or of its own (-1: a batch job's, say); its
        # queries sit after the prefix, anywhere in a page (chunks start mid-page).
        which = draw(st.integers(-1, len(commons) - 1))
        mine = commons[which] if which >= 0 else []
        q_len = draw(st.integers(1, queries))
        own = draw(st.integers(q_len, (WIDTH - len(mine)) * ps - 1))
        ctx[r], ql[r] = len(mine) * ps + own, q_len
        n = -(-int(ctx[r]) // ps)
        tables[r, :n] = mine + [int(next(ids)) for _ in range(n - len(mine))]
    order = np.argsort(-ctx, kind="stable")  # longest context first, padding last
    pool = PoolLayout(LAYERS, PAGES, ps, kvh, d, np.float32, WIDTH)
    shape = (rows, queries, kvh * group, d)
    return Case(pool, rng.standard_normal(shape).astype(np.float32),
                rng.standard_normal(pool.shape).astype(np.float32),
                rng.standard_normal(pool.shape).astype(np.float32),
                GroupLayout(tables[order], ctx[order], ql[order]),
                draw(st.integers(0, LAYERS - 1)))


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
    "defaults": {},  # the native kernels, where they build
    # Native, prefixes read once from 2 rows (the default only where the lane walk has
    # vectors of 16: on AVX2 from 6 rows).
    "native-prefixes-from-2": dict(min_prefix_rows=2),
    # Native, one prefix at most, read once only from 3 rows (others walk their own).
    "native-few-prefixes": dict(max_prefixes=1, min_prefix_rows=3),
    "jnp": dict(native=False),  # the jnp cascade, row groups of 8
    "jnp-no-copy-no-groups": dict(native=False, prefix_copy_tokens=0,
                                  decode_rows_per_group=64, group_prefill_blocks=False),
    # Shared blocks of 2 pages read in blocks of 1: prefixes are big blocks plus tails.
    "jnp-small-blocks": dict(native=False, pages_per_block=1, shared_pages_per_block=2,
                             decode_rows_per_group=2),
    # Segments of 2 rows, two prefixes at most (a third walks its own), one copy slot.
    "jnp-few-prefixes": dict(native=False, pages_per_block=1, shared_pages_per_block=2,
                             segment_rows=2, max_prefixes=2, prefix_copies=1),
}

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# The jnp cascade (native = false: the fallback where the native kernels do not build)
# compiles an XLA program for every case's shapes, ~1 s each on 2 cores: fewer cases
# there, so that the suite stays within its 15 minutes.
JNP_SETTINGS = settings(SETTINGS, max_examples=5)


def _matches_dense(options, c):
    backend = make_backend("cpu", c.pool, **CPU_OPTIONS[options])
    ref = reference(c)
    out = attend(backend, c, prepared(backend, c))
    np.testing.assert_allclose(out, ref, atol=ATOL, rtol=RTOL)
    assert not out[c.group.query_lens == 0].any()  # padding rows are zeros


@pytest.mark.parametrize("options", [o for o in CPU_OPTIONS if not o.startswith("jnp")])
@SETTINGS
@given(c=cases())
def test_cpu_backend_matches_dense(options, c):
    _matches_dense(options, c)


@pytest.mark.parametrize("options", [o for o in CPU_OPTIONS if o.startswith("jnp")])
@JNP_SETTINGS
@given(c=cases())
def test_cpu_jnp_cascade_matches_dense(options, c):
    _matches_dense(options, c)


@JNP_SETTINGS
@given(c=cases(), held=st.sampled_from(["all", "part", "none", "foreign"]))
def test_cpu_prefix_copy_holding_any_part_matches_dense(c, held):
    """Each copy slot holds all, part, none of its prefix, or another prefix's pages;
    whatever it lacks is gathered from the pages: the same attention."""
    backend = make_backend("cpu", c.pool, shared_pages_per_block=2, pages_per_block=1,
                           segment_rows=2, native=False)
    meta = backend.metadata(c.group)
    kv = (jnp.asarray(c.k), jnp.asarray(c.v))
    buffered = np.zeros_like(meta.buffered_len)
    copy_at = np.zeros_like(meta.copy_at)
    for i, length in enumerate(meta.shared_len):
        shared = meta.shared_pages[i, :int(length) // c.pool.page_size]
        keep = {"all": len(shared), "part": len(shared) // 2, "none": 0, "foreign": 0}[held]
        pages = shared[:keep]
        if held == "foreign":  # a prefix of other pages: nothing of this one
            pages = np.asarray([p % (PAGES - 1) + 1 for p in shared + 7], np.int32)
        slot = len(meta.shared_len) - 1 - i  # not in order: the offsets matter
        backend.copy.fill(kv, slot, pages)
        buffered[i], copy_at[i] = keep * c.pool.page_size, slot * backend.copy.tokens
    meta = meta._replace(buffered_len=buffered, copy_at=copy_at)
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


def test_the_cascade_serves_each_prefix_its_rows_share():
    """Three rows after one system prompt (pages 5, 6), two after another (pages 9, 10:
    the same prompt under an adapter), one of its own (a batch job's), one padding row:
    each prefix is read by its rows' segments, the odd row walks its own table, rows go
    longest own walk first; the same attention."""
    tables = np.array([[5, 6, 7, 0], [9, 10, 13, 0], [5, 6, 8, 0], [20, 21, 22, 0],
                       [5, 6, 12, 0], [9, 10, 14, 0], [0, 0, 0, 0]], np.int32)
    ctx = np.array([9, 10, 11, 12, 12, 9, 0], np.int32)
    ql = np.array([1, 1, 1, 1, 1, 1, 0], np.int32)
    pool = PoolLayout(1, 32, 4, 1, 8, np.float32, 4)
    backend = make_backend("cpu", pool, decode_rows_per_group=2, segment_rows=2,
                           native=False)
    meta = backend.metadata(GroupLayout(tables, ctx, ql))
    assert meta.shared_len.tolist() == [8, 8, 0, 0]  # most rows first
    assert meta.shared_pages[0, :2].tolist() == [5, 6]
    assert meta.shared_pages[1, :2].tolist() == [9, 10]
    # Own walks: 12 keys for the odd row, then 4, 3, 2, 1, 1 after the prefixes.
    assert meta.order.tolist() == [3, 4, 2, 1, 0, 5, 6]
    assert meta.shared_rows.tolist() == [0, 1, 1, 2, 1, 2, 0]
    # Prefix 0's three rows in the wide segment, prefix 1's two in a narrow one of two.
    real = [sorted(int(r) for r in s if r < 7) for part in meta.segments for s in part]
    assert [s for s in real if s] == [[1, 2, 4], [3, 5]]
    rng = np.random.default_rng(0)
    q = rng.standard_normal((7, 1, 1, 8)).astype(np.float32)
    k, v = (rng.standard_normal(pool.shape).astype(np.float32) for _ in range(2))
    out = np.asarray(backend.attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                    jnp.int32(0), meta, backend.state))
    ref = np.asarray(paged_attention_dense(q, k, v, tables, ctx, ql))
    np.testing.assert_allclose(out, ref, atol=ATOL, rtol=RTOL)
    # A prefill group shares one prefix, the one most of its rows have.
    pf = backend.metadata(GroupLayout(tables, ctx, ql), decode=False)
    assert pf.shared_len.tolist() == [8] and [s.shape for s in pf.segments] == [(1, 7)]


def test_few_decode_rows_walk_their_prefix_and_native_prefill_blocks_share_nothing():
    """A prefix fewer than `min_prefix_rows` decode rows share is walked by each row; the
    native prefill kernel walks each block's pages whole (no prefix), the jnp cascade
    reads a single block's earlier pages as a prefix, in big blocks; the same attention."""
    tables = np.array([[5, 6, 7, 0], [5, 6, 8, 0], [5, 6, 12, 0]], np.int32)
    ctx, ql = np.array([9, 11, 12], np.int32), np.array([1, 1, 1], np.int32)
    pool = PoolLayout(1, 32, 4, 1, 16, np.float32, 4)
    for rows, shared in ((4, [0]), (3, [8]), (2, [8])):
        backend = make_backend("cpu", pool, max_prefixes=1, min_prefix_rows=rows)
        assert backend.metadata(GroupLayout(tables, ctx, ql)).shared_len.tolist() == shared
    lone = GroupLayout(tables[:1], np.array([12], np.int32), np.array([3], np.int32))
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 3, 1, 16)).astype(np.float32)
    k, v = (rng.standard_normal(pool.shape).astype(np.float32) for _ in range(2))
    ref = np.asarray(paged_attention_dense(q, k, v, tables[:1], lone.context_lens,
                                           lone.query_lens))
    for native, shared in ((True, 0), (False, 8)):
        backend = make_backend("cpu", pool, native=native)
        if native and not backend.native:
            continue  # no compiler here: the jnp case below still runs
        pf = backend.metadata(lone, decode=False)
        assert int(pf.shared_len[0]) == shared
        out = np.asarray(backend.attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                        jnp.int32(0), pf, backend.state))
        np.testing.assert_allclose(out, ref, atol=ATOL, rtol=RTOL)


def test_several_prefixes_are_read_once_from_fewer_rows():
    """Two prefixes of 3 decode rows each are read as prefixes from
    `min_prefix_rows_several` 3 although `min_prefix_rows` is 4; one alone is walked by its
    rows; the attention is the same either way."""
    pool = PoolLayout(1, 32, 4, 1, 16, np.float32, 4)
    a, b = [5, 6], [9, 10]
    tables = np.array([a + [11 + i, 0] for i in range(3)] + [b + [14 + i, 0] for i in range(3)],
                      np.int32)
    ctx, ql = np.full(6, 10, np.int32), np.ones(6, np.int32)
    backend = make_backend("cpu", pool, min_prefix_rows=4, min_prefix_rows_several=3)
    meta = backend.metadata(GroupLayout(tables, ctx, ql))
    assert sorted(meta.shared_len.tolist()) == [0, 0, 8, 8]
    lone = backend.metadata(GroupLayout(tables[:4], ctx[:4], ql[:4]))
    assert lone.shared_len.tolist() == [0, 0, 0, 0]
    assert make_backend("cpu", pool, min_prefix_rows=4).metadata(
        GroupLayout(tables, ctx, ql)).shared_len.tolist() == [0, 0, 0, 0]
    rng = np.random.default_rng(3)
    q = rng.standard_normal((6, 1, 1, 16)).astype(np.float32)
    k, v = (rng.standard_normal(pool.shape).astype(np.float32) for _ in range(2))
    ref = np.asarray(paged_attention_dense(q, k, v, tables, ctx, ql))
    out = np.asarray(backend.attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                    jnp.int32(0), meta, backend.state))
    np.testing.assert_allclose(out, ref, atol=ATOL, rtol=RTOL)


def test_prefix_copy_slots_serve_several_prefixes_without_taking_turns():
    """Two copy slots, three prefixes in every step: two are copied once and stay, the
    third reads its pages; a prefix whose pages are written is cut back and refilled."""
    from pallas_kernels.cpu import PrefixCopy

    pool = PoolLayout(1, 64, 4, 1, 8, np.float32, 16)
    kv = tuple(jnp.asarray(np.random.default_rng(1).standard_normal(pool.shape),
                           jnp.float32) for _ in range(2))
    copy = PrefixCopy(pool, 16, block_tokens=8, slots=2)
    a, b, c = (np.arange(s, s + 4, dtype=np.int32) for s in (1, 10, 20))
    nothing = np.zeros(0, np.int32)
    first = copy.update(kv, nothing, [a, b, c])
    assert copy.fills == 2 and first[:2] == [(0, 16), (16, 16)] and first[2][1] == 0
    for _ in range(3):
        assert copy.update(kv, nothing, [a, b, c]) == first
    assert copy.fills == 2
    # Page 10 of prefix b is written: its slot is emptied, and the third prefix (not
    # b: its pages are being rewritten) takes it.
    copy.update(kv, np.array([10], np.int32), [a, b, c])
    assert copy.fills == 3 and list(copy.held[1]) == list(c)
    # A prefix whose later pages this very step writes (a prompt's first block, beside
    # its later blocks that share it): only the pages before them are copied.
    copy = PrefixCopy(pool, 16, block_tokens=8, slots=2)
    assert copy.update(kv, c[2:3], [c]) == [(0, 8)] and list(copy.held[0]) == list(c[:2])


def _windowed_by_hand(c: Case, window: int) -> np.ndarray:
    """Each query over the keys (its position - window, its position], gathered from its
    row's pages one by one: numpy, no code shared with the backends."""
    rows, nq, heads, d = c.q.shape
    group = heads // c.pool.kv_heads
    out = np.zeros_like(c.q)
    for r in range(rows):
        ctx, ql = int(c.group.context_lens[r]), int(c.group.query_lens[r])
        for i in range(ql):
            pos = ctx - ql + i
            keys = range(max(0, pos - window + 1), pos + 1)
            rows_at = [(c.layer * PAGES + c.group.page_tables[r, t // c.pool.page_size],
                        t % c.pool.page_size) for t in keys]
            k = np.stack([c.k[p, o] for p, o in rows_at])  # [n, kv_heads, d]
            v = np.stack([c.v[p, o] for p, o in rows_at])
            for h in range(heads):
                s = k[:, h // group] @ c.q[r, i, h] / np.sqrt(d)
                w = np.exp(s - s.max())
                out[r, i, h] = (w / w.sum()) @ v[:, h // group]
    return out


# (The jnp cascade's sliding layers are the base class's dense window, as "dense" runs.)
@pytest.mark.parametrize("name, options", [("cpu", {}), ("dense", {}),
                                           ("pallas_interpret", {})])
@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(c=cases(head_dims=(16,)), window=st.sampled_from([3, 9]))
def test_a_sliding_layer_sees_its_window_only(name, options, c, window):
    """`attend_layer` on a sliding layer reads each row through its windowed table
    (`WindowMeta`: no page before the window) and equals attention over the window's
    keys by hand; on a global layer it is `attend`, the whole causal context."""
    pool = dataclasses.replace(c.pool, window=window, window_queries=c.q.shape[1])
    backend = make_backend(name, pool, **options)
    empty = GroupLayout.empty(0, WIDTH)
    decode = c.q.shape[1] == 1
    groups = (c.group, empty) if decode else (empty, c.group)
    metas = backend.prepare_step((jnp.asarray(c.k), jnp.asarray(c.v)), groups,
                                 np.zeros(1, np.int32), [])
    meta = metas[0] if decode else metas[1]
    win = meta[1]
    assert win.page_tables.shape[1] == pool.window_pages < WIDTH or pool.window_pages == WIDTH
    args = (jnp.asarray(c.q), jnp.asarray(c.k), jnp.asarray(c.v), jnp.int32(c.layer), meta,
            backend.state)
    sliding = np.asarray(backend.attend_layer(*args, jnp.bool_(True)))
    np.testing.assert_allclose(sliding, _windowed_by_hand(c, window), atol=1e-5, rtol=1e-5)
    whole = np.asarray(backend.attend_layer(*args, False))
    np.testing.assert_allclose(whole, reference(c), atol=ATOL, rtol=RTOL)
