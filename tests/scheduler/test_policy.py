"""The per-iteration policy, driven synchronously with the fake runner (no trio)."""

from __future__ import annotations

from config.settings import SchedulerConfig
from scheduler.protocol import StepLimits
from scheduler.request import Phase

from .fake_runner import FakeRunner
from .sim import Sim

LIMITS = StepLimits(max_decode_seqs=12, max_prefill_seqs=2, max_prefill_chunk=16,
                    max_prefill_tokens=24)


def prompt(n, base=1):
    return [(base + 7 * i) % 97 for i in range(n)]


def test_outputs_match_unbatched_reference():
    runner = FakeRunner(limits=LIMITS)
    sim = Sim(runner, SchedulerConfig(max_step_tokens=32))
    seqs = [sim.submit(prompt(5 + 9 * i, base=i), max_tokens=6 + i) for i in range(10)]
    sim.run()
    for s in seqs:
        assert s.phase is Phase.DONE
        assert s.output_ids == runner.reference(s.prompt_ids, s.max_tokens)
    assert sim.sched.pages.num_in_use == 0


def test_token_budget_and_limits_never_exceeded():
    runner = FakeRunner(limits=LIMITS)
    cfg = SchedulerConfig(max_step_tokens=20, max_running=6)
    sim = Sim(runner, cfg)
    for i in range(30):
        sim.submit(prompt(1 + (i * 37) % 80, base=i), max_tokens=1 + i % 9)
    sim.run()
    assert len(sim.finished) == 30
    for b in sim.batches:
        chunks = b.plan.chunks
        dec, pf = chunks[:b.num_decode], chunks[b.num_decode:]
        assert b.plan.num_tokens <= cfg.max_step_tokens
        assert len(dec) <= LIMITS.max_decode_seqs and all(len(c.token_ids) == 1 for c in dec)
        assert len(pf) <= LIMITS.max_prefill_seqs
        assert all(len(c.token_ids) <= LIMITS.max_prefill_chunk for c in pf)
        assert sum(len(c.token_ids) for c in pf) <= LIMITS.max_prefill_tokens
    # the budget was actually used: some steps ran full
    assert max(b.plan.num_tokens for b in sim.batches) == cfg.max_step_tokens


def test_long_prefill_is_chunked_and_never_starves_decodes():
    runner = FakeRunner(limits=LIMITS, num_pages=1024)  # room for 8 decodes + 1 prefill
    sim = Sim(runner, SchedulerConfig(max_step_tokens=32))
    streams = [sim.submit(prompt(6, base=i), max_tokens=400) for i in range(8)]
    for _ in range(5):  # two prefill chunks a step
        sim.step()
    assert all(s.phase is Phase.DECODE for s in streams)
    long = sim.submit(prompt(2000), max_tokens=2)
    steps = 0
    while long.phase is not Phase.DECODE:
        b = sim.step()
        steps += 1
        decoded = {c.seq_id for c in b.plan.chunks[:b.num_decode]}
        assert decoded == {s.seq_id for s in streams}, "a decode was skipped"
        pf = [c for c in b.plan.chunks[b.num_decode:] if c.seq_id == long.seq_id]
        assert len(pf) == 1 and len(pf[0].token_ids) <= LIMITS.max_prefill_chunk
    assert steps >= 2000 // LIMITS.max_prefill_chunk
    sim.run()
    assert long.output_ids == runner.reference(long.prompt_ids, 2)


def test_joins_at_once_and_leaves_in_the_same_iteration():
    runner = FakeRunner(limits=LIMITS)
    sim = Sim(runner, SchedulerConfig())
    a = sim.submit(prompt(4), max_tokens=3)
    sim.step()
    sim.step()
    b = sim.submit(prompt(4, base=5), max_tokens=3)
    batch = sim.step()  # a's last token, and b's prefill, in one step
    assert {c.seq_id for c in batch.plan.chunks} == {a.seq_id, b.seq_id}
    assert a.phase is Phase.DONE and a.kv_pages == []  # left, pages back, same iteration
    assert sim.sched.pages.num_in_use == len(b.kv_pages)


def test_priority_order_of_admission():
    runner = FakeRunner(limits=LIMITS)
    sim = Sim(runner, SchedulerConfig(max_running=1))
    first = sim.submit(prompt(4), max_tokens=3)
    sim.step()
    low = sim.submit(prompt(4, 2), max_tokens=2, priority=5)
    high = sim.submit(prompt(4, 3), max_tokens=2, priority=0)
    mid = sim.submit(prompt(4, 4), max_tokens=2, priority=2)
    high2 = sim.submit(prompt(4, 5), max_tokens=2, priority=0)
    sim.run()
    order = [s.seq_id for s in sorted(sim.finished, key=lambda s: s.admitted_at)]
    assert order == [first.seq_id, high.seq_id, high2.seq_id, mid.seq_id, low.seq_id]


def test_batch_requests_wait_for_interactive_ones():
    runner = FakeRunner(limits=LIMITS)
    sim = Sim(runner, SchedulerConfig(max_running=2))
    # tenant "a" may run one at a time; its second request waits, and a batch job must
    # not take the free slot while an interactive request is waiting
    a1 = sim.submit(prompt(4), max_tokens=4, tenant="a", tenant_max_running=1)
    a2 = sim.submit(prompt(4, 2), max_tokens=4, tenant="a", tenant_max_running=1)
    job = sim.submit(prompt(4, 3), max_tokens=2, tenant="b", batch=True)
    sim.step()
    assert a1.is_running and a2.phase is Phase.QUEUED and job.phase is Phase.QUEUED
    sim.run()
    assert job.admitted_at >= a2.admitted_at


def test_tenant_concurrency_limit_lets_others_through():
    runner = FakeRunner(limits=LIMITS)
    sim = Sim(runner, SchedulerConfig(max_running=4))
    hog = [sim.submit(prompt(4, i), max_tokens=6, tenant="hog", tenant_max_running=2)
           for i in range(6)]
    other = sim.submit(prompt(4, 9), max_tokens=6, tenant="other")
    sim.step()
    sim.step()  # two admissions a step (max_prefill_seqs)
    running = list(sim.sched.running.values())
    assert sum(s.tenant == "hog" for s in running) == 2 and other.is_running
    while sim.step() is not None:
        assert sum(s.tenant == "hog" for s in sim.sched.running.values()) <= 2
    assert all(s.phase is Phase.DONE for s in hog)


def _share(sim, tenant_a, tenant_b):
    """Tokens computed per tenant over the steps where both had requests waiting."""
    served = {tenant_a: 0, tenant_b: 0}
    while True:
        waiting = {s.tenant for s in sim.sched.waiting}
        if waiting != {tenant_a, tenant_b}:
            return served
        b = sim.step()
        for c in b.plan.chunks:
            served[sim.seqs[c.seq_id].tenant] += len(c.token_ids)


def test_fair_share_when_one_tenant_floods():
    runner = FakeRunner(limits=LIMITS, num_pages=1024)
    sim = Sim(runner, SchedulerConfig(max_running=8, max_step_tokens=32))
    for i in range(400):  # the flood arrives first
        sim.submit(prompt(12, i), max_tokens=12, tenant="flood")
    for i in range(40):
        sim.submit(prompt(8 + i % 9, i), max_tokens=10 + i % 7, tenant="calm")
    served = _share(sim, "flood", "calm")
    share = served["calm"] / sum(served.values())
    assert sum(served.values()) > 500
    assert abs(share - 0.5) <= 0.05, served


def test_weighted_fair_share():
    runner = FakeRunner(limits=LIMITS, num_pages=1024)
    sim = Sim(runner, SchedulerConfig(max_running=8, max_step_tokens=32))
    for i in range(400):
        sim.submit(prompt(12, i), max_tokens=12, tenant="flood", weight=1.0)
    for i in range(80):
        sim.submit(prompt(10, i), max_tokens=14, tenant="gold", weight=3.0)
    served = _share(sim, "flood", "gold")
    share = served["gold"] / sum(served.values())
    assert abs(share - 0.75) <= 0.075, served


def test_preemption_by_recompute_gives_the_unpreempted_tokens():
    # 24 usable pages of 4 tokens; 4 sequences that each grow to 10 pages cannot all fit.
    runner = FakeRunner(limits=LIMITS, num_pages=25)
    sim = Sim(runner, SchedulerConfig(kv_reserve_pages=1))
    seqs = [sim.submit(prompt(6, i), max_tokens=34, priority=i % 2) for i in range(4)]
    sim.run()
    assert sim.sched.num_preemptions > 0
    assert any(s.num_preemptions for s in seqs)
    for s in seqs:
        assert s.output_ids == runner.reference(s.prompt_ids, 34)
    # victims are the least urgent: priority 1 before priority 0
    first_victim = next(sid for b in sim.batches for sid in b.preempted)
    assert sim.seqs[first_victim].priority == 1
    # a returning sequence recomputes its prompt + generated tokens, mostly cache hits
    assert sim.sched.pages.hit_tokens > 0


def test_victim_is_latest_arrived_of_the_lowest_priority():
    runner = FakeRunner(limits=LIMITS, num_pages=13)  # 12 pages
    sim = Sim(runner, SchedulerConfig(kv_reserve_pages=0))
    early = sim.submit(prompt(4, 1), max_tokens=20, priority=3)
    urgent = sim.submit(prompt(4, 2), max_tokens=20, priority=0)
    late = sim.submit(prompt(4, 3), max_tokens=20, priority=3)
    while not any(b.preempted for b in sim.batches):
        sim.step()
    assert next(b.preempted for b in sim.batches if b.preempted) == [late.seq_id]
    sim.run()
    for s in (early, urgent, late):
        assert s.output_ids == sim.runner.reference(s.prompt_ids, 20)


def test_full_prefix_hit_copies_the_last_page_before_writing():
    runner = FakeRunner(limits=LIMITS)
    sim = Sim(runner, SchedulerConfig())
    p = prompt(8)  # exactly two pages
    a = sim.submit(p, max_tokens=10)
    sim.step()  # a's prompt is computed and cached; a keeps running
    b = sim.submit(p, max_tokens=10)
    batch = sim.step()
    assert b.num_cached_tokens == 7  # everything but the last position, recomputed
    [(src, dst)] = batch.plan.copies
    assert src == a.kv_pages[1] and b.kv_pages == [a.kv_pages[0], dst]
    [chunk] = [c for c in batch.plan.chunks if c.seq_id == b.seq_id]
    assert chunk.start_pos == 7 and list(chunk.token_ids) == p[7:]
    sim.run()
    assert a.output_ids == b.output_ids == runner.reference(p, 10)


def test_shared_system_prompt_is_read_once():
    runner = FakeRunner(limits=LIMITS, num_pages=2048)
    sim = Sim(runner, SchedulerConfig(max_step_tokens=32, max_running=8))
    system = prompt(200)
    first = sim.submit(system + [1, 2, 3], max_tokens=4)
    sim.run()
    rest = [sim.submit(system + [i, i + 1, 5], max_tokens=4) for i in range(32)]
    sim.run()
    assert first.num_cached_tokens == 0
    for s in rest:
        assert s.num_cached_tokens >= 0.9 * s.num_prompt_tokens
        assert s.output_ids == runner.reference(s.prompt_ids, 4)


def test_concurrent_requests_wait_for_a_shared_prefix_being_computed():
    runner = FakeRunner(limits=StepLimits(max_decode_seqs=16, max_prefill_seqs=4,
                                          max_prefill_chunk=64, max_prefill_tokens=256),
                        num_pages=2048)
    sim = Sim(runner, SchedulerConfig(max_step_tokens=256, max_running=16))
    system = prompt(150)
    seqs = [sim.submit(system + [i, 3, i], max_tokens=5) for i in range(12)]
    other = sim.submit(prompt(40, 5), max_tokens=5)  # unrelated: not held back
    sim.step()
    assert seqs[0].is_running and other.is_running
    assert all(s.phase is Phase.QUEUED for s in seqs[1:])
    sim.run()
    for s in seqs[1:]:
        assert s.num_cached_tokens >= 0.9 * s.num_prompt_tokens
    for s in seqs + [other]:
        assert s.output_ids == runner.reference(s.prompt_ids, 5)


def test_static_mode_runs_groups_to_completion():
    runner = FakeRunner(limits=LIMITS)
    sim = Sim(runner, SchedulerConfig(mode="static", static_batch_size=3))
    seqs = [sim.submit(prompt(4 + i, i), max_tokens=2 + 3 * (i % 3)) for i in range(7)]
    sim.run()
    groups = [seqs[0:3], seqs[3:6], seqs[6:]]
    for earlier, later in zip(groups, groups[1:]):
        ends = [sim.batches.index(b) for b in sim.batches
                if any(c.seq_id in {s.seq_id for s in earlier} for c in b.plan.chunks)]
        starts = [sim.batches.index(b) for b in sim.batches
                  if any(c.seq_id in {s.seq_id for s in later} for c in b.plan.chunks)]
        assert max(ends) < min(starts), "next group started before the last one finished"
    # each group was admitted at once: its members share one admission time
    for g in groups:
        assert len({s.admitted_at for s in g}) == 1
    for s in seqs:
        assert s.output_ids == runner.reference(s.prompt_ids, s.max_tokens)


def test_admission_keeps_the_reserve_and_blocks_behind_a_big_head():
    runner = FakeRunner(limits=LIMITS, num_pages=21)  # 20 pages
    sim = Sim(runner, SchedulerConfig(kv_reserve_pages=4))
    a = sim.submit(prompt(40), max_tokens=2)  # 10 pages: admitted (nothing runs yet)
    big = sim.submit(prompt(28, 3), max_tokens=2)  # 7 pages + 4 reserve > 10 left
    small = sim.submit(prompt(4, 5), max_tokens=2)  # would fit, but waits behind big
    sim.step()
    assert a.is_running and big.phase is Phase.QUEUED and small.phase is Phase.QUEUED
    sim.run()
    assert small.admitted_at >= big.admitted_at


def test_prefix_cache_off_shares_nothing():
    runner = FakeRunner(limits=LIMITS)
    sim = Sim(runner, SchedulerConfig(prefix_cache=False))
    p = prompt(8)
    a = sim.submit(p, max_tokens=4)
    sim.run()
    b = sim.submit(p, max_tokens=4)
    sim.run()
    assert b.num_cached_tokens == 0 and sim.sched.pages.num_cached == 0
    assert a.output_ids == b.output_ids == runner.reference(p, 4)
    assert not any(batch.plan.copies for batch in sim.batches)


def test_queued_prompts_count_a_shared_prefix_once():
    """A burst that carries one system prompt: the first request will compute it, the
    ones queued behind it will find it cached. The queue's prefill work (what admission
    predicts the wait from) counts it once, before anything ran or was cached."""
    runner = FakeRunner(limits=LIMITS, page_size=4, num_pages=1024)
    sim = Sim(runner, SchedulerConfig(max_step_tokens=32))
    system = prompt(200, base=3)
    seqs = [sim.submit(system + prompt(10, base=50 + i), max_tokens=3) for i in range(5)]
    assert seqs[0].uncached_tokens == 210
    # Each later one: only its own 10 tokens.
    assert all(s.uncached_tokens == 10 for s in seqs[1:])
    assert sim.sched.waiting_uncached_tokens == 210 + 4 * 10
    other = sim.submit(prompt(30, base=90), max_tokens=3)
    assert other.uncached_tokens == 30
    sim.run()
    assert sim.sched.waiting_uncached_tokens == 0 and not sim.sched._promised
    # Afterwards the cache holds it: a newcomer is judged on what it would compute.
    late = sim.submit(system + prompt(12, base=77), max_tokens=3)
    assert late.uncached_tokens == 12
    sim.run()
    assert sim.sched.pages.num_in_use == 0


def test_a_request_sharing_a_prefix_being_computed_waits_for_it():
    runner = FakeRunner(limits=LIMITS, page_size=4, num_pages=1024)
    sim = Sim(runner, SchedulerConfig(max_step_tokens=32))
    system = prompt(200, base=3)
    first = sim.submit(system + prompt(10, base=50), max_tokens=3)
    sim.step()  # admitted, its first chunk computed
    assert 0 < first.num_computed_tokens < 200
    from scheduler.api import GenerateRequest
    from scheduler.request import Sequence

    later = Sequence(GenerateRequest(prompt_ids=system + prompt(9, base=60), max_tokens=3),
                     request_id="x", seq_id=99, arrived_at=0.0, deadline_at=1e9)
    assert sim.sched.prefix_wait_tokens(later) == 200 - first.num_computed_tokens
    stranger = Sequence(GenerateRequest(prompt_ids=prompt(50, base=11), max_tokens=3),
                        request_id="y", seq_id=98, arrived_at=0.0, deadline_at=1e9)
    assert sim.sched.prefix_wait_tokens(stranger) == 0
    sim.run()
    assert sim.sched.prefix_wait_tokens(later) == 0  # computed, cached: nothing to wait for
