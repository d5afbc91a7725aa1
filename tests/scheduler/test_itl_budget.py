"""The default's trade between the two SLOs (scheduler/policy.py, `StepCostModel.itl_budget`):
prompt chunks beside the streams' decodes fill the ITL target where the decodes leave room
under it, the learned costs' share where they do not, and grow past either when a prompt
would otherwise miss its TTFT target. On the fake clock of test_itl_target.py: each step
"takes" what a synthetic cost of its compiled shape and attention work says."""

from __future__ import annotations

from .test_itl_target import Driver, prompt

TARGET = 0.05  # the seed's 50 ms


def _streams(d: Driver, n: int) -> None:
    """`n` streams decoding (short prompts, long answers), their prompts done, and a few
    decode steps measured (what the budget's decode time is)."""
    for i in range(n):
        d.sim.submit(prompt(100 + i, 32), max_tokens=4000)
    while any(s.num_generated == 0 for s in d.sched.running.values()) or d.sched.num_waiting:
        d.step()
    for _ in range(8):
        d.step()


def _chunks(d: Driver, seq, since: int = 0) -> list[tuple[int, str, float]]:
    """(tokens, why, budget) of each prompt chunk of `seq` in the steps after `since`."""
    return [(len(c.token_ids), b.why, b.budget_s) for b in d.batches[since:]
            for s, c in zip(b.seqs, b.plan.chunks)
            if s is seq and c.start_pos < seq.num_prompt_tokens]


def _until_first_token(d: Driver, seq) -> None:
    while seq.num_generated == 0:
        assert d.step()


def test_with_headroom_a_prompts_chunk_grows_to_the_target_and_shrinks_without_it():
    """A document too long for any TTFT (3,000 tokens): only the ITL budget sizes its
    chunks. Beside 2 streams (decodes ~17 ms) they fill the 50 ms target; beside 15 (their
    decodes alone ~60 ms: the target cannot hold) they get the derived share, 40% of the
    decode step (`prefill_slowdown`), planned at the measured cost of a prompt token."""
    sizes, rooms = {}, {}
    for n in (2, 15):
        d = Driver(itl=TARGET, strict=False)
        _streams(d, n)
        mark = len(d.batches)
        doc = d.sim.submit(prompt(1, 3000), max_tokens=1)
        for _ in range(10):
            d.step()
        chunks = _chunks(d, doc, mark)
        assert len(chunks) >= 8
        whys = {why for _, why, _ in chunks}
        budgets = {round(b, 4) for _, _, b in chunks}
        sizes[n] = min(t for t, _, _ in chunks)
        budget, _, decode = d.sched.cost.itl_budget(n)
        rooms[n] = budget - decode  # seconds of prompt a step may carry
        if n == 2:
            assert whys == {"itl-target"} and budgets == {TARGET}
        else:
            assert whys == {"itl-derived"} and min(budgets) > TARGET
    # the prompt's share of a step grows with the headroom; a chunk never stops
    assert rooms[2] > rooms[15] > 0 and min(sizes.values()) >= 16


def test_a_prompt_the_pace_would_make_late_gets_bigger_chunks_and_its_first_token_in_time():
    """300 tokens beside 15 streams: at the derived pace (~20 tokens a ~0.1 s step) its
    first token would come after ~1.5 s; it can make the 1 s target in 64-token chunks,
    so it takes them (plan "ttft"), and comes in time."""
    d = Driver(itl=TARGET, strict=False)
    _streams(d, 15)
    pace = d.sched.cost.prefill_budget(15)
    mark = len(d.batches)
    mid = d.sim.submit(prompt(2, 300), max_tokens=2)
    _until_first_token(d, mid)
    chunks = _chunks(d, mid, mark)
    assert {why for _, why, _ in chunks} == {"ttft"}
    assert min(t for t, _, _ in chunks[:-1]) > pace
    assert d.ttft[mid.seq_id] <= 1.0
    # ... which the pace alone would not have done: the same prompt without a TTFT target
    d = Driver(itl=TARGET, strict=False, ttft_target_s=0.0)
    _streams(d, 15)
    late = d.sim.submit(prompt(2, 300), max_tokens=2)
    _until_first_token(d, late)
    assert d.ttft[late.seq_id] > 1.0


def test_without_headroom_questions_are_spread_and_their_ttft_suffers_only_within_target():
    """Questions of 100 tokens arriving often beside 15 streams (no headroom: the decodes
    alone fill the target; each question is the 16th): each is spread over the steps its
    1 s TTFT leaves room for, so the streams' gaps stay near the budget, and every first
    token comes within the target. With headroom (2 streams) the same questions' first
    tokens come sooner."""
    ttfts = {}
    for n in (2, 15):
        d = Driver(itl=TARGET, strict=False, short_prefill_stall_share=0.0)
        _streams(d, n)
        mark = len(d.batches)
        qs = []
        for i in range(6):
            qs.append(d.sim.submit(prompt(10 + i, 100), max_tokens=2))
            _until_first_token(d, qs[-1])
        ttfts[n] = [d.ttft[q.seq_id] for q in qs]
        assert max(ttfts[n]) <= 1.0, (n, ttfts[n])
        if n == 15:
            # spread: several chunks each, none of them the whole question
            assert all(len(_chunks(d, q, mark)) >= 2 for q in qs)
            assert {why for b in d.batches[mark:] for why in [b.why]} <= {
                "ttft", "itl-derived", "decode-only"}
    assert max(ttfts[2]) < min(ttfts[15])


def test_itl_target_zero_switches_the_budget_off():
    d = Driver(itl=0.0, strict=False)
    _streams(d, 4)
    mark = len(d.batches)
    doc = d.sim.submit(prompt(1, 3000), max_tokens=1)
    for _ in range(4):
        d.step()
    chunks = _chunks(d, doc, mark)
    assert {why for _, why, _ in chunks} == {"unpaced"}
    assert {t for t, _, _ in chunks} == {64}  # the step's whole prompt budget
    assert all(b == 0.0 for _, _, b in chunks)


def test_a_question_is_planned_beside_the_chunks_already_in_its_steps():
    """A question spread over its TTFT target is planned at the step's real length: the
    decodes plus the chunks of the prompts ahead of it in the same step (a second wave
    of questions after a first burst, each planned as if alone in its steps, came at
    1.7x its plan). Beside 60 prompt tokens its steps are longer, so it takes fewer,
    bigger chunks; beside many more it goes in whole."""
    d = Driver(itl=TARGET, strict=False, short_prefill_stall_share=0.0)
    _streams(d, 15)
    q = d.sim.submit(prompt(40, 100), max_tokens=2)
    sched, pace = d.sched, 8
    alone, _ = sched._short_chunk(q, 100, 15, pace)
    crowded, _ = sched._short_chunk(q, 100, 15, pace, beside=60)
    assert pace < alone < crowded < 100
    assert sched._short_chunk(q, 100, 15, pace, beside=400) == (100, "ttft")
