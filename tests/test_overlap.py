"""Overlapped scheduling (issue 16, point 3): step N+1 is planned and launched while step N
computes, its pending tokens fed on the device, and the outputs are token for token those
of the engine without overlap.

The real runner on a tiny random model of the same code, through the engine; and the fake
runner where the exact step a stop or an abort takes effect in is to be read.
"""

from __future__ import annotations

import pytest
import trio

from config.settings import SchedulerConfig
from model.runner import ModelRunner
from scheduler.api import ErrorEvent, FinishEvent, GenerateRequest, TokenEvent
from scheduler.engine import Engine
from scheduler.protocol import SamplingParams
from tests.model.test_runner import TINY, random_params
from tests.scheduler.fake_runner import FakeDetokenizer, FakeRunner, succ_rule

GREEDY = SamplingParams(temperature=0.0)
# Stop ids for two requests: a third of the vocabulary each, so that they stop early.
STOPS = {4: tuple(range(0, 300, 3)), 7: tuple(range(1, 300, 3))}


class Counting:
    """The runner, counting the pending chunks it was handed."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.pending = 0
        self.steps = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def launch(self, plan):
        self.steps += 1
        self.pending += sum(c.pending for c in plan.chunks)
        return self.inner.launch(plan)


class IdDetokenizer:
    def incremental(self, prompt_ids):
        return FakeDetokenizer().incremental(prompt_ids)


@pytest.fixture(scope="module")
def runner():
    r = ModelRunner(TINY, random_params(TINY, seed=11), page_size=8, num_pages=160,
                    max_context=512, decode_buckets=(1, 4, 8), prefill_buckets=(32, 64),
                    block_q=8, max_prefill_seqs=2)
    r.warmup()
    return r


async def collect(handle) -> tuple[list[int], object]:
    ids: list[int] = []
    async for ev in handle.events:
        if isinstance(ev, TokenEvent):
            ids.extend(ev.token_ids)
        elif isinstance(ev, (FinishEvent, ErrorEvent)):
            return ids, ev
    raise AssertionError("channel closed without a final event")


def requests() -> list[GenerateRequest]:
    """Prompts of different lengths (some prefilled in two chunks), greedy and seeded
    sampling, logprobs, stop ids, and a penalised one (waited for, never pending)."""
    out = []
    for i in range(10):
        prompt = [(7 * i + 3 * j) % 290 + 5 for j in range(6 + 11 * i)]
        sampling = GREEDY if i % 3 else SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i,
                                                       logprobs=True, top_logprobs=2)
        out.append(GenerateRequest(prompt_ids=prompt, max_tokens=12 + 3 * i, sampling=sampling,
                                   stop_token_ids=STOPS.get(i, ())))
    out.append(GenerateRequest(prompt_ids=[9, 8, 7, 6, 5], max_tokens=20, sampling=SamplingParams(
        temperature=0.0, presence_penalty=0.5)))
    return out


async def run_engine(runner, overlap: bool):
    counting = Counting(runner)
    eng = Engine(counting, IdDetokenizer(), SchedulerConfig(
        overlap=overlap, max_running=8, max_step_tokens=72, ttft_target_s=0.0))
    async with trio.open_nursery() as nursery:
        await nursery.start(eng.run)
        results: dict[int, tuple] = {}

        async def one(i, req):
            await trio.sleep(0.01 * (i % 4))  # arrivals spread over a few steps
            results[i] = await collect(eng.submit(req))

        async with trio.open_nursery() as inner:
            for i, req in enumerate(requests()):
                inner.start_soon(one, i, req)
        stats = eng.stats(audit=True)
        nursery.cancel_scope.cancel()
    assert stats.kv_pages_in_use == 0 and stats.kv_audit == []
    return [results[i] for i in range(len(results))], counting, stats


async def test_overlapped_engine_gives_the_same_tokens(runner):
    plain, off, _ = await run_engine(runner, overlap=False)
    overlapped, on, stats = await run_engine(runner, overlap=True)
    assert off.pending == 0 and on.pending > 20, "the overlap did not happen"
    for (ids_a, fin_a), (ids_b, fin_b) in zip(plain, overlapped):
        assert isinstance(fin_a, FinishEvent) and isinstance(fin_b, FinishEvent)
        assert ids_a == ids_b and fin_a.finish_reason == fin_b.finish_reason
    # The stop ids and max_tokens ended answers at the same token with overlap too, though
    # the step after was already launched when the stop was seen.
    assert {f.finish_reason for _, f in overlapped} == {"stop", "length"}
    assert stats.idle_s >= 0 and stats.compute_s > 0


async def test_a_stop_or_an_abort_takes_effect_within_one_step():
    """With the fake runner (next token = last + 1): the step launched before the stop
    was seen is the only one that still holds the sequence; so for an abort."""
    runner = FakeRunner(rule=succ_rule(1000), eos=(30,))
    eng = Engine(runner, FakeDetokenizer(), SchedulerConfig())
    async with trio.open_nursery() as nursery:
        await nursery.start(eng.run)
        stop = eng.submit(GenerateRequest(prompt_ids=[1, 2, 20], max_tokens=50))
        sid = eng.seq_id_of(stop.request_id)
        ids, fin = await collect(stop)
        assert ids == list(range(21, 30)) and fin.finish_reason == "stop"  # eos not shown
        steps = [i for i, p in enumerate(runner.plans) if any(c.seq_id == sid for c in p.chunks)]
        eos_step = next(i for i in steps if any(
            c.seq_id == sid and c.start_pos + len(c.token_ids) == 3 + 9 for c in runner.plans[i].chunks))
        assert steps[-1] <= eos_step + 1  # at most the one launched meanwhile

        long = eng.submit(GenerateRequest(prompt_ids=[5, 6], max_tokens=500))
        lid = eng.seq_id_of(long.request_id)
        async for ev in long.events:
            if isinstance(ev, TokenEvent) and sum(1 for _ in ev.token_ids):
                break
        await trio.sleep(0.01)
        n = len(runner.plans)
        eng.abort(long.request_id)
        for _ in range(20):
            await trio.sleep(0.001)
        later = [p for p in runner.plans[n:] if any(c.seq_id == lid for c in p.chunks)]
        assert len(later) <= 1  # launched before the abort was seen, never planned after
        assert eng.stats().kv_pages_in_use == 0
        nursery.cancel_scope.cancel()


async def test_sequences_that_need_their_token_on_the_host_are_never_pending():
    """Penalties count the last token, a grammar's mask follows it: such a sequence's step
    is committed before the next is planned, so its chunks never wait on the device."""
    runner = FakeRunner()
    eng = Engine(runner, FakeDetokenizer(), SchedulerConfig())
    async with trio.open_nursery() as nursery:
        await nursery.start(eng.run)
        pen = eng.submit(GenerateRequest(prompt_ids=[3, 4, 5], max_tokens=8,
                                         sampling=SamplingParams(frequency_penalty=0.3)))
        free = eng.submit(GenerateRequest(prompt_ids=[6, 7, 8], max_tokens=8))
        pid = eng.seq_id_of(pen.request_id)
        (a, _), (b, _) = await collect(pen), await collect(free)
        assert a == runner.reference([3, 4, 5], 8) and b == runner.reference([6, 7, 8], 8)
        assert not any(c.pending for p in runner.plans for c in p.chunks if c.seq_id == pid)
        nursery.cancel_scope.cancel()


async def test_a_failed_overlapped_step_fails_its_requests_and_the_engine_goes_on():
    runner = FakeRunner(num_pages=64)
    eng = Engine(runner, FakeDetokenizer(), SchedulerConfig())
    async with trio.open_nursery() as nursery:
        await nursery.start(eng.run)
        system = list(range(40, 72))  # 8 full pages of 4, shared
        first = eng.submit(GenerateRequest(prompt_ids=system + [1], max_tokens=30))
        async for ev in first.events:
            break  # it decodes: steps are launched ahead now
        runner.fail_next = 1
        ids, fin = await collect(first)
        assert isinstance(fin, ErrorEvent)
        # The pages that step offered the prefix cache are not trusted: a new request with
        # the same prompt gets the reference tokens.
        again = eng.submit(GenerateRequest(prompt_ids=system + [2], max_tokens=5))
        ids, fin = await collect(again)
        assert isinstance(fin, FinishEvent) and ids == runner.reference(system + [2], 5)
        assert eng.stats(audit=True).kv_audit == [] and eng.stats().kv_pages_in_use == 0
        nursery.cancel_scope.cancel()


def test_a_failed_steps_pages_leave_the_prefix_cache_and_fail_who_took_them():
    """Pages join the prefix cache when their step is launched (a reader runs after it).
    If that step then fails, they hold nothing: `forget` takes them out, and a sequence
    admitted meanwhile onto them is named, to be failed too."""
    from tests.scheduler.sim import Sim

    sim = Sim(FakeRunner(num_pages=64), SchedulerConfig())
    sched = sim.sched
    system = list(range(40, 72))  # 8 full pages of 4
    a = sim.submit(system + [1], max_tokens=4)
    first = sched.schedule()
    sched.launched(first)  # not committed: the step is in flight
    b = sim.submit(system + [2], max_tokens=4)
    sched.schedule()
    assert b.num_computed_tokens == 32  # it took a's pages as prefix hits
    assert sched.forget(first) == [b]
    c = sim.submit(system + [3], max_tokens=4)
    assert sched.pages.match(c) == []  # nothing of the failed step is offered any more
    for seq in (a, b):
        sched.finish(seq)
    sim.check()
    assert sched.pages.num_in_use == 0
