"""Planning every step within an ITL target (scheduler/policy.py, scheduler/step_cost.py),
with the fake runner and a fake clock: each step "takes" what a synthetic cost function of
its compiled shape and its attention work says, and the clock moves by that much."""

from __future__ import annotations

import numpy as np
import pytest

from config.settings import SchedulerConfig
from scheduler.admission import Admission
from scheduler.api import GenerateRequest, Overloaded
from scheduler.protocol import StepLimits
from scheduler.request import Phase
from scheduler.step_cost import StepCostModel

from .fake_runner import FakeRunner
from .sim import Sim

SHAPES = tuple((d, p) for d in (4, 8, 12, 16) for p in (0, 16, 32, 48, 64, 96, 128))
LIMITS = StepLimits(max_decode_seqs=16, max_prefill_seqs=4, max_prefill_chunk=64,
                    max_prefill_tokens=64, shapes=SHAPES, block_q=16)


def seconds(shape: tuple[int, int], work: float) -> float:
    """The synthetic step time: rows and padded prompt tokens of the shape, plus keys read."""
    return 0.005 + 0.003 * shape[0] + 0.0012 * shape[1] + 4e-6 * work


def trained(cost: StepCostModel) -> None:
    """Two measurements of every shape at different contexts: the fit is then exact."""
    for shape in SHAPES:
        for work in (1_000, 20_000):
            cost.observe(shape[0], shape[1], seconds(shape, work), shape=shape, work=work)


class Driver:
    """The engine loop's order (schedule, step, observe, commit, finish) on a fake clock."""

    def __init__(self, itl: float = 0.1, strict: bool = True, **cfg) -> None:
        self.runner = FakeRunner(limits=LIMITS, num_pages=8192, page_size=16, max_context=8192)
        config = SchedulerConfig(itl_target_s=itl, itl_strict=strict, max_running=16,
                                 max_step_tokens=16 + 64, **cfg)
        self.sim = Sim(self.runner, config)
        self.sched = self.sim.sched
        trained(self.sched.cost)
        # (predicted, taken, running, decode rows) of every step
        self.steps: list[tuple[float, float, int, int]] = []
        self.batches: list = []
        self.ttft: dict[int, float] = {}

    def step(self) -> bool:
        sched, cost, clock = self.sched, self.sched.cost, self.sim.clock
        batch = sched.schedule()
        if batch is None:
            return False
        predicted = batch.predicted(cost)
        shape = cost.shape_of(batch.decode_rows, batch.prefill_padded)
        taken = seconds(shape, batch.work)
        result = self.runner.step(batch.plan)
        sched.observe(batch, taken, shape)
        clock.advance(taken)
        self.steps.append((predicted, taken, len(sched.running), batch.num_decode))
        self.batches.append(batch)
        for seq, _ in sched.commit(batch, result):
            if seq.num_generated == 1:
                self.ttft[seq.seq_id] = clock() - seq.arrived_at
            if seq.num_generated >= seq.max_tokens:
                sched.finish(seq)
        return True

    def run(self, steps: int) -> None:
        for _ in range(steps):
            if not self.step():
                return


def prompt(i: int, n: int) -> list[int]:
    return [(i * 31 + k) % 997 + 1 for k in range(n)]


def test_no_planned_step_is_predicted_past_the_target():
    d = Driver(itl=0.1)
    for i in range(40):  # a crowd of questions, more than can run at once
        d.sim.submit(prompt(i, 40 + 7 * (i % 9)), max_tokens=30 + i % 5)
    d.run(2000)
    assert all(seq.num_generated == seq.max_tokens for seq in d.sim.seqs.values())
    # Every step that carries a stream's next token is planned within the target (with
    # no stream decoding, no gap is at stake and a prompt may take the whole step).
    assert max(p for p, _, _, nd in d.steps if nd) <= 0.1 + 1e-9
    assert any(p > 0.1 for p, _, _, nd in d.steps if not nd)
    # The predictions are the steps' real times (the synthetic cost is what it learned).
    assert all(abs(p - t) < 1e-3 * t for p, t, _, _ in d.steps)
    # Not a trivially small batch either: the target holds several streams at once.
    assert max(r for _, _, r, _ in d.steps) >= 8
    assert d.sched.pages.num_in_use == 0


def test_without_a_target_the_steps_run_past_it():
    d = Driver(itl=0.0)
    for i in range(40):
        d.sim.submit(prompt(i, 40 + 7 * (i % 9)), max_tokens=30 + i % 5)
    d.run(2000)
    assert max(t for _, t, _, _ in d.steps) > 0.1  # what the target prevents


def test_the_running_set_shrinks_as_contexts_grow():
    d = Driver(itl=0.12, kv_reserve_pages=0)
    for i in range(24):
        d.sim.submit(prompt(i, 64), max_tokens=1200)
    d.run(60)
    early = max(r for _, _, r, _ in d.steps)
    d.run(1100)
    late = d.steps[-1][2]
    assert late < early
    assert max(p for p, _, _, nd in d.steps if nd) <= 0.12 + 1e-9
    assert d.sched.num_preemptions > 0 or late < early  # shrunk by preemption or not refilling


def test_a_question_is_split_across_steps_and_still_meets_its_ttft():
    d = Driver(itl=0.1, ttft_target_s=1.0)
    for i in range(6):  # six streams decoding
        d.sim.submit(prompt(i, 20), max_tokens=400)
    d.run(30)
    q = d.sim.submit(prompt(99, 70), max_tokens=5)
    before = len(d.steps)
    while q.num_generated == 0:
        assert d.step()
    pieces = [len(c.token_ids) for plan in d.runner.plans[before:] for c in plan.chunks
              if c.seq_id == q.seq_id]
    assert len(pieces) >= 2 and sum(pieces) == 70  # spread over steps
    assert d.ttft[q.seq_id] < 1.0
    assert max(p for p, _, _, nd in d.steps[before:] if nd) <= 0.1 + 1e-9


def test_both_targets_infeasible_refuses_at_once_with_a_retry_after():
    d = Driver(itl=0.1, ttft_target_s=0.5)
    sched = d.sched
    for i in range(20):
        d.sim.submit(prompt(i, 64), max_tokens=300)
    d.run(50)
    cap = sched.running_capacity
    assert 1 <= cap < sched.max_running  # the target, not max_running, holds the streams
    assert sched.num_waiting > 0
    adm = Admission(sched, sched.config, d.sim.clock, max_context=8192)
    for _ in range(5):  # completions at a known pace: one every 2 s
        d.sim.clock.advance(2.0)
        adm.completed(d.sim.clock(), 300)
    with pytest.raises(Overloaded) as e:
        adm.check(GenerateRequest(prompt_ids=prompt(7, 64), max_tokens=50))
    assert e.value.reason == "itl_target"
    assert e.value.retry_after_s > 0.5
    assert adm.rejections == {"itl_target": 1}


def test_step_cost_fit_learns_a_shape_and_the_context_slope():
    m = StepCostModel(itl_target_s=0.1, shapes=SHAPES, block_q=16)
    assert m.shape_of(5, 17) == (8, 32) and m.shape_of(16, 64) == (16, 64)
    assert m.predict(5, 32) == 0.0  # nothing measured: no limit
    trained(m)
    assert m.slope == pytest.approx(4e-6, rel=1e-3)  # the ridge shrinks it a hair
    assert m.predict(5, 32, 5_000) == pytest.approx(seconds((8, 32), 5_000), rel=1e-4)
    assert m.largest_prefill(8, 64) == 32  # 0.005 + 0.024 + 0.0384 + ... fits, 48 does not
    assert m.fits(8, 32, 5_000) and not m.fits(16, 64, 5_000)


def test_warm_up_seeds_each_shape_until_it_runs_for_real():
    m = StepCostModel(itl_target_s=0.1, shapes=SHAPES, block_q=16)
    m.seed(4, 0, 0.05)
    m.seed(4, 16, 0.149)  # a small chunk costs more a token than the coarse model says
    m.seed(16, 64, 0.4)
    assert m.predict(3, 16) == pytest.approx(0.149) and not m.fits(2, 16)
    assert m.predict(3, 16, 123_456) == pytest.approx(0.149)  # a seed's context is unknown
    m.observe(3, 10, 0.09, shape=(4, 16), work=5_000)  # the first real step replaces it
    assert m.predict(4, 16) == pytest.approx(0.09) and m.fits(2, 16)
    # A shape with neither seed nor step: the coarse model at its padded size.
    assert m.predict(8, 32) == pytest.approx(m.estimate(8, 32))


def test_a_running_prompt_is_never_stranded_by_a_slower_step_than_predicted():
    """Admitted when the prediction left room beside the decodes; then the steps turn out
    slower and nothing fits beside them: its chunks still go, one block a step."""
    d = Driver(itl=0.1)
    for i in range(4):
        d.sim.submit(prompt(i, 20), max_tokens=300)
    d.run(40)
    q = d.sim.submit(prompt(99, 64), max_tokens=5)
    d.step()
    assert q.is_running
    cost = d.sched.cost
    for shape in SHAPES:  # every step now predicted at 0.2 s: nothing fits 0.1 s
        cost.observe(shape[0], shape[1], 0.2, shape=shape, work=1_000)
        cost._fits[shape] = type(cost._fits[shape])(n=1, seconds=0.2, work=1_000)
    steps = 0
    while q.num_generated == 0:
        assert d.step()
        steps += 1
    assert steps <= 4  # 16 tokens a step


def test_running_prompts_under_a_target_are_ahead_of_a_newcomer():
    """Beside the decodes a step has little room for prompts, and the running ones take
    it first: a newcomer's first token waits for them (without a target it would not)."""
    d = Driver(itl=0.1, ttft_target_s=1.0)
    for i in range(3):
        d.sim.submit(prompt(i, 20), max_tokens=400)
    d.run(20)
    for i in range(2):
        d.sim.submit(prompt(10 + i, 400), max_tokens=50)
    d.step()
    sched = d.sched
    assert sched.num_running == 5 and sched.num_waiting == 0  # nothing queued
    assert sched.running_capacity > 5  # and a slot free
    assert sched.prefill_backlog > 700
    adm = Admission(sched, sched.config, d.sim.clock, max_context=8192)
    with pytest.raises(Overloaded) as e:
        adm.check(GenerateRequest(prompt_ids=prompt(50, 40), max_tokens=20))
    assert e.value.reason == "ttft_target" and e.value.retry_after_s > 0
    sched.itl_target = 0.0  # without a strict target a newcomer's chunk goes beside a
    assert sched.prefill_backlog == 0  # long prompt's (which keeps to the pace) ...
    # ... but after a short one's (here: most of one's prompt served by the cache)
    seq = next(s for s in sched.running.values() if s.phase is Phase.PREFILL)
    seq.num_cached_tokens = seq.num_tokens - 200
    assert sched.prefill_backlog == seq.num_tokens - seq.num_computed_tokens > 0


def test_seeds_are_scaled_by_how_the_shapes_that_ran_compare_with_theirs():
    """The warm-up ran every shape on a dummy context; a shape the plan avoids because its
    seed looks too slow would never run to correct it: the ones that did run say by how
    much the seeds are off."""
    m = StepCostModel(itl_target_s=0.1, shapes=SHAPES, block_q=16)
    m.seed(4, 0, 0.10)
    m.seed(4, 16, 0.16)
    assert not m.fits(4, 16)
    m.observe(4, 0, 0.05, shape=(4, 0), work=1_000)  # real decode steps: half the seed
    assert m.predict(4, 16) == pytest.approx(0.08) and m.fits(4, 16)


def test_a_shape_not_yet_run_is_guessed_from_real_steps_so_the_running_set_can_grow():
    """Seeds from the warm-up's dear dummy context can all look over the target while the
    workload's real steps are cheap (rows sharing a system prompt): a shape that has not
    run is then predicted from the real steps, so the plan tries it, and its own measured
    figure rules from then on."""
    m = StepCostModel(itl_target_s=0.1, shapes=SHAPES, block_q=16)
    for d in (4, 16):
        m.seed(d, 0, 0.09)
        m.seed(d, 16, 0.24)  # every mixed shape looks over the target
    m.observe(1, 0, 0.05, shape=(4, 0), work=2_000)  # seeds scaled by 0.56: still over
    m.observe(0, 16, 0.03, shape=(4, 16), work=32_000)  # a question after a cached prompt
    assert m.predict(4, 16) == pytest.approx(0.03)  # its own figure
    assert m.predict(16, 16) == pytest.approx(0.05 + 16 * m.prefill_token_s)  # not 0.13
    assert m.fits(16, 16)
    m.observe(16, 16, 0.15, shape=(16, 16), work=40_000)  # it ran: dearer than the guess
    assert m.predict(16, 16) == pytest.approx(0.15) and not m.fits(16, 16)
    # Without a target (admission's TTFT predictions) the scaled seed stands.
    m.itl_target_s = 0.0
    m._fits[(16, 0)] = type(m._fits[(16, 0)])(seconds=0.09, seeded=True, seed=0.09)
    assert m.predict(16, 0) == pytest.approx(0.09 * m._seed_ratio)


def test_capacity_counts_up_and_stops_at_the_first_step_over_the_target():
    d = Driver(itl=0.1)
    cost, sched = d.sched.cost, d.sched
    assert sched.running_capacity > 1
    for shape in SHAPES:
        if shape[0] == 4 and shape[1]:  # a step of 2-4 streams and a chunk: over
            cost._fits[shape] = type(cost._fits[shape])(n=1, seconds=0.2, work=1_000)
    # (16, 16) still looks cheap, but the running set can only grow through 2, 3, 4.
    assert cost.fits(16, 16, 1_000) and sched.running_capacity == 1


def test_a_jittery_shape_does_not_set_the_context_slope():
    """A shape whose work barely varies while its step times jitter (a decode and a short
    chunk on a busy host: +-800 keys, +-30 ms) would set the slope by chance covariance
    (unweighted, these 20 seeded runs gave 0 to 4x the real slope); weighted by each
    shape's unexplained variance, the shape whose work spans a range carries the fit."""
    true, ratios = 1e-6, []
    for seed in range(20):
        m = StepCostModel(itl_target_s=0.15, shapes=SHAPES, block_q=16)
        rng = np.random.default_rng(seed)
        for i in range(30):
            work = 30_000 + 500 * (i % 20)  # a question's chunks at growing offsets
            m.observe(0, 64, 0.05 + true * work + rng.normal(0, 0.002), shape=(16, 64),
                      work=work)
            w = 34_000 + int(rng.integers(-800, 800))
            m.observe(3, 16, 0.12 + true * w + rng.normal(0, 0.03), shape=(4, 16), work=w)
        ratios.append(m.slope / true)
    assert max(abs(r - 1) for r in ratios) < 0.5, ratios


def test_the_room_kept_for_prompts_follows_the_first_tokens_and_the_questions():
    """Under an ITL target every step keeps room for prompts beside the decodes: a block
    more while the first tokens come later than the TTFT target allows, up to what the
    90th percentile of recent questions needs to meet it; a block less once they come
    early. More room, fewer streams at once."""
    d = Driver(itl=0.1, ttft_target_s=1.0)
    sched = d.sched
    assert sched.reserved_chunk() == 16  # min_prefill_tokens
    small_room = sched.running_capacity
    for _ in range(8):
        sched.note_ttft(1.5)  # late, but no question seen yet: nothing to size the room by
    assert sched.reserved_chunk() == 16
    for i in range(8):
        d.sim.submit(prompt(i, 160), max_tokens=8)
    d.sim.submit(prompt(8, 2000), max_tokens=8)  # a document (2.4 s alone): not counted
    # 0.9 s of the target at 0.1 s a step, less the step in flight: 8 steps for 160
    # tokens, 20 a step: two 16-token blocks at most.
    assert len(sched.question_sizes) == 8
    for _ in range(8):
        sched.note_ttft(1.2)
    assert sched.reserved_chunk() == 32
    assert sched.running_capacity <= small_room
    for _ in range(16):
        sched.note_ttft(1.2)
    assert sched.reserved_chunk() == 32  # no more than the questions need
    for _ in range(8):
        sched.note_ttft(0.3)
    assert sched.reserved_chunk() == 32  # half the last 16 still late
    for _ in range(8):
        sched.note_ttft(0.3)
    assert sched.reserved_chunk() == 16  # early: the room goes back to the streams
    d.run(400)
    assert all(seq.num_generated == seq.max_tokens for seq in d.sim.seqs.values())
