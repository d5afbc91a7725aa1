"""Cascade (shared-prefix) attention in the jnp reference equals plain paged attention."""

from __future__ import annotations

import numpy as np
import pytest

from pallas_kernels import paged_attention_reference
from pallas_kernels.reference import gather_prefix


# spb: the shared prefix's big block in pages; when it is larger than ppb, a prefix that is
# not a whole number of big blocks is read as big blocks and a tail of small ones.
@pytest.mark.parametrize("spb_factor", [1, 4])
@pytest.mark.parametrize("nq,shared_pages,ppb,longest", [
    (1, 5, 2, 9), (1, 4, 2, 9), (4, 3, 4, 9), (1, 0, 2, 9), (3, 7, 8, 9),
    # The longest sequence fills its whole table (16 pages) and its own pages start
    # mid-block: the last own block reaches past the table's end.
    (1, 5, 4, 44), (2, 3, 8, 52)])
def test_shared_prefix_matches_plain(nq, shared_pages, ppb, longest, spb_factor):
    rng = np.random.default_rng(nq * 100 + shared_pages)
    ps, kvh, h, d, npages, s = 4, 2, 6, 8, 80, 3
    kp = rng.standard_normal((npages, ps, kvh, d)).astype(np.float32)
    vp = rng.standard_normal((npages, ps, kvh, d)).astype(np.float32)
    pps = 16
    perm = list(rng.permutation(np.arange(1, npages)))
    common = [int(perm.pop()) for _ in range(shared_pages)]
    ql = np.array([nq, max(1, nq - 1), nq], np.int32)
    suffix = [3, longest, 1]  # tokens after the shared prefix, this step's queries included
    ctx = np.array([shared_pages * ps + n for n in suffix], np.int32)
    pt = np.zeros((s, pps), np.int32)
    for i in range(s):
        own = [int(perm.pop()) for _ in range(-(-int(ctx[i]) // ps) - shared_pages)]
        pt[i, :shared_pages + len(own)] = common + own
    ql = np.minimum(ql, np.array(suffix, np.int32))
    q = rng.standard_normal((s, nq, h, d)).astype(np.float32)
    plain = paged_attention_reference(q, kp, vp, pt, ctx, ql, pages_per_block=ppb)
    spb = ppb * spb_factor
    shared = np.zeros(pps, np.int32)
    shared[:shared_pages] = common
    cascade = paged_attention_reference(q, kp, vp, pt, ctx, ql, shared, np.int32(
        shared_pages * ps), pages_per_block=ppb, shared_pages_per_block=spb)
    np.testing.assert_allclose(np.asarray(cascade), np.asarray(plain), atol=2e-6)
    # Rows walked in groups (each group only as far as its longest row): the same result.
    grouped = paged_attention_reference(q, kp, vp, pt, ctx, ql, shared, np.int32(
        shared_pages * ps), pages_per_block=ppb, shared_pages_per_block=spb, rows_per_group=2)
    np.testing.assert_allclose(np.asarray(grouped), np.asarray(plain), atol=2e-6)
    # Groups of given sizes (the runner's halving groups for prefill blocks): the same.
    halving = paged_attention_reference(q, kp, vp, pt, ctx, ql, shared, np.int32(
        shared_pages * ps), pages_per_block=ppb, shared_pages_per_block=spb,
        rows_per_group=(2, 1))
    np.testing.assert_allclose(np.asarray(halving), np.asarray(plain), atol=2e-6)
    # The prefix read from a contiguous copy (the runner's prefix buffer): the same result.
    sblk = min(spb, pps) * ps
    tokens = max(sblk, -(-shared_pages * ps // sblk) * sblk)
    kv = gather_prefix(kp, vp, shared[:tokens // ps], tokens=tokens)
    buffered = paged_attention_reference(q, kp, vp, pt, ctx, ql, shared, np.int32(
        shared_pages * ps), kv, pages_per_block=ppb, shared_pages_per_block=spb,
        rows_per_group=2)
    np.testing.assert_allclose(np.asarray(buffered), np.asarray(plain), atol=2e-6)
    # The copy holds only part of the prefix (the rest gathered from the pages), or
    # another prefix altogether (all of this one gathered): still the same result.
    for held in sorted({shared_pages // 2, 0}):
        other = shared.copy()
        other[held:] = np.roll(other[held:], 1) + 1  # differs from page `held` on
        kv = gather_prefix(kp, vp, other[:tokens // ps], tokens=tokens)
        part = paged_attention_reference(q, kp, vp, pt, ctx, ql, shared, np.int32(
            shared_pages * ps), kv, np.int32(held * ps), pages_per_block=ppb,
            shared_pages_per_block=spb, rows_per_group=2)
        np.testing.assert_allclose(np.asarray(part), np.asarray(plain), atol=2e-6)
