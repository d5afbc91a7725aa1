"""LoRA adapter slots as a scheduled resource: residency, LRU swaps, no starvation,
unloading, and token-for-token outputs with the fake runner (whose tokens depend on the
adapter its slot holds at the step)."""

from __future__ import annotations

from config.settings import SchedulerConfig
from scheduler.adapters import AdapterSlots

from .fake_runner import FakeRunner
from .sim import Sim

CFG = SchedulerConfig(max_running=8, max_step_tokens=128, kv_reserve_pages=0)


def prompt(n: int, seed: int = 1) -> list[int]:
    return [(seed * 31 + i * 7) % 997 + 1 for i in range(n)]


def test_slots_pin_reuse_and_evict_least_recently_used():
    s = AdapterSlots(2)
    assert s.acquire("a") == (0, True) and s.acquire("b") == (1, True)
    assert s.acquire("a") == (0, False)  # resident: no load
    assert not s.available("c")  # both pinned
    s.release("b")
    assert s.available("c") and s.acquire("c") == (1, True)  # b was idle: replaced
    assert (s.loads, s.swaps) == (3, 1)
    s.release("a"), s.release("a"), s.release("c")
    assert s.acquire("b") == (0, True)  # a used less recently than c


def test_mixed_adapters_give_each_request_its_own_tokens():
    runner = FakeRunner(page_size=4, num_pages=128, adapter_slots=2)
    sim = Sim(runner, CFG)
    names = [None, "red", "blue", "green", None, "red"]
    seqs = [sim.submit(prompt(9, i), max_tokens=6, adapter=n) for i, n in enumerate(names)]
    sim.run()
    for seq, name in zip(seqs, names):
        assert seq.output_ids == runner.reference(seq.prompt_ids, 6, adapter=name), name
    stats = sim.sched.adapters.stats()
    assert stats["loads"] >= 3 and stats["swaps"] >= 1  # three adapters, two slots
    assert stats["tokens"] == {"red": 12, "blue": 6, "green": 6}
    assert stats["running"] == {} and stats["waiting"] == {}


def test_an_adapter_waiting_for_a_slot_is_not_starved():
    """Two slots pinned by long-running adapters; a third adapter's request waits, base
    requests go ahead meanwhile, and later requests of the resident adapters do not
    overtake it: it runs as soon as a pinned slot drains."""
    runner = FakeRunner(page_size=4, num_pages=256, adapter_slots=2)
    sim = Sim(runner, CFG)
    hogs = [sim.submit(prompt(5, i), max_tokens=20, adapter=n)
            for i, n in enumerate(["a", "b"])]
    sim.step()
    starved = sim.submit(prompt(5, 7), max_tokens=3, adapter="c")
    base = sim.submit(prompt(5, 8), max_tokens=3)
    late = [sim.submit(prompt(5, 9 + i), max_tokens=3, adapter=n)
            for i, n in enumerate(["a", "b"])]
    sim.run()
    assert base.admitted_at < starved.admitted_at  # base went ahead while c waited
    assert all(starved.admitted_at <= s.admitted_at for s in late)  # nobody overtook c
    for seq, name in zip([*hogs, starved, *late], ["a", "b", "c", "a", "b"]):
        assert seq.output_ids == runner.reference(seq.prompt_ids, seq.max_tokens,
                                                  adapter=name)


def test_unloaded_adapter_is_dropped_once_its_last_sequence_ends():
    runner = FakeRunner(page_size=4, num_pages=128, adapter_slots=1)
    sim = Sim(runner, CFG)
    running = sim.submit(prompt(5), max_tokens=5, adapter="old")
    queued = sim.submit(prompt(5, 2), max_tokens=2, adapter="old")
    sim.step()
    assert not sim.sched.adapters.retire("old")  # still needed: two live sequences
    sim.run()
    assert runner.dropped == ["old"]  # at the end of the last one
    assert sim.sched.adapters.holder == [None]
    assert running.output_ids == runner.reference(running.prompt_ids, 5, adapter="old")
    assert queued.output_ids == runner.reference(queued.prompt_ids, 2, adapter="old")
    assert AdapterSlots(1).retire("never-used")  # nothing needs it: drop at once


def test_prefix_cache_never_crosses_adapters():
    """The same prompt under the base model, adapter a, adapter b, then a again: only the
    second run under a hits the cache (pages computed under another adapter would give
    the wrong tokens, which the fake runner would show)."""
    runner = FakeRunner(page_size=4, num_pages=128, adapter_slots=2)
    sim = Sim(runner, CFG)
    p = prompt(17)
    hits = []
    for name in [None, "a", "b", "a"]:
        seq = sim.submit(p, max_tokens=3, adapter=name)
        sim.run()
        hits.append(seq.num_cached_tokens)
        assert seq.output_ids == runner.reference(p, 3, adapter=name), name
    assert hits[:3] == [0, 0, 0] and hits[3] >= 16
