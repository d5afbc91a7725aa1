"""Batch jobs in idle capacity: beside interactive decodes they take only the step's
slack, they give up slots and pages to interactive arrivals, they leave a KV reserve,
and their queue does not count against interactive requests. Outputs stay exact."""

from __future__ import annotations

from config.settings import SchedulerConfig

from .fake_runner import FakeRunner
from .sim import Sim
from .test_admission import door

CFG = SchedulerConfig(max_running=16, max_step_tokens=256, kv_reserve_pages=0,
                      itl_target_s=0)


def bucketed_costs(sim: Sim) -> None:
    """Measured decode step times as a bucketed runner gives them: 8 decodes cost what 5
    do, a 9th jumps to the 16 bucket; 1 ms a prefill token."""
    cost = sim.sched.cost
    for n in range(1, 17):
        cost.observe(n, 0, 0.04 if n <= 4 else 0.06 if n <= 8 else 0.10)
    cost.observe(4, 100, 0.04 + 0.1)


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 37 + i * 11) % 900 + 1 for i in range(n)]


def test_batch_takes_only_the_slack_beside_interactive_decodes():
    runner = FakeRunner(page_size=4, num_pages=512)
    sim = Sim(runner, CFG)
    bucketed_costs(sim)
    inter = [sim.submit(prompt(8, i), max_tokens=30) for i in range(6)]
    jobs = [sim.submit(prompt(8, 100 + i), max_tokens=12, batch=True) for i in range(10)]
    mixed_steps = 0
    while sim.step() is not None:
        b = sim.batches[-1]
        n_int = sum(1 for s in b.seqs[:b.num_decode] if not s.batch)
        if n_int and any(s.batch for s in b.seqs):
            mixed_steps += 1
            # beside 5-8 interactive decodes, batch decodes only fill the 8 bucket, and
            # batch prefill gets what is left of 10% of the step (6 tokens at 1 ms)
            if n_int > 4:
                assert b.num_decode <= 8, [(s.batch, s.seq_id) for s in b.seqs]
            pf = sum(len(c.token_ids) for c, s in zip(b.plan.chunks, b.seqs)
                     if s.batch and s not in b.seqs[:b.num_decode])
            assert pf <= 6
    assert mixed_steps > 0  # batch work made progress while interactive streams ran
    for s in inter + jobs:
        assert s.output_ids == runner.reference(s.prompt_ids, s.max_tokens)


def test_interactive_arrival_takes_a_batch_slot_at_once():
    cfg = SchedulerConfig(max_running=4, max_step_tokens=256, kv_reserve_pages=0)
    runner = FakeRunner(page_size=4, num_pages=512)
    sim = Sim(runner, cfg)
    jobs = [sim.submit(prompt(8, i), max_tokens=20, batch=True) for i in range(4)]
    for _ in range(3):
        sim.step()
    assert len(sim.sched.running) == 4
    user = sim.submit(prompt(8, 50), max_tokens=5)
    sim.step()
    assert user.is_running or user in sim.finished  # admitted in the very next step
    assert sim.sched.num_preemptions == 1
    sim.run()
    for s in jobs + [user]:
        assert s.output_ids == runner.reference(s.prompt_ids, s.max_tokens)


def test_interactive_arrival_takes_batch_pages():
    cfg = SchedulerConfig(max_running=8, max_step_tokens=256, kv_reserve_pages=0,
                          batch_kv_reserve=0.0)
    runner = FakeRunner(page_size=4, num_pages=41)  # 40 usable pages
    sim = Sim(runner, cfg)
    jobs = [sim.submit(prompt(30, i), max_tokens=8, batch=True) for i in range(4)]
    sim.step()
    assert sim.sched.pages.num_available < 12
    user = sim.submit(prompt(44, 9), max_tokens=4)  # needs 12 pages
    sim.step()
    assert user.is_running
    sim.run()
    for s in jobs + [user]:
        assert s.output_ids == runner.reference(s.prompt_ids, s.max_tokens)


def test_batch_leaves_the_kv_reserve_free():
    cfg = SchedulerConfig(max_running=8, max_step_tokens=512, kv_reserve_pages=0,
                          batch_kv_reserve=0.5)
    runner = FakeRunner(page_size=4, num_pages=41)
    sim = Sim(runner, cfg)
    for i in range(4):
        sim.submit(prompt(30, i), max_tokens=2, batch=True)  # 8 pages each
    sim.step()
    assert sim.sched.pages.num_available >= 20  # two admitted, half the pool kept free
    assert len(sim.sched.running) == 2
    sim.run()
    assert len(sim.finished) == 4


def test_queued_batch_work_does_not_fill_the_interactive_queue():
    adm, sched, _ = door(num_waiting=64, waiting_tokens=10_000, batch_waiting=64,
                         batch_waiting_tokens=10_000)
    from scheduler.api import GenerateRequest, Overloaded

    adm.check(GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=4))  # admitted
    try:
        adm.check(GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=4, batch=True))
    except Overloaded as e:
        assert e.reason == "queue_full"
    else:
        raise AssertionError("a 65th batch request was queued")
