"""Drives a `Scheduler` and a `FakeRunner` synchronously, the way the engine loop does
(schedule, step, commit, finish on max_tokens/eos), for policy tests without trio."""

from __future__ import annotations

import itertools
import math

from config.settings import SchedulerConfig
from scheduler.api import GenerateRequest
from scheduler.kv_tiers import KVTiers
from scheduler.policy import Batch, Scheduler
from scheduler.request import Sequence

from .fake_runner import FakeRunner


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class Sim:
    def __init__(self, runner: FakeRunner, config: SchedulerConfig) -> None:
        self.runner = runner
        self.clock = FakeClock()
        self.sched = Scheduler(config, num_pages=runner.num_pages, page_size=runner.page_size,
                               limits=runner.limits, clock=self.clock,
                               adapter_slots=runner.adapter_slots)
        store = getattr(runner, "kv_store", None)
        if store is not None:  # the KV tiers, as the engine sets them up
            self.sched.pages.tiers = KVTiers(store.host_slots, store.page_bytes,
                                             disk=store.disk, page_size=runner.page_size)
        self.seqs: dict[int, Sequence] = {}  # every sequence ever submitted (unique ids)
        self.batches: list[Batch] = []
        self.finished: list[Sequence] = []
        self._ids = itertools.count()

    def submit(self, prompt, max_tokens: int = 8, **kw) -> Sequence:
        req = GenerateRequest(prompt_ids=list(prompt), max_tokens=max_tokens, **kw)
        i = next(self._ids)
        seq = Sequence(req, request_id=f"r{i}", seq_id=i, arrived_at=self.clock(),
                       deadline_at=math.inf, arrival_order=i)
        self.seqs[i] = seq
        self.sched.add(seq)
        return seq

    def step(self) -> Batch | None:
        for _ in range(100):  # disk reads done, the plan again (a livelock would spin)
            batch = self.sched.schedule()
            if not self._loads() or batch is not None:
                break
        else:
            raise AssertionError("disk reads asked for again and again, nothing planned")
        if batch is None:
            return None
        self.batches.append(batch)
        result = self.runner.step(batch.plan)
        for seq, tok in self.sched.commit(batch, result):
            if seq.num_generated >= seq.max_tokens or tok.token_id in self.runner.eos_token_ids:
                if (unused := self.sched.finish(seq)) is not None:
                    self.runner.drop_adapter(unused)
                self.finished.append(seq)
        self.clock.advance(0.01)
        self.check()
        return batch

    def _loads(self) -> bool:
        """Disk reads the plan asked for, done at once (the engine runs them in threads)."""
        tiers = self.sched.pages.tiers
        if tiers is None:
            return False
        jobs = tiers.take_loads()
        for job in jobs:
            self.runner.kv_store.load(job)
            tiers.loaded(job)
        return bool(jobs)

    def run(self, max_steps: int = 100_000) -> int:
        for n in range(max_steps):
            if self.step() is None:
                return n
        raise AssertionError("did not finish")

    def check(self) -> None:
        self.sched.pages.check([s.kv_pages for s in self.sched.running.values()])
        if self.sched.window is not None:
            problems = self.sched.window.audit(self.sched.running.values())
            assert not problems, problems
