"""Each native target's attention kernels (tests/cpu_kernels/native_targets.py: the portable loops,
AVX2, AVX-512, AVX-512 BF16, AMX, where this CPU runs them) against the dense reference: prefill blocks, and a shared prefix then each row's own
pages, over f32 pools, pools of bf16 bit patterns and int8 pools (each row's scale after
it). The default build is checked through the CPU backend (test_backends.py);
here too where it reads a bf16 pool through the AMX tile unit (queries and weights
rounded to bf16: within bf16's precision of the reference, and the build without AMX
exactly as before)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import native
from pallas_kernels import paged_attention_dense
from tests.cpu_kernels import native_targets as targets


def _int8_rows(x):
    """x [..., d] as an int8 pool stores it, by numpy: each row rounded over its largest
    magnitude, its f32 scale's 4 bytes after it; and the values that stands for."""
    scale = np.abs(x).max(-1, keepdims=True).astype(np.float32) / np.float32(127)
    scale = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.round(x / scale), -127, 127).astype(np.int8)
    rows = np.concatenate([q, scale.astype("<f4").view(np.int8)], axis=-1)
    return rows, q.astype(np.float32) * scale


def _case(rows, queries, seed, bits=False, d=16, ps=4, width=8, g=3, ctx=(), int8=False):
    """`bits`: the pools hold bf16 bit patterns (uint16), `int8`: int8 rows and their
    scales; the reference reads the same values as f32. `ctx`: the first rows' context
    lengths (else random)."""
    rng = np.random.default_rng(seed)
    kvh = 2
    pages = 3 + rows * (width - 2)
    pool = (pages, ps, kvh, d)
    k, v = (rng.standard_normal(pool).astype(np.float32) for _ in range(2))
    if bits:
        k, v = (np.asarray(jnp.asarray(a, jnp.bfloat16)) for a in (k, v))
    if int8:
        (k8, k), (v8, v) = _int8_rows(k), _int8_rows(v)
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
    if int8:
        k, v = k8, v8
    return qg, jnp.asarray(k), jnp.asarray(v), tables, ctx, ql, ref


POOLS = [dict(), dict(bits=True), dict(int8=True)]
POOL_IDS = ["f32-pool", "bf16-bits-pool", "int8-pool"]


def _rounded_close(out, ref):
    """Within what rounding the queries costs: to bf16 (the AMX walk, its softmax weights
    too) or to int8 in blocks of 32 (the int8-dot walk): 2^-8 or 1/254 of their largest."""
    out = np.asarray(out).reshape(ref.shape)
    assert np.abs(out - ref).max() <= 2e-2 * np.abs(ref).max()


def _exact(out, ref):
    np.testing.assert_allclose(np.asarray(out).reshape(ref.shape), ref, atol=1e-5, rtol=1e-5)


def _check(kind, dots: bool):
    """How close a walk over pool `kind` comes to the dense reference: exact but where an
    int8 pool's keys are scored with int8 dots (`dots`: the build has them)."""
    return _rounded_close if kind.get("int8") and dots else _exact


@pytest.mark.parametrize("kind", POOLS, ids=POOL_IDS)
def test_each_target_prefill_matches_dense(target_build, kind):
    qg, k, v, tables, ctx, ql, ref = _case(5, 7, 0, **kind)
    for target, dots in ((native.PREFILL_TARGET, native.int8_dots()),
                         (target_build[native.PREFILL_TARGET], target_build.int8_dots)):
        out = native.prefill_attention(qg, k, v, 0, tables, ctx, ql, target=target)
        _check(kind, dots)(out, ref)


@pytest.mark.parametrize("kind", POOLS, ids=POOL_IDS)
def test_each_target_prefix_then_own_pages_match_dense(target_build, kind):
    qg, k, v, tables, ctx, ql, ref = _case(20, 1, 1, **kind)  # 20 rows x 3 heads: two tasks
    shared = np.zeros((2, tables.shape[1]), np.int32)
    shared[0, :2] = tables[0, :2]
    rows_of = np.where(ql > 0, 1, 0).astype(np.int32)
    rows_of[::3] = 0  # some rows walk the prefix themselves
    start = np.where(rows_of > 0, 8, 0).astype(np.int32)
    own = (target_build[native.PREFIX_TARGET], target_build[native.ATTENTION_TARGET],
           target_build.int8_dots)
    for pre, dec, dots in ((native.PREFIX_TARGET, native.ATTENTION_TARGET,
                            native.int8_dots()), own):
        m, l, acc = native.prefix_attention(qg[:, 0], k, v, 0, shared,
                                            np.array([8, 0], np.int32), rows_of, target=pre)
        out = native.decode_attention(qg[:, 0], k, v, 0, tables, start, ctx, m, l, acc,
                                      target=dec)
        _check(kind, dots)(out, ref)


@pytest.mark.parametrize("g,int8", [(3, False), (9, False), (3, True)],
                         ids=["group-of-3", "group-of-9-read-at-run-time", "int8-pool"])
def test_long_rows_walk_in_spans_merged_and_independent_of_their_batch(g, int8):
    """Rows of up to 2,500 keys: their own keys walked in spans of 1,024 positions shared
    by the threads and merged (one row continuing a 16-key prefix, so that its first
    span starts mid-span), as the dense reference; each row's result bit for bit what it
    is alone (its spans do not depend on the other rows)."""
    qg, k, v, tables, ctx, ql, ref = _case(4, 1, 5, not int8, d=64, ps=16, width=160, g=g,
                                           ctx=[2500, 700, 1030], int8=int8)
    shared = np.zeros((2, tables.shape[1]), np.int32)
    shared[0, :1] = tables[0, :1]
    rows_of = np.array([0, 0, 1, 0], np.int32)
    start = np.array([0, 0, 16, 0], np.int32)
    m, l, acc = native.prefix_attention(qg[:, 0], k, v, 0, shared,
                                        np.array([16, 0], np.int32), rows_of)
    out = np.asarray(native.decode_attention(qg[:, 0], k, v, 0, tables, start, ctx, m, l,
                                             acc))
    _check(dict(int8=int8), native.int8_dots())(out, ref)
    for r in range(4):
        one = slice(r, r + 1)
        alone = native.decode_attention(qg[one, 0], k, v, 0, tables[one], start[one],
                                        ctx[one], m[one], l[one], acc[one])
        np.testing.assert_array_equal(np.asarray(alone)[0], out[r])


@pytest.mark.parametrize("ps", [16, 4], ids=["pages-of-16", "blocks-across-pages"])
def test_amx_prefill_on_bf16_pool(noamx, ps):
    """d = 64 (the tile unit's path where the CPU has it): 7 queries x 3 heads per row
    (NV = 2), causal within the block, keys gathered across pages."""
    qg, k, v, tables, ctx, ql, ref = _case(5, 7, 2, True, d=64, ps=ps, width=64 // ps * 3)
    amx = native.prefill_attention(qg, k, v, 0, tables, ctx, ql)
    _rounded_close(amx, ref)
    out = native.prefill_attention(qg, k, v, 0, tables, ctx, ql,
                                   target=noamx[native.PREFILL_TARGET])
    _exact(out, ref)
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
            (native.PREFIX_TARGET, native.ATTENTION_TARGET, _rounded_close),
            (noamx[native.PREFIX_TARGET], noamx[native.ATTENTION_TARGET],
             _exact)):
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
    _rounded_close(native.prefill_attention(qg, k, v, 0, tables, ctx, ql), ref)


@pytest.mark.parametrize("d,rows", [(64, 4), (48, 7), (64, 16)],
                         ids=["one-vector", "two-vectors-half-block", "three-vectors"])
def test_int8_dots_within_query_rounding_of_the_f32_walk(d, rows):
    """Where the build scores int8 pools with int8 dots (AVX-512 VNNI), a shared prefix
    of 32 keys and prefill blocks over it (odd lengths: a chunk ends mid-pair) come within
    the queries' int8 rounding (blocks of 32; d = 48 ends in a block of 16), with the
    values in f32 and, where the build has AVX-512 BF16, two keys an instruction in bf16,
    of the same build's f32 walk, which matches the dense reference exactly; the switches
    restore the defaults."""
    if not native.int8_dots():
        pytest.skip("this build has no int8 dots (the CPU lacks AVX-512 VNNI)")
    qg, k, v, tables, ctx, ql, ref = _case(rows, 3, 7, d=d, ps=16, width=10, int8=True,
                                           ctx=[151] * rows)
    lib = native.load()
    bf16 = bool(lib.sluice_lane_values_bf16(-1))
    shared = np.zeros((2, tables.shape[1]), np.int32)
    shared[0, :2] = tables[0, :2]
    rows_of = np.where(ql > 0, 1, 0).astype(np.int32)
    outs = {}
    try:
        for dots, values in ((0, 0), (1, 0), (1, 1)):
            lib.sluice_lane_int8_dots(dots)
            lib.sluice_lane_values_bf16(values)
            m, l, acc = native.prefix_attention(qg[:, 0], k, v, 0, shared,
                                                np.array([31, 0], np.int32), rows_of)
            outs[dots, values] = (
                np.asarray(acc) / np.maximum(np.asarray(l), 1e-30)[..., None],
                np.asarray(native.prefill_attention(qg, k, v, 0, tables, ctx, ql)))
    finally:
        lib.sluice_lane_int8_dots(1)
        lib.sluice_lane_values_bf16(1)
    assert native.int8_dots() and lib.sluice_lane_values_bf16(-1) == int(bf16)
    _exact(outs[0, 0][1], ref)
    prefix_f32 = outs[0, 0][0]
    for key in ((1, 0), (1, 1)):
        _rounded_close(outs[key][1], ref)
        prefix = outs[key][0]
        assert np.abs(prefix - prefix_f32).max() <= 2e-2 * np.abs(prefix_f32).max()
        assert np.abs(prefix - prefix_f32).max() > 0  # the int8 dots were taken
    if bf16:  # the bf16 values were taken
        assert np.abs(outs[1, 1][0] - outs[1, 0][0]).max() > 0


def test_the_engine_writes_int8_rows_as_the_kernels_read_them():
    """`backends.to_pool` (the step's write) against this file's numpy rows: the same
    values and scales (XLA may round the scale's division in its last bit, and so a
    value at a rounding boundary by one), laid out as the kernels read them (values,
    then the scale's 4 bytes, little-endian); `from_pool` the values they stand for; a
    row of zeros keeps scale 1."""
    from pallas_kernels.backends import from_pool, to_pool

    x = np.random.default_rng(7).standard_normal((5, 2, 64)).astype(np.float32) * 3
    x[0, 1] = 0
    rows, values = _int8_rows(x)
    got = np.asarray(to_pool(jnp.asarray(x), np.int8))
    assert got.shape == (5, 2, 68) and got.dtype == np.int8
    scale = got[..., 64:].copy().view("<f4")[..., 0]
    np.testing.assert_allclose(scale, rows[..., 64:].copy().view("<f4")[..., 0], rtol=1e-6)
    assert scale[0, 1] == 1 and not got[0, 1, :64].any()
    diff = np.abs(got[..., :64].astype(int) - rows[..., :64])
    assert diff.max() <= 1 and (diff == 0).mean() > 0.99
    back = np.asarray(from_pool(jnp.asarray(got), 64))
    np.testing.assert_allclose(back, got[..., :64] * scale[..., None], rtol=1e-6)
    assert np.abs(back - x).max() <= np.abs(x).max() / 127 / 2 * 1.01


def test_this_machine_exercises_every_target_its_cpu_runs(record_property):
    """Names the targets this run exercised (also in the report header): each one the
    CPU can run builds, says which paths it took, and takes the attention walk of its
    vector width; the others are named with the reason they skip."""
    widths = {"portable": 1, "avx2": 8, "avx512": 16, "avx512-bf16": 16, "amx": 16}
    exercised = []
    for name in targets.runnable():
        try:
            b = targets.build(name)
        except pytest.skip.Exception:  # AMX that the OS does not grant
            continue
        assert b.lib.sluice_lane_width() == widths[name], name
        assert b.lib.sluice_q8_avx512() == (name in ("avx512-bf16", "amx")), name
        assert b.lib.sluice_q8_amx() == (name == "amx"), name
        exercised.append(name)
    assert "portable" in exercised  # every x86 runs it
    record_property("native_targets", ",".join(exercised))
    print(targets.header())
