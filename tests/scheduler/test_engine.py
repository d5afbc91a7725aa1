"""The trio engine loop with the fake runner: streaming, joins and leaves, aborts,
bounded queue, shedding, stops, preemption seen by a client, failures.

(About 540 lines: one engine, one fake runner, and what a client sees of each rule; the
arithmetic behind the door and the plan is tested on its own in test_admission.py and
test_itl_target.py.)"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

from config.settings import SchedulerConfig
from scheduler.api import (EngineDead, ErrorEvent, FinishEvent, GenerateRequest, Overloaded,
                           TokenEvent)
from scheduler.engine import EVENT_BUFFER, Engine
from scheduler.protocol import SamplingParams, StepLimits

from .fake_runner import FakeDetokenizer, FakeRunner, succ_rule
from .sim import FakeClock

LIMITS = StepLimits(max_decode_seqs=8, max_prefill_seqs=2, max_prefill_chunk=16,
                    max_prefill_tokens=32)


@dataclass
class Result:
    events: list = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.events if isinstance(e, TokenEvent) for t in e.token_ids]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, TokenEvent))

    @property
    def final(self):
        return self.events[-1]


async def collect(handle) -> Result:
    r = Result()
    with trio.fail_after(10):
        async for ev in handle.events:
            r.events.append(ev)
    assert isinstance(r.final, (FinishEvent, ErrorEvent))
    assert all(isinstance(e, TokenEvent) for e in r.events[:-1])
    return r


async def collect_all(handles) -> list[Result]:
    """Read every request's stream at once (a slow reader would hold its sequence back)."""
    results: list = [None] * len(handles)

    async def one(i):
        results[i] = await collect(handles[i])

    async with trio.open_nursery() as n:
        for i in range(len(handles)):
            n.start_soon(one, i)
    return results


def prompt(n, base=1):
    return [(base + 7 * i) % 97 for i in range(n)]


async def start(nursery, runner=None, detok=None, **cfg) -> Engine:
    runner = runner or FakeRunner(limits=LIMITS)
    clock = cfg.pop("clock", None)
    kw = {"clock": clock} if clock else {}
    eng = Engine(runner, detok or FakeDetokenizer(), SchedulerConfig(**cfg), **kw)
    await nursery.start(eng.run)
    return eng


def check_pages(eng: Engine) -> None:
    sched = eng.scheduler
    sched.pages.check([s.kv_pages for s in sched.running.values()])


async def test_stream_matches_reference_and_reports_usage(nursery):
    eng = await start(nursery)
    p = prompt(10)
    r = await collect(eng.submit(GenerateRequest(prompt_ids=p, max_tokens=7)))
    ref = eng.runner.reference(p, 7)
    assert r.tokens == ref and r.text == FakeDetokenizer().text(ref)
    f = r.final
    assert (f.finish_reason, f.prompt_tokens, f.completion_tokens, f.cached_tokens) == \
        ("length", 10, 7, 0)
    assert f.queue_s >= 0 and f.ttft_s >= f.queue_s and f.e2e_s >= f.ttft_s
    assert eng.stats().kv_pages_in_use == 0


async def test_concurrent_requests_sharing_a_system_prompt(nursery):
    runner = FakeRunner(limits=LIMITS, num_pages=1024)
    eng = await start(nursery, runner, max_running=8)
    system = prompt(120)
    reqs = [GenerateRequest(prompt_ids=system + [i, i + 1], max_tokens=6) for i in range(32)]
    results = await collect_all([eng.submit(r) for r in reqs])
    for req, r in zip(reqs, results):
        assert r.tokens == runner.reference(req.prompt_ids, 6)  # as if alone
    cached = sorted(r.final.cached_tokens / r.final.prompt_tokens for r in results)
    assert cached[0] == 0 and cached[1] >= 0.9  # everyone after the first hits


async def test_idle_engine_sleeps_instead_of_spinning(nursery):
    eng = await start(nursery)
    with trio.fail_after(5):  # never returns if the loop busy-waits
        await trio.testing.wait_all_tasks_blocked()
    steps = eng.stats().steps
    r = await collect(eng.submit(GenerateRequest(prompt_ids=[1, 2], max_tokens=2)))
    assert r.final.finish_reason == "length" and eng.stats().steps > steps


async def test_joins_within_one_iteration_and_leaves_in_its_last(nursery):
    eng = await start(nursery)
    long = eng.submit(GenerateRequest(prompt_ids=prompt(5), max_tokens=60))
    seen = 0
    async for ev in long.events:
        seen += len(ev.token_ids)
        if seen >= 5:
            break
    # Steps planned (launched, or being launched) and not yet logged cannot hold it:
    # with overlapped scheduling up to two.
    n0 = len(eng.step_records)
    in_step = eng._launches - n0
    short = eng.submit(GenerateRequest(prompt_ids=prompt(5, 3), max_tokens=3))
    sid = eng.seq_id_of(short.request_id)
    r = await collect(short)
    assert r.final.finish_reason == "length"
    # Its pages are back by the time it is told it finished: only `long` holds pages.
    check_pages(eng)
    assert list(eng.scheduler.running) == [eng.seq_id_of(long.request_id)]
    recs = list(eng.step_records)
    first = next(rec.index for rec in recs if any(s == sid for s, _ in rec.prefilled))
    assert first <= n0 + in_step, "did not join the running batch at the next iteration"
    # it decoded alongside `long` (continuous batching), then left
    steps_with = [rec for rec in recs if sid in rec.decoded]
    assert len(steps_with) == 2 and all(len(rec.decoded) == 2 for rec in steps_with)
    eng.abort(long.request_id)


async def test_preempted_client_sees_every_token_once_in_order(nursery):
    runner = FakeRunner(limits=LIMITS, num_pages=25)  # 24 pages of 4: too few for all
    eng = await start(nursery, runner, kv_reserve_pages=1)
    reqs = [GenerateRequest(prompt_ids=prompt(6, i), max_tokens=34, priority=i % 2)
            for i in range(4)]
    results = await collect_all([eng.submit(r) for r in reqs])
    assert eng.stats().preemptions > 0
    for req, r in zip(reqs, results):
        ref = runner.reference(req.prompt_ids, 34)
        assert r.tokens == ref
        assert r.text == FakeDetokenizer().text(ref)
        assert r.final.completion_tokens == 34
    assert eng.stats().kv_pages_in_use == 0


async def test_abort_during_a_step_frees_pages_before_the_next_one(nursery):
    runner = FakeRunner(limits=LIMITS)
    entered, release = threading.Event(), threading.Event()
    gate = {"on": False}

    def hook(plan):
        if gate["on"]:
            gate["on"] = False
            entered.set()
            release.wait(5)

    runner.on_step = hook
    eng = await start(nursery, runner)
    a = eng.submit(GenerateRequest(prompt_ids=prompt(9), max_tokens=500))
    b = eng.submit(GenerateRequest(prompt_ids=prompt(9, 4), max_tokens=500))
    await a.events.receive()
    gate["on"] = True
    await trio.to_thread.run_sync(entered.wait)
    a_seq = eng.scheduler.running[eng.seq_id_of(a.request_id)]
    eng.abort(a.request_id)  # a is inside the running step: only marked
    assert a_seq.kv_pages, "pages freed while the runner may still read them"
    release.set()
    r = await collect(a)  # the abort's FinishEvent comes once the step is back
    assert r.final.finish_reason == "abort"
    assert a_seq.kv_pages == [] and a_seq.seq_id not in eng.scheduler.running
    check_pages(eng)
    eng.abort(b.request_id)


async def test_abort_from_a_cancelled_scope_frees_everything(nursery):
    eng = await start(nursery)
    got = []

    async def client():
        h = eng.submit(GenerateRequest(prompt_ids=prompt(20), max_tokens=1000))
        with trio.CancelScope() as cs:
            try:
                async for ev in h.events:
                    got.append(ev)
                    if len(got) == 3:
                        cs.cancel()
                        await trio.sleep(10)  # raises Cancelled, as a disconnect does
            finally:
                eng.abort(h.request_id)  # synchronous: fine in a cancelled scope

    await client()
    assert len(got) == 3
    with trio.fail_after(5):  # at most the step in flight finishes first
        while eng.stats().running:
            await trio.sleep(0.001)
    s = eng.stats()
    assert s.running == 0 and s.waiting == 0 and s.kv_pages_in_use == 0
    assert s.kv_pages_free + s.kv_pages_cached == s.kv_pages_total


async def test_receiver_closed_counts_as_abort(nursery):
    eng = await start(nursery)
    h = eng.submit(GenerateRequest(prompt_ids=prompt(8), max_tokens=1000))
    await h.events.receive()
    await h.events.aclose()  # the client vanished without calling abort
    with trio.fail_after(5):
        while eng.stats().running:
            await trio.sleep(0.001)
    assert eng.stats().kv_pages_in_use == 0


async def test_abort_of_a_queued_request_is_immediate():
    eng = Engine(FakeRunner(limits=LIMITS), FakeDetokenizer(), SchedulerConfig())
    h = eng.submit(GenerateRequest(prompt_ids=prompt(8), max_tokens=4))  # loop not running
    assert eng.stats().waiting == 1
    eng.abort(h.request_id)
    assert eng.stats().waiting == 0
    assert (await h.events.receive()).finish_reason == "abort"
    eng.abort(h.request_id)  # twice, or unknown ids: no-op
    eng.abort("nope")


async def test_full_queue_refuses_at_once():
    eng = Engine(FakeRunner(limits=LIMITS), FakeDetokenizer(),
                 SchedulerConfig(max_waiting=2, max_waiting_tokens=25))
    eng.submit(GenerateRequest(prompt_ids=prompt(10), max_tokens=4))
    with pytest.raises(Overloaded) as e:
        eng.submit(GenerateRequest(prompt_ids=prompt(20), max_tokens=4))
    assert e.value.reason == "queue_tokens" and e.value.retry_after_s > 0
    eng.submit(GenerateRequest(prompt_ids=prompt(10), max_tokens=4))
    with pytest.raises(Overloaded) as e:
        eng.submit(GenerateRequest(prompt_ids=prompt(1), max_tokens=4))
    assert e.value.reason == "queue_full" and e.value.retry_after_s > 0
    eng.start_draining()
    with pytest.raises(Overloaded) as e:
        eng.submit(GenerateRequest(prompt_ids=prompt(1), max_tokens=4))
    assert e.value.reason == "draining"
    assert eng.stats().rejections == {"queue_tokens": 1, "queue_full": 1, "draining": 1}


async def test_requests_that_can_never_fit_are_refused():
    runner = FakeRunner(limits=LIMITS, max_context=64, num_pages=9)  # 8 pages of 4
    eng = Engine(runner, FakeDetokenizer(), SchedulerConfig())
    with pytest.raises(ValueError, match="context"):
        eng.submit(GenerateRequest(prompt_ids=prompt(60), max_tokens=5))
    with pytest.raises(ValueError, match="KV cache"):
        eng.submit(GenerateRequest(prompt_ids=prompt(30), max_tokens=5))
    with pytest.raises(ValueError):
        eng.submit(GenerateRequest(prompt_ids=[], max_tokens=5))


async def test_request_past_its_queue_deadline_is_shed(nursery):
    clock = FakeClock()
    eng = await start(nursery, max_running=1, clock=clock)
    busy = eng.submit(GenerateRequest(prompt_ids=prompt(4), max_tokens=900))
    await busy.events.receive()
    late = eng.submit(GenerateRequest(prompt_ids=prompt(4, 2), max_tokens=4, deadline_s=5))
    ok = eng.submit(GenerateRequest(prompt_ids=prompt(4, 3), max_tokens=4, deadline_s=60))
    clock.advance(10)
    r = await collect(late)
    assert isinstance(r.final, ErrorEvent) and r.final.kind == "shed"
    assert eng.stats().rejections.get("shed") == 1
    assert eng.stats().waiting == 1  # `ok` still waits
    eng.abort(busy.request_id)
    assert (await collect(ok)).final.finish_reason == "length"


async def test_stop_strings_across_tokens_eos_and_stop_ids(nursery):
    runner = FakeRunner(limits=LIMITS, rule=succ_rule(1000), eos=[7])
    eng = await start(nursery, runner)
    # tokens 1, 2, 3, ... are "b", "c", "d", ...: "def" spans three tokens
    r = await collect(eng.submit(GenerateRequest(prompt_ids=[0], max_tokens=20, stop=["def"])))
    assert r.text == "bc" and r.final.finish_reason == "stop"
    assert all("d" not in e.text for e in r.events[:-1])
    r = await collect(eng.submit(GenerateRequest(prompt_ids=[0], max_tokens=20)))
    assert r.text == "bcdefg" and r.tokens == [1, 2, 3, 4, 5, 6]  # eos 7 not shown
    assert r.final.finish_reason == "stop" and r.final.completion_tokens == 7
    r = await collect(eng.submit(GenerateRequest(prompt_ids=[0], max_tokens=9, ignore_eos=True)))
    assert r.text == "bcdefghij" and r.final.finish_reason == "length"
    r = await collect(eng.submit(GenerateRequest(prompt_ids=[0], max_tokens=9,
                                                 stop_token_ids=[3])))
    assert r.text == "bc" and r.final.finish_reason == "stop"
    # held back text that never became a stop string is released at the end
    r = await collect(eng.submit(GenerateRequest(prompt_ids=[0], max_tokens=3, stop=["dx"])))
    assert r.text == "bcd" and r.final.finish_reason == "length"


async def test_slow_client_gets_coalesced_events_and_never_blocks_the_loop(nursery):
    eng = await start(nursery)
    slow = eng.submit(GenerateRequest(prompt_ids=prompt(4), max_tokens=100))
    fast = eng.submit(GenerateRequest(prompt_ids=prompt(4, 9), max_tokens=120))
    r_fast = await collect(fast)  # finishes although `slow` reads nothing
    assert r_fast.final.finish_reason == "length"
    r = await collect(slow)
    assert r.tokens == eng.runner.reference(prompt(4), 100)
    assert len(r.events) <= EVENT_BUFFER + 2
    assert r.final.finish_reason == "length"


async def test_failed_step_fails_its_requests_and_the_loop_goes_on(nursery):
    eng = await start(nursery)
    a = eng.submit(GenerateRequest(prompt_ids=prompt(4), max_tokens=50))
    await a.events.receive()
    eng.runner.fail_next = 1
    r = await collect(a)
    assert isinstance(r.final, ErrorEvent) and "injected" in r.final.message
    assert eng.alive
    r = await collect(eng.submit(GenerateRequest(prompt_ids=prompt(4), max_tokens=5)))
    assert r.final.finish_reason == "length"
    assert eng.stats().kv_pages_in_use == 0


async def test_repeated_failures_mark_the_engine_dead():
    runner = FakeRunner(limits=LIMITS)
    eng = Engine(runner, FakeDetokenizer(), SchedulerConfig())
    runner.fail_next = 100
    handles = [eng.submit(GenerateRequest(prompt_ids=prompt(4, i), max_tokens=5))
               for i in range(5)]
    with trio.fail_after(5):
        await eng.run()  # returns once dead
    assert not eng.alive and not eng.stats().alive
    for h in handles:
        assert isinstance((await collect(h)).final, ErrorEvent)
    with pytest.raises(EngineDead):
        eng.submit(GenerateRequest(prompt_ids=[1], max_tokens=1))


async def test_logprobs_and_stats(nursery):
    eng = await start(nursery)
    p = prompt(12)
    r = await collect(eng.submit(GenerateRequest(
        prompt_ids=p, max_tokens=4, sampling=SamplingParams(temperature=0, logprobs=True))))
    lps = [lp for e in r.events if isinstance(e, TokenEvent) for lp in e.logprobs]
    assert [lp.token_id for lp in lps] == r.tokens and lps[0].logprob == -1.0
    r2 = await collect(eng.submit(GenerateRequest(prompt_ids=p + [5], max_tokens=4)))
    assert r2.final.cached_tokens == 12
    s = eng.stats()
    assert s.generation_tokens == 8 and s.steps == len(eng.step_records)
    assert s.prefix_cache_queries_tokens == 12 + 13 and s.prefix_cache_hits_tokens == 12
    assert s.prompt_tokens == 12 + 1  # prompt tokens computed: the second one's 12 were hits
    assert s.real_tokens == sum(rec.real_tokens for rec in eng.step_records)
    assert s.padded_tokens >= s.real_tokens and s.busy_s >= 0
    assert s.running == s.waiting == 0 and s.kv_pages_in_use == 0 and s.kv_pages_cached > 0


async def test_expected_queue_wait_past_the_bound_is_refused_at_the_door():
    """Under overload the queue does not grow into requests that would be served late:
    once completions give a rate, a submit whose wait would exceed ttft_target_s is
    refused at once (429 upstream); Retry-After is when enough will have finished for the
    target to hold (one completion, 2 s at this rate)."""
    clock = FakeClock()
    eng = Engine(FakeRunner(limits=LIMITS), FakeDetokenizer(),
                 SchedulerConfig(max_running=1, ttft_target_s=5.0,
                                 ttft_factor_uncalibrated=1.0), clock=clock)
    eng.submit(GenerateRequest(prompt_ids=prompt(4), max_tokens=4))  # takes the slot
    for _ in range(3):  # one request finished every 2 s
        eng.admission.completed(clock())
        clock.advance(2.0)
    eng.submit(GenerateRequest(prompt_ids=prompt(4, 2), max_tokens=4))  # 1 ahead: ~2 s
    eng.submit(GenerateRequest(prompt_ids=prompt(4, 3), max_tokens=4))  # 2 ahead: ~4 s
    with pytest.raises(Overloaded) as e:
        eng.submit(GenerateRequest(prompt_ids=prompt(4, 4), max_tokens=4))  # ~6 s
    assert e.value.reason == "ttft_target" and e.value.retry_after_s == pytest.approx(2.0)
    batch = eng.submit(GenerateRequest(prompt_ids=prompt(4, 5), max_tokens=4, batch=True))
    assert batch.request_id  # batch jobs wait for idle capacity instead


async def test_prefill_work_ahead_counts_toward_the_expected_wait():
    """Requests admitted in a burst would each wait for the others' prefills: the wait
    estimate adds the prompt tokens ahead (discounted by cache hits) at the measured cost
    of a prefill token. On an idle replica a request is admitted whatever its prompt."""
    eng = Engine(FakeRunner(limits=LIMITS, num_pages=1024), FakeDetokenizer(),
                 SchedulerConfig(max_running=8, ttft_target_s=1.0, ttft_slack=1.0,
                                 ttft_factor_uncalibrated=1.0))
    eng.scheduler.cost.prefill_token_s = 0.01  # 10 ms a prompt token
    eng.submit(GenerateRequest(prompt_ids=prompt(60), max_tokens=4))  # own prompt: ok
    eng.submit(GenerateRequest(prompt_ids=prompt(30, 2), max_tokens=4))  # 0.6 s ahead: ok
    eng.submit(GenerateRequest(prompt_ids=prompt(5, 3), max_tokens=4))  # 0.9 s ahead: ok
    with pytest.raises(Overloaded) as e:  # 0.95 s of prefill ahead, 0.1 s its own
        eng.submit(GenerateRequest(prompt_ids=prompt(10, 4), max_tokens=4))
    assert e.value.reason == "ttft_target"
    # 1.05 s predicted: back once 0.05 s of that prefill has run (0.1 s at the least)
    assert e.value.retry_after_s == pytest.approx(0.1)
    assert eng.stats().waiting == 3


async def test_admission_predicts_time_to_first_token_own_prefill_included():
    """With work ahead, a request's own prefill counts toward its predicted TTFT, so
    admitted requests meet the target; a prompt too long to meet it even alone is
    judged on the queue wait only (else it could never be admitted while others run)."""
    eng = Engine(FakeRunner(limits=LIMITS, num_pages=1024), FakeDetokenizer(),
                 SchedulerConfig(max_running=8, ttft_target_s=1.0, ttft_slack=1.0,
                                 ttft_factor_uncalibrated=1.0))
    eng.scheduler.cost.prefill_token_s = 0.01
    eng.submit(GenerateRequest(prompt_ids=prompt(50), max_tokens=4))  # idle: admitted
    # 0.5 s of prefill ahead + 0.4 s of its own: 0.9 s, admitted.
    eng.submit(GenerateRequest(prompt_ids=prompt(40, 2), max_tokens=4))
    # 0.9 s ahead + 0.2 s of its own: 1.1 s, refused; Retry-After: once 0.1 s of the
    # prefill ahead has run.
    with pytest.raises(Overloaded) as e:
        eng.submit(GenerateRequest(prompt_ids=prompt(20, 3), max_tokens=4))
    assert e.value.reason == "ttft_target" and e.value.retry_after_s == pytest.approx(0.1)
    # 3 s of its own (it can never meet 1 s): judged on the 0.9 s wait, admitted.
    eng.submit(GenerateRequest(prompt_ids=prompt(300, 4), max_tokens=4))
    assert eng.stats().waiting == 3


async def test_submit_counts_what_is_left_of_the_step_in_flight():
    """The engine tells admission when its step in flight should end (the arithmetic is
    in test_admission.py)."""
    clock = FakeClock()
    eng = Engine(FakeRunner(limits=LIMITS, num_pages=1024), FakeDetokenizer(),
                 SchedulerConfig(max_running=8, ttft_target_s=1.0, ttft_slack=1.0,
                                 ttft_factor_uncalibrated=1.0), clock=clock)
    eng.scheduler.cost.prefill_token_s = 0.01
    eng.submit(GenerateRequest(prompt_ids=prompt(30), max_tokens=4))  # 0.3 s ahead
    eng._step_ends_at = clock() + 0.1  # a step is in flight, ends in 0.1 s
    with pytest.raises(Overloaded):  # 0.3 s ahead + 0.1 s of the step, 0.65 s its own
        eng.submit(GenerateRequest(prompt_ids=prompt(65, 2), max_tokens=4))
    eng._step_ends_at = None  # without the step in flight it fits
    eng.submit(GenerateRequest(prompt_ids=prompt(65, 3), max_tokens=4))


async def test_warm_up_times_make_the_first_burst_predictable():
    """The runner's timed warm-up runs reach the step-cost model before any request ran:
    a burst into a fresh engine is admitted up to what it can start, then refused at
    once, not queued to be shed later."""
    runner = FakeRunner(limits=LIMITS, num_pages=1024)
    eng = Engine(runner, FakeDetokenizer(), SchedulerConfig(max_running=2, ttft_target_s=1.0,
                                                            ttft_factor_uncalibrated=1.0))
    runner.warmup_times.append((2, 0, 0.1))  # compiled and timed in the background
    assert eng.scheduler.cost.decode_time(2) is None
    eng.submit(GenerateRequest(prompt_ids=prompt(4), max_tokens=4))
    eng.submit(GenerateRequest(prompt_ids=prompt(4, 2), max_tokens=4))
    assert eng.scheduler.cost.decode_time(2) == 0.1
    # Two running answers of up to 200 tokens at 0.1 s a step: a slot in ~10 s.
    with pytest.raises(Overloaded) as e:
        eng.submit(GenerateRequest(prompt_ids=prompt(4, 3), max_tokens=200))
    assert e.value.reason == "ttft_target" and e.value.retry_after_s > 1.0
    # Short answers (4 tokens: a slot in 0.2 s) are expected to fit.
    eng.submit(GenerateRequest(prompt_ids=prompt(4, 4), max_tokens=4))
    # Before the prompt is tokenized, the body's max_tokens is judged the same way.
    eng.precheck(max_tokens=4)
    with pytest.raises(Overloaded):
        eng.precheck()  # none given: an answer of the prior's length (256 tokens)


async def test_each_first_token_is_reported_beside_its_predicted_ttft(nursery):
    """The door learns how late first tokens come against its predictions (the
    calibration itself is in test_admission.py): each admitted interactive request's
    measured TTFT reaches `Admission.first_token` with what the door predicted."""
    # (slack 3: the second, predicted at the target itself, is admitted uncalibrated)
    eng = Engine(FakeRunner(limits=LIMITS, num_pages=1024), FakeDetokenizer(),
                 SchedulerConfig(ttft_target_s=1.0, ttft_slack=3.0))
    eng.scheduler.cost.prefill_token_s = 0.01
    seen = []
    eng.admission.first_token = lambda measured, predicted: seen.append((measured, predicted))
    handles = [eng.submit(GenerateRequest(prompt_ids=prompt(50, i), max_tokens=3))
               for i in range(2)]
    handles.append(eng.submit(GenerateRequest(prompt_ids=prompt(50, 9), max_tokens=3,
                                              batch=True)))
    await nursery.start(eng.run)
    await collect_all(handles)
    assert len(seen) == 2  # the batch job is not the door's to judge
    predicted = sorted(p for _, p in seen)
    # Alone: its own 0.5 s of prefill; the second: 0.5 s more ahead of it.
    assert predicted == pytest.approx([0.5, 1.0], abs=0.05)
    assert all(m >= 0 for m, _ in seen) and eng.stats().ttft_factor == 1.5  # uncalibrated


@pytest.mark.parametrize("overlap", [False, True])
async def test_step_time_prediction_error_is_counted(overlap):
    """Each step's measured / predicted time lands in a histogram (/metrics reads it)."""
    from scheduler.step_log import PREDICTION_BUCKETS

    runner = FakeRunner(limits=LIMITS)
    runner.warmup_times.append((8, 0, 0.02))  # predicted: 20 ms a decode step
    runner.device_seconds = 0.03  # measured: 30 ms (ratio 1.5)
    # (no proposals: a verify would take the step after it out of the overlap counted here)
    eng = Engine(runner, FakeDetokenizer(), SchedulerConfig(overlap=overlap,
                                                            speculative="off"))
    async with trio.open_nursery() as nursery:
        await nursery.start(eng.run)
        await collect(eng.submit(GenerateRequest(prompt_ids=prompt(4), max_tokens=6)))
        nursery.cancel_scope.cancel()
    counts, total = eng.stats().step_prediction
    # The first decode step ran 1.5x the warm-up figure; its time then replaced the seed,
    # and the later ones ran as predicted (overlapped, the step launched before the first
    # one's time was known was planned from the seed too).
    assert counts[PREDICTION_BUCKETS.index(1.5)] == 1 + overlap
    assert counts[PREDICTION_BUCKETS.index(1.0)] >= 2
    assert total == pytest.approx(1.5 * (1 + overlap) + counts[PREDICTION_BUCKETS.index(1.0)])
    # Every step's host work around its computation is counted too (/metrics:
    # sluice:step_host_seconds), and the computation's seconds add up.
    stats = eng.stats()
    host_counts, host_sum = stats.step_host
    assert sum(host_counts) == stats.steps and host_sum >= 0.0
    assert stats.compute_s == pytest.approx(0.03 * stats.steps)
    assert all(r.compute_s == pytest.approx(0.03) and r.host_s >= 0 for r in eng.step_records)


async def test_prompt_logprobs_cover_every_prompt_token_once(nursery):
    """A scored prompt (completions' `echo` + `logprobs`) is computed whole, in chunks,
    even when its prefix is cached: each prompt token after the first gets its logprob
    exactly once, in the first token event; the prefix cache still serves the others."""
    runner = FakeRunner(limits=LIMITS, num_pages=256)
    eng = await start(nursery, runner)
    p = prompt(40)
    warm = await collect(eng.submit(GenerateRequest(prompt_ids=p + [1], max_tokens=2)))
    assert warm.final.cached_tokens == 0
    r = await collect(eng.submit(GenerateRequest(prompt_ids=p + [2], max_tokens=3,
                                                 prompt_logprobs=2)))
    scores = r.events[0].prompt_logprobs
    assert [s.token_id for s in scores] == (p + [2])[1:]
    assert [s.logprob for s in scores] == [-(j + s.token_id / 1000)
                                           for j, s in enumerate(scores)]
    assert all(not e.prompt_logprobs for e in r.events[1:-1])
    assert r.final.cached_tokens == 0 and r.tokens == runner.reference(p + [2], 3)
    again = await collect(eng.submit(GenerateRequest(prompt_ids=p + [3], max_tokens=2)))
    assert again.final.cached_tokens >= 32  # the scored run's pages joined the cache
    assert eng.stats().kv_pages_in_use == 0


async def test_prompt_logprobs_survive_preemption(nursery):
    runner = FakeRunner(limits=LIMITS, num_pages=25)  # too few pages for all four
    eng = await start(nursery, runner, kv_reserve_pages=1)
    reqs = [GenerateRequest(prompt_ids=prompt(22, i), max_tokens=30, prompt_logprobs=0)
            for i in range(4)]
    results = await collect_all([eng.submit(r) for r in reqs])
    assert eng.stats().preemptions > 0
    for req, r in zip(reqs, results):
        got = [e.prompt_logprobs for e in r.events[:-1] if e.prompt_logprobs]
        assert len(got) == 1
        assert [s.token_id for s in got[0]] == list(req.prompt_ids[1:])
        assert r.tokens == runner.reference(req.prompt_ids, 30)
    assert eng.stats().kv_pages_in_use == 0
