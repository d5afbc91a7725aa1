"""The step-cost model that caps prefill beside decodes (scheduler/step_cost.py)."""

from __future__ import annotations

import pytest

from scheduler.step_cost import StepCostModel


def model(**kw) -> StepCostModel:
    args = dict(itl_budget_s=0.05, prefill_slowdown=0.4, min_prefill_tokens=16)
    args.update(kw)
    return StepCostModel(**args)


def test_no_measurements_no_limit_and_prefill_alone_is_never_capped():
    m = model()
    assert m.prefill_budget(4) is None
    m.observe(4, 0, 0.030)
    assert m.prefill_budget(0) is None


def test_floor_until_a_prefill_step_was_measured():
    m = model()
    m.observe(4, 0, 0.030)
    assert m.prefill_budget(4) == 16


def test_budget_keeps_the_step_within_the_slowdown_bound():
    m = model(itl_budget_s=0.001)  # (the target below the decodes: the derived budget)
    m.observe(4, 0, 0.030)
    m.observe(4, 32, 0.030 + 32 * 0.001)  # 1 ms a prefill token
    budget = m.prefill_budget(4)
    assert budget == 16  # 12 ms of room is 12 tokens: the floor of 16 wins
    m.min_prefill_tokens = 1
    assert m.prefill_budget(4) == 12


def test_the_itl_target_gives_more_room_when_decoding_is_fast():
    m = model(itl_budget_s=0.05, min_prefill_tokens=1)
    m.observe(2, 0, 0.010)
    m.observe(2, 10, 0.020)  # 1 ms a token
    assert m.prefill_budget(2) == 40  # 50 ms target - 10 ms decode


def test_unmeasured_sizes_use_the_nearest_larger_measurement():
    m = model(min_prefill_tokens=1)
    m.observe(16, 0, 0.060)
    m.observe(4, 0, 0.030)
    assert m.decode_time(8) == 0.060
    assert m.decode_time(32) == 0.060
    assert m.decode_time(2) == 0.030


def _one_stream(**cfg_kw):
    """A Sim with one decoding stream and measured costs: decode-only 30 ms, 1 ms a
    prefill token (so a long prompt's chunk beside it is 12 tokens). Short prompts are
    spread however rarely they come unless `short_prefill_stall_share` is given."""
    from config.settings import SchedulerConfig

    from .fake_runner import FakeRunner
    from .sim import Sim
    from scheduler.protocol import StepLimits

    limits = StepLimits(max_decode_seqs=12, max_prefill_seqs=2, max_prefill_chunk=64,
                        max_prefill_tokens=128)
    cfg_kw.setdefault("short_prefill_stall_share", 0.0)
    cfg = SchedulerConfig(max_step_tokens=512, short_prefill_tokens=40, min_prefill_tokens=8,
                          **cfg_kw)
    sim = Sim(FakeRunner(limits=limits, num_pages=1024), cfg)
    sim.submit(range(10, 20), max_tokens=50)  # one decoding stream
    sim.step()
    cost = sim.sched.cost
    cost.observe(1, 0, 0.030)
    cost.observe(1, 10, 0.040)
    cost.itl_budget_s = 0.001  # below the decodes: the derived budget
    assert cost.prefill_budget(1) == 12  # 30 ms * 0.4 / 1 ms = 12 tokens
    return sim


def _chunks_of(sim, seq) -> list[int]:
    return [len(c.token_ids) for b in sim.batches for s, c in zip(b.seqs, b.plan.chunks)
            if s is seq and c.start_pos < seq.num_prompt_tokens]  # its prompt's chunks


def test_policy_caps_long_prompts_beside_decodes_and_spreads_short_ones_over_the_ttft():
    sim = _one_stream()
    # 1,000 tokens at 1 ms each cannot make the 1 s target at any chunk size: the pace.
    long = sim.submit(range(100, 1100))
    short = sim.submit(range(500, 530))
    for _ in range(4):
        batch = sim.step()
        sizes = {s.seq_id: len(c.token_ids) for s, c in zip(batch.seqs, batch.plan.chunks)}
        assert batch.num_decode >= 1
        assert sizes.get(long.seq_id, 0) <= 12
    # 30 tokens with plenty of the 1 s target left: two chunks of at least the pace (12).
    assert _chunks_of(sim, short) == [15, 15]
    assert [b.why for b in sim.batches[1:4]] == ["ttft", "ttft", "itl-derived"]


def test_a_long_prompt_that_the_pace_would_make_late_takes_the_chunks_its_ttft_needs():
    """300 tokens at 1 ms each beside a 30 ms decode: at the pace (12 tokens a step) its
    first token would come after 25 steps (1.05 s); it can still come within the plan's
    0.6 s of the 1 s target in 10 steps of 30 tokens."""
    sim = _one_stream()
    mid = sim.submit(range(100, 400))
    sim.step()
    assert _chunks_of(sim, mid) == [30]
    assert sim.batches[-1].why == "ttft"


def test_a_long_prompts_tail_stays_at_the_pace():
    """The last 40 tokens (short_prefill_tokens) of a 100-token prompt that has waited
    long past its TTFT target: still chunks of the pace (12), never one long step."""
    sim = _one_stream(short_prefill_stall_share=0.04)
    long = sim.submit(range(100, 200), max_tokens=1)
    sim.clock.advance(5.0)
    while long.num_computed_tokens < long.num_prompt_tokens:
        sim.step()
    chunks = _chunks_of(sim, long)
    assert sum(chunks) == 100 and max(chunks) <= 12, chunks


def test_a_short_prompt_goes_in_whole_when_its_ttft_has_no_room_left():
    sim = _one_stream()
    short = sim.submit(range(500, 530))
    # Waited 0.6 s: 0.6 s planned (60% of the 1 s target) - 0.6 leaves no room for a
    # second step.
    sim.clock.advance(0.6)
    sim.step()
    assert _chunks_of(sim, short) == [30]


def test_a_short_prompt_goes_in_whole_without_a_ttft_target_or_the_split():
    for kw in ({"ttft_target_s": 0.0}, {"split_short_prefill": False}):
        sim = _one_stream(**kw)
        short = sim.submit(range(500, 530))
        sim.step()
        assert _chunks_of(sim, short) == [30], kw


def test_a_short_prompt_alone_goes_in_whole():
    sim = _one_stream()
    while sim.sched.running:  # the stream finishes
        sim.step()
    short = sim.submit(range(500, 530))
    sim.step()
    assert _chunks_of(sim, short) == [30]


def _questions(sim, n: int, every: float = 0.0) -> list[list[int]]:
    """n 30-token questions of one answer token, one after the other, `every` seconds
    apart: each one's prompt chunks."""
    chunks = []
    for _ in range(n):
        base = 500 + 40 * len(sim.batches)
        q = sim.submit(range(base, base + 30), max_tokens=1)
        while q.num_computed_tokens < q.num_prompt_tokens:
            sim.step()
        chunks.append(_chunks_of(sim, q))
        sim.clock.advance(every)
    return chunks


def test_short_prompts_go_in_whole_while_they_come_rarely():
    # Each whole prefill makes one long gap for the stream; at 30 ms a decode step, 4% of
    # its gaps over 10 s is 13.3 such prompts: the 14th within 10 s is spread.
    sim = _one_stream(short_prefill_stall_share=0.04)
    chunks = _questions(sim, 14, every=0.3)  # 14 questions in ~5 s
    assert chunks[:13] == [[30]] * 13
    assert chunks[13] == [15, 15]
    # 10 s later the rate has fallen out of the window: whole again.
    sim.clock.advance(10.0)
    assert _questions(sim, 1) == [[30]]
    assert len(sim.sched._short_arrivals) == 1  # the 14 earlier ones have left it


def test_longer_gaps_make_each_stall_a_bigger_share():
    """Steps the streams lately took at 60 ms (a long row's walk in each, say): half as
    many gaps a second, so 7 questions within 10 s already pass 4% and the 8th is
    spread."""
    sim = _one_stream(short_prefill_stall_share=0.04)
    sim.step()  # a decode step, observed at 60 ms (the step-cost model left as it was)
    batch = sim.batches[-1]
    assert batch.num_decode == 1
    sim.sched.cost.observe = lambda *a, **k: None
    for _ in range(40):
        sim.sched.observe(batch, 0.060)
    chunks = _questions(sim, 8)
    assert chunks[:6] == [[30]] * 6
    assert chunks[7] == [15, 15]


def test_the_spread_follows_the_time_left():
    sim = _one_stream()
    short = sim.submit(range(500, 536))  # 36 tokens: up to 3 chunks of 12
    short.predicted_ttft = 0.1  # the door's
    sim.step()
    assert _chunks_of(sim, short) == [12]  # 0.6 - 0.03 - 0.036 s: 17 steps' room
    # The door's calibration will compare its first token to the plan: the step in
    # flight, 36 ms of prefill and 3 steps of 30 ms.
    assert short.predicted_ttft == pytest.approx(0.03 + 0.036 + 3 * 0.03)
    # A slow step: waited 0.61 s, past the 0.6 s planned: the rest goes in whole.
    sim.clock.advance(0.6)
    sim.step()
    assert _chunks_of(sim, short) == [12, 24]


def test_warm_up_figures_stand_in_until_a_real_step_replaces_them():
    m = StepCostModel(itl_budget_s=0.05, prefill_slowdown=0.4, min_prefill_tokens=16)
    m.seed(16, 0, 0.10)  # warm-up: a decode step of 16 rows
    m.seed(16, 256, 0.612)  # 16 rows beside 256 prompt tokens: 2 ms a token
    m.seed(0, 128, 0.30)  # ... another shape's figure joins the running average
    assert m.decode_time(8) == 0.10 and m.estimate(16, 0) == 0.10
    assert m.prefill_token_s == pytest.approx(0.002 + 0.2 * (0.30 / 128 - 0.002))
    m.observe(16, 0, 0.14)  # the first real step of the kind replaces the seed outright
    assert m.decode_time(16) == pytest.approx(0.14)
    m.observe(16, 0, 0.24)  # ... and later ones average as before
    assert m.decode_time(16) == pytest.approx(0.14 + 0.2 * 0.10)
    m.seed(16, 0, 0.01)  # a seed never overrides what was measured for real
    assert m.decode_time(16) == pytest.approx(0.16)
    m.observe(16, 64, 0.16 + 64 * 0.003)
    assert m.prefill_token_s == pytest.approx(0.003)
    m.seed(0, 64, 64 * 0.0001)
    assert m.prefill_token_s == pytest.approx(0.003)


def test_a_stale_figure_moves_with_the_shapes_measured_since():
    # (16, 16) and (4, 16) both ran in a slow moment; then only (4, 16) runs, twice as
    # fast. The stale (16, 16) follows it instead of standing at its slow figure for good
    # (under an ITL target the plan would never choose it again to correct it).
    m = model(itl_target_s=0.15, shapes=((4, 16), (16, 16)), block_q=16)
    m.observe(16, 16, 0.20, shape=(16, 16), work=1000)
    m.observe(4, 16, 0.16, shape=(4, 16), work=1000)
    assert m.predict(16, 16) == pytest.approx(0.20)  # not stale yet
    for _ in range(40):
        m.observe(4, 16, 0.08, shape=(4, 16), work=1000)
    assert m.predict(4, 16) == pytest.approx(0.08, rel=0.01)
    assert m.predict(16, 16) == pytest.approx(0.10, rel=0.02)  # 0.20 x 0.08 / 0.16
    assert m.fits(16, 16)
    # Measured again, its own figure rules.
    m.observe(16, 16, 0.14, shape=(16, 16), work=1000)
    assert m.predict(16, 16) == pytest.approx(0.20 + 0.2 * (0.14 - 0.20))


def test_shapes_in_use_keep_their_own_figures_and_the_drift_is_bounded():
    m = model(shapes=((4, 0), (16, 0)))
    for i in range(50):  # alternating: neither is ever stale
        m.observe(4, 0, 0.05, shape=(4, 0))
        m.observe(16, 0, 0.10 if i < 25 else 0.12, shape=(16, 0))
    assert m.predict(4, 0) == pytest.approx(0.05)
    m2 = model(shapes=((4, 0), (16, 0)))
    m2.observe(16, 0, 0.10, shape=(16, 0))
    m2.observe(4, 0, 0.05, shape=(4, 0))
    for _ in range(60):
        m2.observe(4, 0, 0.5, shape=(4, 0))  # 10x slower: the stale one follows, 2x at most
    assert m2.predict(16, 0) == pytest.approx(0.20)


def test_a_questions_token_cost_is_learned_from_questions_steps_only():
    """A long prompt's chunks read a long context: their token cost is not a question's."""
    m = model()
    m.observe(4, 0, 0.030)
    assert m.question_seconds(100) == 0.0  # nothing measured
    m.observe(4, 100, 0.130, questions=True)  # 1 ms a token
    m.observe(4, 64, 0.030 + 64 * 0.006)  # a long prompt's chunk: 6 ms a token
    assert m.prefill_token_s > 0.001
    assert m.question_seconds(100) == pytest.approx(0.1)
    assert model().question_seconds(10) == 0.0
    only_long = model()
    only_long.observe(4, 0, 0.030)
    only_long.observe(4, 64, 0.030 + 64 * 0.006)
    assert only_long.question_seconds(100) == pytest.approx(0.6)  # none else known
