"""The sampler's truncation without a sort, against the sort-based definition, and its
draw.

`keep_mask` finds top-k, top-p and min-p by bisection on probability thresholds (a sort
of the vocabulary cost 220 ms a step on the CPU), narrowed to the vocabulary's blocks
that can still matter after its first steps; on random rows of varied sharpness it
must keep exactly the tokens the textbook sort keeps: the k most probable, the smallest
most-probable set holding `top_p` of the mass, those at least `min_p` x the most
probable, the most probable always.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from model.sampling import keep_mask


def _by_sorting(p, top_k, top_p, min_p):
    order = np.argsort(-p, kind="stable")
    sp = p[order].astype(np.float64)
    keep = np.ones(len(p), bool)
    if top_k > 0:
        keep &= np.arange(len(p)) < top_k
    if top_p < 1.0:
        keep &= np.cumsum(sp) - sp < top_p
    keep &= sp >= min_p * sp[0]
    keep[0] = True
    out = np.zeros(len(p), bool)
    out[order] = keep
    return out


def test_keep_mask_equals_the_sort_definition():
    """Batches of 64 rows of mixed cuts, then rows one at a time (a search no row asks
    for is skipped)."""
    rng = np.random.default_rng(0)
    vocab = 500
    mask = jax.jit(keep_mask)
    for i in range(20):
        rows = 64 if i < 10 else 1
        logits = rng.standard_normal((rows, vocab)) * rng.uniform(0.5, 6)
        p = np.exp(logits - logits.max(1, keepdims=True))
        p = (p / p.sum(1, keepdims=True)).astype(np.float32)
        top_k = np.where(rng.random(rows) < 0.3, 0, rng.integers(1, 50, rows)).astype(np.int32)
        top_p = np.where(rng.random(rows) < 0.3, 1.0, rng.uniform(0.05, 1, rows)).astype(
            np.float32)
        min_p = np.where(rng.random(rows) < 0.5, 0.0, rng.uniform(0, 0.3, rows)).astype(
            np.float32)
        got = np.asarray(mask(p, top_k, top_p, min_p))
        for r in range(rows):
            want = _by_sorting(p[r], top_k[r], top_p[r], min_p[r])
            assert (got[r] == want).all(), (r, top_k[r], top_p[r], min_p[r])


def test_keep_mask_over_candidate_blocks_equals_the_sort_definition():
    """A vocabulary of 32 blocks: rows peaked enough that the search narrows to the
    blocks above its bound after its first steps, mixed with flat ones that keep it on
    the whole vocabulary; the same tokens kept as the sort keeps."""
    rng = np.random.default_rng(1)
    vocab, rows = 8192, 16
    mask = jax.jit(keep_mask)
    for i in range(8):
        logits = rng.standard_normal((rows, vocab)) * rng.uniform(0.5, 2)
        peaked = rng.random(rows) < (0.9 if i % 2 else 0.5)
        for r in np.flatnonzero(peaked):
            logits[r, rng.integers(0, vocab, 6)] += rng.uniform(8, 16, 6)
        p = np.exp(logits - logits.max(1, keepdims=True))
        p = (p / p.sum(1, keepdims=True)).astype(np.float32)
        top_k = np.where(rng.random(rows) < 0.5, 0, rng.integers(1, 8, rows)).astype(np.int32)
        top_p = np.where(rng.random(rows) < 0.2, 1.0, rng.uniform(0.3, 0.99, rows)).astype(
            np.float32)
        min_p = np.zeros(rows, np.float32)
        got = np.asarray(mask(p, top_k, top_p, min_p))
        for r in range(rows):
            want = _by_sorting(p[r], top_k[r], top_p[r], min_p[r])
            assert (got[r] == want).all(), (i, r, top_k[r], top_p[r])


def test_sample_full_draws_each_row_from_what_it_keeps():
    """The draw (one uniform number a row, through the kept tokens' cumulative mass):
    only kept tokens come out, at their renormalised frequencies; a seeded row draws
    the same token whatever its batch mates."""
    from model.sampling import sample_full, sampling_batch
    from scheduler.protocol import SamplingParams

    vocab, n = 64, 4000
    logits = np.log(np.r_[0.5, 0.3, 0.15, np.full(vocab - 3, 0.05 / (vocab - 3))])
    chunk = SimpleNamespace(sampling=SamplingParams(temperature=1.0, top_p=0.9),
                            num_generated=0, constraint=None, penalty_token_ids=[],
                            prompt_token_ids=[])
    sb = sampling_batch([chunk] * n, n, 1, np.random.default_rng(1), vocab)
    packed = np.asarray(jax.jit(sample_full)(jnp.asarray(np.tile(logits, (n, 1)),
                                                         jnp.float32), sb))
    tokens = packed[:, 0].astype(int)
    assert set(tokens) <= {0, 1, 2}  # top-p 0.9: 0.5 + 0.3 < 0.9 <= 0.95
    freq = np.bincount(tokens, minlength=3)[:3] / n
    assert np.allclose(freq, np.r_[0.5, 0.3, 0.15] / 0.95, atol=0.03), freq
    np.testing.assert_allclose(packed[0, 1], np.log(0.5) if tokens[0] == 0 else
                               logits[tokens[0]], rtol=1e-5)
    seeded = SimpleNamespace(**{**vars(chunk), "sampling": SamplingParams(
        temperature=1.0, seed=7)})
    rows = [np.asarray(jax.jit(sample_full)(
        jnp.asarray(np.tile(logits, (m, 1)), jnp.float32),
        sampling_batch([seeded] + [chunk] * (m - 1), m, 1, np.random.default_rng(m),
                       vocab)))[0, 0] for m in (1, 3, 8)]
    assert rows[0] == rows[1] == rows[2]


def test_greedy_pack_argmax_in_blocks_and_top_only_when_asked():
    """The greedy sampler's two-level argmax is `jnp.argmax` (ties: the first; vocabularies
    that are and are not multiples of the block), its logprob the log-softmax's, and
    the top-20 are filled only when `top` is set (zeros otherwise)."""
    from model.sampling import TOP_LOGPROBS, sample_greedy

    rng = np.random.default_rng(1)
    f = jax.jit(sample_greedy)
    for n in (49152, 32000, 3000, 700):
        x = (rng.standard_normal((6, n)) * 3).astype(np.float32)
        x[1] = 0.5  # every token tied
        x[2, [n - 1, 17]] = 40.0  # tied maxima far apart
        x[3, n - 1] = 40.0  # the last token, in a padded block
        x[4, :n // 2] = -np.inf  # masked half
        want = np.asarray(jnp.argmax(jnp.asarray(x), axis=-1))
        lsm = np.asarray(jax.nn.log_softmax(jnp.asarray(x), axis=-1))
        for top in (False, True):
            packed = np.asarray(f(jnp.asarray(x), np.bool_(top)))
            assert (packed[:, 0].astype(np.int64) == want).all(), (n, top)
            np.testing.assert_allclose(packed[:, 1], lsm[np.arange(6), want], atol=1e-5)
            tops = packed[:, 2 + TOP_LOGPROBS:]
            if top:
                ids = packed[:, 2:2 + TOP_LOGPROBS].astype(np.int64)
                np.testing.assert_allclose(tops, np.take_along_axis(lsm, ids, 1), atol=1e-5)
                np.testing.assert_allclose(tops[:, 0], lsm.max(1), atol=1e-5)
            else:
                assert (packed[:, 2:] == 0).all()
