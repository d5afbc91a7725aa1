"""Packing a plan into a bucket's arrays, and picking buckets: pure numpy, nothing compiled."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from model.packing import Bucket, dummy_layout, pack, sample_rows, split
from model.programs import Programs, background_order
from scheduler.protocol import SamplingParams, SeqChunk, StepPlan

PS, BQ, WIDTH = 4, 8, 10


def chunk(seq, toks, start, pages, sample=True):
    return SeqChunk(seq, list(toks), start, pages, sample, SamplingParams(temperature=0.0))


def test_split_sorts_groups_longest_first_and_sizes_the_bucket():
    plan = StepPlan([chunk(0, [5], 3, [1]), chunk(1, [6], 9, [2, 3, 4]),
                     chunk(2, range(10), 0, [5, 6, 7]), chunk(3, range(3), 20, [8] * 6)])
    dec, pf, need = split(plan, max_decode_rows=4, block_q=BQ)
    assert [c.seq_id for c in dec] == [1, 0]  # context 10 before 4
    assert [c.seq_id for c in pf] == [3, 2]  # reaching 23 before 10
    assert need == Bucket(2, 8 + 16)  # 3 tokens -> one block, 10 -> two
    # Past the largest decode bucket, one-token chunks go to the prefill group (the plan's
    # order says which decode: the scheduler puts the most urgent first).
    dec, pf, need = split(plan, max_decode_rows=1, block_q=BQ)
    assert [c.seq_id for c in dec] == [0] and need == Bucket(1, 8 + 8 + 16)


def test_pack_lays_out_tokens_slots_groups_and_samples():
    plan = StepPlan([chunk(0, [5], 6, [3, 9]), chunk(1, range(20, 30), 2, [4, 7, 2],
                                                         sample=False),
                     chunk(2, [40, 41, 42], 0, [6])])
    dec, pf, _ = split(plan, max_decode_rows=4, block_q=BQ)
    lay = pack(dec, pf, Bucket(2, 32), page_size=PS, block_q=BQ, pages_per_seq=WIDTH,
               n_samples=4)
    assert lay.tokens.shape == (34,) and lay.real_tokens == 14
    # Decode row 0 (row 1 is padding): token 5 at position 6, page 9 offset 2.
    assert (lay.tokens[0], lay.positions[0], lay.slots[0]) == (5, 6, 9 * PS + 2)
    np.testing.assert_array_equal(lay.decode.context_lens, [7, 0])
    np.testing.assert_array_equal(lay.decode.query_lens, [1, 0])
    np.testing.assert_array_equal(lay.decode.page_tables[0, :3], [3, 9, 0])
    # Prefill: seq 1's 10 tokens from position 2 (two blocks of 8 and 2), then seq 2's 3.
    np.testing.assert_array_equal(lay.tokens[2:12], range(20, 30))
    np.testing.assert_array_equal(lay.positions[2:12], range(2, 12))
    pos = np.arange(2, 12)
    np.testing.assert_array_equal(lay.slots[2:12], np.array([4, 7, 2])[pos // PS] * PS
                                  + pos % PS)
    np.testing.assert_array_equal(lay.prefill.context_lens, [10, 12, 3, 0])
    np.testing.assert_array_equal(lay.prefill.query_lens, [8, 2, 3, 0])
    np.testing.assert_array_equal(lay.tokens[18:21], [40, 41, 42])
    # Samples: the decode row, then the last token of seq 2 (seq 1's chunk samples nothing).
    assert [c.seq_id for c in lay.samples] == [0, 2]
    np.testing.assert_array_equal(lay.sample_idx[:2], [0, 20])
    assert not lay.slots[12:18].any() and not lay.slots[21:].any()  # padding -> slot 0


def test_sample_rows_round_up_to_powers_of_two():
    assert sample_rows(Bucket(1, 0), 16, 4) == 1
    assert sample_rows(Bucket(0, 48), 16, 4) == 4  # 3 chunks at most
    assert sample_rows(Bucket(16, 256), 16, 4) == 32  # 16 + 4
    assert sample_rows(Bucket(4, 0), 16, 4) == 4


def test_dummy_layout_touches_only_the_null_page():
    lay = dummy_layout(Bucket(2, 16), block_q=BQ, pages_per_seq=WIDTH, n_samples=4,
                       context=30)
    assert not lay.slots.any() and not lay.decode.page_tables.any()
    assert not lay.prefill.page_tables.any()
    np.testing.assert_array_equal(lay.prefill.context_lens, [30, 30])


def fake_programs(buckets, log=None, gate=None):
    def build(b):
        if gate is not None:
            gate.wait()
        if log is not None:
            log.append(b)
    return Programs(buckets, build)


BUCKETS = [Bucket(d, 0) for d in (1, 4, 16)] + [Bucket(d, p) for d in (4, 16)
                                                  for p in (16, 64, 256)]


def test_pick_takes_the_cheapest_ready_bucket_that_holds_the_step():
    p = fake_programs(BUCKETS)
    assert p.pick(Bucket(1, 0)) is None  # nothing ready
    p.compile(BUCKETS)
    assert p.pick(Bucket(1, 0)) == Bucket(1, 0)
    assert p.pick(Bucket(3, 0)) == Bucket(4, 0)
    assert p.pick(Bucket(0, 20)) == Bucket(4, 64)
    assert p.pick(Bucket(5, 10)) == Bucket(16, 16)
    assert p.pick(Bucket(17, 0)) is None


def test_essential_holds_every_plan_and_the_first_prompt():
    p = fake_programs(BUCKETS)
    assert p.maximal == [Bucket(16, 256)]
    assert p.essential(Bucket(0, 40)) == [Bucket(16, 256), Bucket(1, 0), Bucket(4, 64)]
    p.compile(p.essential(Bucket(0, 40)))
    # Until the rest is compiled every step still has a bucket, padded.
    assert p.pick(Bucket(4, 0)) == Bucket(4, 64) and p.pick(Bucket(16, 0)) == Bucket(16, 256)
    assert p.remaining == len(BUCKETS) - 3


def test_background_compile_fills_in_the_rest_in_order():
    log, gate = [], threading.Event()
    p = fake_programs(BUCKETS, log, gate)
    gate.set()
    p.compile(p.essential())
    done = threading.Event()
    p.compile_in_background(on_done=done.set)
    assert done.wait(10) and p.remaining == 0
    rest = log[2:]
    assert rest == sorted(rest, key=background_order)
    assert rest[0] == Bucket(4, 0)  # decode-only shapes first
    assert p.pick(Bucket(3, 10)) == Bucket(4, 16)


def test_a_set_without_the_largest_pair_still_holds_every_plan_it_can():
    p = fake_programs([Bucket(1, 0), Bucket(8, 0), Bucket(0, 128), Bucket(0, 512)])
    assert sorted(p.maximal) == [Bucket(0, 512), Bucket(8, 0)]
    with pytest.raises(ValueError):
        Programs([], lambda b: None)
