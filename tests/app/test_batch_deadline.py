"""A batch whose window is too short for background-only progress is raised and finishes
in time: the worker's pacing (`Pace`, app/batches/worker.py) driving the real scheduler
with the fake runner and a fake clock (tests/scheduler/sim.py), under interactive load
that never leaves idle capacity."""

from __future__ import annotations

from app.batches.worker import LEVELS, Pace
from config.settings import SchedulerConfig
from tests.scheduler.fake_runner import FakeRunner
from tests.scheduler.sim import Sim

CFG = SchedulerConfig(max_running=8, max_step_tokens=256, kv_reserve_pages=0)
STEP_S = 0.01  # the sim's clock advances this much per step


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + i * 7) % 900 + 1 for i in range(n)]


def run(raise_levels: bool, window_s: float = 3.0, jobs: int = 40) -> tuple[int, float, int]:
    """(batch requests done by the deadline, when the last finished, highest level)."""
    runner = FakeRunner(page_size=4, num_pages=2048)
    sim = Sim(runner, CFG)
    t0 = sim.clock()
    pace = Pace(t0, t0 + window_s)
    interactive = [sim.submit(prompt(8, i), max_tokens=20, tenant="web") for i in range(10)]
    todo = list(range(jobs))
    in_flight: dict[int, object] = {}
    done, last, top = 0, t0, 0
    k = 100
    while (todo or in_flight) and sim.clock() < t0 + 2 * window_s:
        # interactive load: a new question whenever one ends (always someone waiting)
        for s in list(interactive):
            if s in sim.finished:
                interactive.remove(s)
                interactive.append(sim.submit(prompt(8, k), max_tokens=20, tenant="web"))
                k += 1
        for j, s in list(in_flight.items()):
            if s in sim.finished:
                del in_flight[j]
                done += sim.clock() <= t0 + window_s
                last = sim.clock()
                pace.done(sim.clock())
        level = pace.update(sim.clock(), len(todo) + len(in_flight)) if raise_levels else 0
        if level > top:  # raised: withdraw what is in the engine, hand it out again
            for j, s in in_flight.items():
                sim.sched.finish(s)
                todo.insert(0, j)
            in_flight.clear()
        top = max(top, level)
        run_as = LEVELS[level]
        while todo and len(in_flight) < 4:  # the worker's max_in_flight
            j = todo.pop(0)
            in_flight[j] = sim.submit(
                prompt(6, 1000 + j), max_tokens=5, tenant="batchco", batch=run_as.background,
                priority=run_as.priority if run_as.priority is not None else 0)
        sim.step()
    return done, last - t0, top


def test_a_batch_at_risk_is_raised_and_meets_its_window():
    done, finished_after, level = run(raise_levels=True)
    assert done == 40 and finished_after <= 3.0
    assert level == len(LEVELS) - 1


def test_background_alone_would_miss_it():
    """The control: under this load, background priority alone gets nowhere in time."""
    done, _, _ = run(raise_levels=False)
    assert done < 40


def test_pace_estimates_and_risk():
    p = Pace(0.0, 1000.0)
    assert not p.at_risk(10.0, 100)  # nothing measured, little of the window used
    assert p.at_risk(300.0, 100)  # nothing measured past a fifth of it
    for t in range(100, 110):
        p.done(float(t))
    rate = p.rate(110.0)
    assert rate is not None and 0.05 < rate < 0.2
    assert p.eta(110.0, 10) is not None
    assert p.at_risk(110.0, 1000) and not p.at_risk(110.0, 5)
