"""Speculative decoding's policy with the fake runner (scheduler/speculative.py).

The fake samples each verify position from its page-content pool, so a proposal's key
and value written to the wrong slot, a page released too early, or a rejected proposal
kept would change the tokens against `reference()`. Exactness on the real model is
tests/model/test_speculative_real.py.
"""

from __future__ import annotations

import pytest
import trio

from config.settings import SchedulerConfig
from scheduler.api import FinishEvent, GenerateRequest
from scheduler.engine import Engine
from scheduler.protocol import SamplingParams, StepLimits
from scheduler.speculative import NgramProposer, lookup, _k_for

from .fake_runner import FakeDetokenizer, FakeRunner, succ_rule
from .test_engine import collect_all

LIMITS = StepLimits(max_decode_seqs=16, max_prefill_seqs=2, max_prefill_chunk=16,
                    max_prefill_tokens=32)
GREEDY = SamplingParams(temperature=0.0)


def cycle_rule(period: int):
    """Next token: the one `period` back (the prompt's last `period` tokens repeat)."""
    def rule(ctx):
        return ctx[-period] if len(ctx) >= period else 0
    return rule


def test_lookup_takes_the_latest_longest_match():
    toks = [5, 1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert lookup(toks, 2, 2, 4) == [7, 8]  # "1 2 3" last seen before "7 8"
    assert lookup(toks, 5, 2, 4) == [7, 8, 1, 2, 3]
    assert lookup([1, 2, 3, 4], 3, 2, 4) == []  # nothing repeats
    assert lookup([4, 4], 3, 1, 4) == [4]
    # In a run, the latest match with k tokens after it (the latest has one).
    assert lookup([0] * 9, 3, 2, 2) == [0, 0, 0]
    # The longest n first: "9 1 2" occurred once, before "3 7"; "1 2" later before "5".
    assert lookup([9, 1, 2, 3, 7, 1, 2, 5, 9, 1, 2], 2, 2, 3) == [3, 7]


def test_k_follows_the_acceptance_rate():
    assert _k_for(0.05, 4) == 0
    assert _k_for(0.3, 4) == 1
    assert _k_for(0.6, 4) == 3
    assert _k_for(0.95, 4) == 4


async def run(runner, reqs, **cfg):
    eng = Engine(runner, FakeDetokenizer(), SchedulerConfig(**cfg))
    async with trio.open_nursery() as n:
        await n.start(eng.run)
        handles = [eng.submit(r) for r in reqs]
        results = await collect_all(handles)
        stats = eng.stats(audit=True)
        spec = eng.scheduler.spec_stats()
        n.cancel_scope.cancel()
    return results, stats, spec


@pytest.mark.parametrize("overlap", [True, False])
async def test_verified_tokens_equal_the_reference_and_pages_come_back(overlap):
    """Repetitive sequences (proposals mostly right) and pseudo-random ones (mostly
    wrong) share steps: every output is the reference, every page returns, and the
    repetitive ones were decoded several tokens a step."""
    period = 6
    runner = FakeRunner(limits=LIMITS, page_size=4, num_pages=200, vocab=97,
                        rule=cycle_rule(period))
    prompts = [[(3 * i + j) % 97 for j in range(period)] * 3 for i in range(6)]
    reqs = [GenerateRequest(prompt_ids=p, max_tokens=23 + i, sampling=GREEDY)
            for i, p in enumerate(prompts)]
    results, stats, spec = await run(runner, reqs, speculative="ngram",
                                     num_speculative_tokens=4, overlap=overlap,
                                     max_step_tokens=64, kv_reserve_pages=2)
    for p, req, res in zip(prompts, reqs, results):
        assert isinstance(res.final, FinishEvent), res.final
        assert res.tokens == runner.reference(p, req.max_tokens)
        assert res.final.completion_tokens == req.max_tokens
    assert stats.kv_audit == []
    assert stats.kv_pages_in_use == 0
    assert spec["drafts"] > 0 and spec["accepted_tokens"] > 0.8 * spec["draft_tokens"]
    verify_steps = [p for p in runner.plans if any(c.draft for c in p.chunks)]
    assert verify_steps and max(sum(1 + c.draft for c in p.chunks if c.sample)
                                for p in verify_steps) <= LIMITS.max_decode_seqs


async def test_wrong_proposals_cost_rows_then_stop_and_change_nothing():
    """A rule whose continuations never repeat what came before: outputs still equal the
    reference, and after a few refused proposals a sequence only probes now and then."""
    def rule(ctx):  # 1 at even positions, else a token never seen before
        return 1 if len(ctx) % 2 == 0 else len(ctx) + 100

    runner = FakeRunner(limits=LIMITS, page_size=4, num_pages=200, vocab=1000, rule=rule)
    prompts = [[1, 7, 1, 8, 1, 9, 1, 10] for _ in range(2)]
    reqs = [GenerateRequest(prompt_ids=p, max_tokens=60, sampling=GREEDY) for p in prompts]
    results, stats, spec = await run(runner, reqs, speculative="ngram", ngram_min=1)
    for p, res in zip(prompts, results):
        assert res.tokens == runner.reference(p, 60)
    assert stats.kv_audit == [] and stats.kv_pages_in_use == 0
    steps = len(runner.plans)
    verify_steps = sum(1 for p in runner.plans if any(c.draft for c in p.chunks))
    assert verify_steps < 0.3 * steps, (verify_steps, steps)


async def test_a_stop_inside_accepted_tokens_ends_there():
    """Stop ids, stop strings and max_tokens cut a verify's tokens where plain decoding
    stops: the same events, the same usage."""
    prompt = list(range(10, 30)) + list(range(10, 20))  # 10..19 seen: 20.. proposed

    def reqs():
        return [GenerateRequest(prompt_ids=prompt, max_tokens=40, sampling=GREEDY,
                                stop_token_ids=(25,)),
                GenerateRequest(prompt_ids=prompt, max_tokens=7, sampling=GREEDY),
                GenerateRequest(prompt_ids=prompt, max_tokens=40, sampling=GREEDY,
                                stop=("x",))]  # token 23 is "x"

    outs = {}
    for mode in ("off", "ngram"):
        runner = FakeRunner(limits=LIMITS, page_size=4, num_pages=200, vocab=50,
                            rule=succ_rule(50))
        results, stats, spec = await run(runner, reqs(), speculative=mode)
        outs[mode] = [(r.tokens, r.text, r.final.finish_reason, r.final.completion_tokens)
                      for r in results]
        assert stats.kv_pages_in_use == 0 and stats.kv_audit == []
    assert outs["ngram"] == outs["off"]
    assert [o[2] for o in outs["off"]] == ["stop", "length", "stop"]
    assert spec["accepted_tokens"] > 0


async def test_no_proposals_beside_a_prompt_chunk():
    runner = FakeRunner(limits=LIMITS, page_size=4, num_pages=200, vocab=50,
                        rule=succ_rule(50))
    prompt = list(range(10, 30)) + list(range(10, 20))
    reqs = [GenerateRequest(prompt_ids=prompt, max_tokens=30, sampling=GREEDY),
            GenerateRequest(prompt_ids=list(range(40)), max_tokens=3, sampling=GREEDY)]
    await run(runner, reqs, speculative="ngram")
    for p in runner.plans:
        if any(c.draft for c in p.chunks):
            assert all(len(c.token_ids) == 1 or c.draft for c in p.chunks), p


def test_the_proposer_keeps_its_buffer_in_step_with_the_sequence():
    from scheduler.request import Sequence
    seq = Sequence(GenerateRequest(prompt_ids=[1, 2, 3, 1, 2], max_tokens=5),
                   request_id="r", seq_id=0, arrived_at=0.0, deadline_at=1.0)
    prop = NgramProposer(2, 3)
    assert prop.propose(seq, 3) == [3, 1, 2]
    seq.token_ids.extend([3, 9])
    assert prop.propose(seq, 3) == []
    seq.token_ids.extend([1, 2])
    assert prop.propose(seq, 2) == [3, 9]


class Refuse:
    """A grammar stand-in that refuses one token (the fake runner applies no mask)."""

    error = None
    finished = False

    def __init__(self, token: int) -> None:
        self.token = token
        self.cut = 0

    def fill(self, row):
        pass

    def accept(self, t):
        return t != self.token

    def valid_prefix(self, tokens):
        n = list(tokens).index(self.token) if self.token in tokens else len(tokens)
        self.cut += n < len(tokens)
        return n

    def after(self, tokens):
        return self


async def test_a_proposal_the_grammar_refuses_is_never_verified():
    runner = FakeRunner(limits=LIMITS, page_size=4, num_pages=200, vocab=100,
                        rule=succ_rule(100))
    # After "9 10 11" the lookup finds "10 11" at the start, followed by 12, 99, 5, 6.
    prompt = [10, 11, 12, 99, 5, 6, 7, 8, 9]
    grammar = Refuse(99)
    reqs = [GenerateRequest(prompt_ids=prompt, max_tokens=12, sampling=GREEDY,
                            constraint=grammar)]
    results, stats, spec = await run(runner, reqs, speculative="ngram")
    assert results[0].tokens == runner.reference(prompt, 12)
    assert grammar.cut > 0
    verified = [c.token_ids[1:] for p in runner.plans for c in p.chunks if c.draft]
    assert verified and all(99 not in props for props in verified)


def test_verifies_are_planned_within_a_strict_itl_target():
    """`--itl-target` with `--itl-strict`: steps that carry verifies are predicted within
    the target like any other (the cost model knows a verify's rows), and the
    predictions are the steps' times."""
    from .test_itl_target import Driver

    d = Driver(itl=0.1)
    d.runner.rule = cycle_rule(5)
    for i in range(24):
        d.sim.submit([(7 * i + j) % 90 + 1 for j in range(5)] * 8, max_tokens=40 + i % 7)
    d.run(3000)
    assert all(seq.num_generated == seq.max_tokens for seq in d.sim.seqs.values())
    verifies = [b for b in d.batches if b.draft_rows]
    assert len(verifies) > 10 and d.sched.spec.accepted_tokens > 50
    assert max(p for p, _, _, nd in d.steps if nd) <= 0.1 + 1e-9
    assert all(abs(p - t) < 1e-3 * t for p, t, _, _ in d.steps)
    assert d.sched.pages.num_in_use == 0


async def test_adapter_sequences_verify_under_their_own_slot():
    """Two adapters and the base model share verify steps: each row runs under its
    sequence's adapter (the fake adds the adapter's offset), outputs equal the reference."""
    period = 5
    runner = FakeRunner(limits=LIMITS, page_size=4, num_pages=300, vocab=97,
                        rule=cycle_rule(period), adapter_slots=2)
    prompts = [[(11 * i + j) % 97 for j in range(period)] * 3 for i in range(3)]
    adapters = ["alpha", "beta", None]
    reqs = [GenerateRequest(prompt_ids=p, max_tokens=30, sampling=GREEDY, adapter=a)
            for p, a in zip(prompts, adapters)]
    results, stats, spec = await run(runner, reqs, speculative="ngram")
    for p, a, res in zip(prompts, adapters, results):
        assert res.tokens == runner.reference(p, 30, adapter=a), a
    assert spec["drafts"] > 0 and stats.kv_pages_in_use == 0 and stats.kv_audit == []
    assert any(c.draft and c.adapter_slot >= 0 for p in runner.plans for c in p.chunks)


def brute_lookup(toks, k, min_n, max_n):
    """`lookup` by a full scan: the last 4 earlier starts of the final min_n tokens, the
    longest n they extend to, the latest with k tokens after it, else the most tokens."""
    total = len(toks)
    starts = [s for s in range(total - min_n) if toks[s:s + min_n] == toks[total - min_n:]][-4:]
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        follows = [toks[p + min_n:p + min_n + k] for p in starts
                   if p >= n - min_n and toks[p - (n - min_n):p + min_n] == toks[total - n:]]
        full = [f for f in follows if len(f) == k]
        if full:
            return full[-1]
        if any(follows):
            return max(reversed(follows), key=len)
    return []


def test_the_incremental_index_finds_what_a_full_scan_finds():
    import random

    from scheduler.speculative import SpecState

    rng = random.Random(0)
    for trial in range(60):
        alphabet = rng.randint(2, 6)
        toks = [rng.randrange(alphabet) for _ in range(3)]
        state = SpecState()
        min_n, max_n = rng.choice([(1, 3), (2, 4), (2, 2), (3, 5)])
        for _ in range(120):
            k = rng.randint(1, 5)
            assert lookup(toks, k, min_n, max_n, state) == brute_lookup(toks, k, min_n, max_n)
            toks.extend(rng.randrange(alphabet) for _ in range(rng.randint(1, 3)))
