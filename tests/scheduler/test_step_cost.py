"""The step-cost model that caps prefill beside decodes (scheduler/step_cost.py)."""

from __future__ import annotations

from scheduler.step_cost import StepCostModel


def model(**kw) -> StepCostModel:
    args = dict(itl_target_s=0.05, prefill_slowdown=0.4, min_prefill_tokens=16)
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
    m = model(itl_target_s=0.0)
    m.observe(4, 0, 0.030)
    m.observe(4, 32, 0.030 + 32 * 0.001)  # 1 ms a prefill token
    budget = m.prefill_budget(4)
    assert budget == 16  # 12 ms of room is 12 tokens: the floor of 16 wins
    m.min_prefill_tokens = 1
    assert m.prefill_budget(4) == 12


def test_itl_target_gives_more_room_when_decoding_is_fast():
    m = model(itl_target_s=0.05, min_prefill_tokens=1)
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
