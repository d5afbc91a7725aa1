"""Random workloads against the whole policy with a tiny page pool (so preemption, prefix
hits and copy-on-write all happen) and two LoRA adapter slots for three adapters (so
swaps happen): the books always balance, every finished sequence generated exactly what
an unbatched run under its adapter generates, and nothing leaks at the end."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from config.settings import SchedulerConfig
from scheduler.protocol import StepLimits
from scheduler.request import Phase

from .fake_runner import FakeRunner
from .sim import Sim

SYSTEM = [5, 6, 7, 8, 9, 10, 11, 12]  # two pages of 4: a shared prefix


class PolicyMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        runner = FakeRunner(page_size=4, num_pages=17, vocab=50, adapter_slots=2,
                            limits=StepLimits(max_decode_seqs=6, max_prefill_seqs=2,
                                              max_prefill_chunk=6, max_prefill_tokens=8))
        self.sim = Sim(runner, SchedulerConfig(max_step_tokens=10, max_running=6,
                                               kv_reserve_pages=1))

    @rule(shared=st.booleans(), tail=st.lists(st.integers(0, 1), max_size=8),
          max_tokens=st.integers(1, 30), priority=st.integers(0, 2),
          tenant=st.sampled_from(["a", "b"]),
          adapter=st.sampled_from([None, None, "x", "y", "z"]))
    def submit(self, shared, tail, max_tokens, priority, tenant, adapter):
        prompt = (SYSTEM if shared else []) + tail or [1]
        salt = ("" if shared else tenant) + (f"|{adapter}" if adapter else "")
        self.sim.submit(prompt, max_tokens=max_tokens, priority=priority, tenant=tenant,
                        cache_salt=salt, adapter=adapter)

    @precondition(lambda self: self.sim.seqs)
    @rule(data=st.data(), max_tokens=st.integers(1, 10))
    def continue_conversation(self, data, max_tokens):
        """Resubmit an earlier sequence's prompt + output (cut to a page boundary, often
        entirely cached: then its last page is copied before it is written)."""
        old = data.draw(st.sampled_from(list(self.sim.seqs.values())))
        n = len(old.token_ids)
        tokens = old.token_ids[:n - n % 4] or old.token_ids
        self.sim.submit(tokens, max_tokens=max_tokens, tenant=old.tenant,
                        cache_salt=old.cache_salt, adapter=old.adapter)

    @rule(n=st.integers(1, 6))
    def step(self, n):
        for _ in range(n):
            if self.sim.step() is None:
                break

    @precondition(lambda self: any(s.phase is not Phase.DONE for s in self.sim.seqs.values()))
    @rule(data=st.data())
    def abort(self, data):
        live = [s for s in self.sim.seqs.values() if s.phase is not Phase.DONE]
        self.sim.sched.finish(data.draw(st.sampled_from(live)))

    @invariant()
    def books_balance(self):
        self.sim.check()
        sched = self.sim.sched
        assert len(sched.running) <= sched.max_running
        slots = sched.adapters
        for name in {"x", "y", "z"}:  # a slot pinned exactly by its running sequences
            users = [s for s in sched.running.values() if s.adapter == name]
            assert slots.users[name] == len(users)
            assert all(slots.holder[s.adapter_slot] == name for s in users)

    @invariant()
    def finished_ones_match_the_reference(self):
        ref = self.sim.runner.reference
        for s in self.sim.finished:
            assert s.output_ids == ref(s.prompt_ids, len(s.output_ids), s.adapter)

    def teardown(self):
        self.sim.run()
        sched = self.sim.sched
        assert not sched.running and not len(sched.waiting)
        assert sched.pages.num_in_use == 0
        for s in self.sim.seqs.values():
            assert s.phase is Phase.DONE and s.kv_pages == []
            assert s.output_ids == self.sim.runner.reference(s.prompt_ids, len(s.output_ids),
                                                             s.adapter)
        assert not any(sched.adapters.users.values()) and not sched.adapters.live


PolicyMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestPolicy = PolicyMachine.TestCase


class TieredPolicyMachine(PolicyMachine):
    """The same with KV tiers below the tiny pool (scheduler/kv_tiers.py): evicted prefix
    pages go down to 6 host slots and a disk, and come back up; files vanish at random
    (their pages are then computed). The fake runner copies page contents down and up,
    so a wrong slot or a slot reused too early changes the outputs."""

    def __init__(self) -> None:
        RuleBasedStateMachine.__init__(self)
        runner = FakeRunner(page_size=4, num_pages=17, vocab=50, adapter_slots=2,
                            limits=StepLimits(max_decode_seqs=6, max_prefill_seqs=2,
                                              max_prefill_chunk=6, max_prefill_tokens=8),
                            host_slots=6, disk=True)
        self.sim = Sim(runner, SchedulerConfig(max_step_tokens=10, max_running=6,
                                               kv_reserve_pages=1))

    @precondition(lambda self: self.sim.runner.kv_store.disk)
    @rule(data=st.data())
    def lose_a_file(self, data):
        disk = self.sim.runner.kv_store.disk
        del disk[data.draw(st.sampled_from(sorted(disk)))]

    def teardown(self):
        super().teardown()
        tiers = self.sim.sched.pages.tiers
        assert not tiers.audit() and not tiers.num_loading and not tiers.num_unsettled


TieredPolicyMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestTieredPolicy = TieredPolicyMachine.TestCase


class WindowedPolicyMachine(PolicyMachine):
    """The same for a model with sliding-window layers whose pages are their own
    (scheduler/window_pages.py): a window of 6 keys, 15 sliding pages for up to 3
    sequences, n-gram proposals verified and trimmed. The fake runner writes a second
    pool through the sliding tables and checks at every sampled position that each key
    of its window is there: a page released too early, reused while seen or a wrong
    window tail taken as a hit changes or fails the step."""

    def __init__(self) -> None:
        RuleBasedStateMachine.__init__(self)
        limits = StepLimits(max_decode_seqs=6, max_prefill_seqs=2, max_prefill_chunk=6,
                            max_prefill_tokens=8, window=6, window_pool=16)
        runner = FakeRunner(page_size=4, num_pages=17, vocab=50, adapter_slots=2,
                            limits=limits)
        self.sim = Sim(runner, SchedulerConfig(max_step_tokens=10, max_running=6,
                                               kv_reserve_pages=1, speculative="ngram"))
        assert self.sim.sched.max_running == 3  # 15 usable pages, 5 a sequence at most

    def teardown(self):
        super().teardown()
        window = self.sim.sched.window
        assert window.alloc.num_in_use == 0
        assert all(s.window_pages == [] for s in self.sim.seqs.values())
        assert window.most_held <= window.per_seq


WindowedPolicyMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestWindowedPolicy = WindowedPolicyMachine.TestCase
