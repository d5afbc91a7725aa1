"""Speculative decoding through the real runner (scheduler/speculative.py): nothing changes.

- Greedy: 200 random prompts (a tiny random model of the same code, f32) give token for
  token the same answers with n-gram proposals as without, batched and alone; so do the
  19 prompts of the fidelity set on the embedded model.
- Seeded sampling with penalties and logprobs: the same tokens and the same logprobs.
- Unseeded sampling: the verify's tokens follow the model's distribution (a chi-square
  test over a 24-token vocabulary), accepted proposal or not.
- A grammar's mask holds at every verify position: a forbidden proposal is never accepted.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

from config.settings import SchedulerConfig
from model.config import ModelConfig
from model.runner import ModelRunner, enable_compilation_cache
from scheduler.api import FinishEvent, GenerateRequest, TokenEvent
from scheduler.engine import Engine
from scheduler.protocol import SamplingParams, SeqChunk, StepPlan

from .test_runner import TINY, random_params

GREEDY = SamplingParams(temperature=0.0)


class Detok:
    """Token t is the letter a + t mod 26 (text only matters for stop strings)."""

    class _D:
        def push(self, t):
            return chr(97 + t % 26)

        def flush(self):
            return ""

    def incremental(self, prompt_ids):
        return self._D()


@pytest.fixture(scope="module")
def runner():
    enable_compilation_cache()
    r = ModelRunner(TINY, random_params(TINY, seed=3), page_size=8, num_pages=600,
                    max_context=512, decode_buckets=(1, 4, 8, 16), prefill_buckets=(32, 64),
                    block_q=8, max_prefill_seqs=2, dtype="float32")
    r.warmup()
    return r


async def generate(runner, reqs, *, speculative: str, concurrent: bool, detok=None,
                   max_running: int = 6, proposer=None, seen: list | None = None,
                   overlap: bool = False):
    """Each request's (tokens, logprobs, final event) and the speculation stats; the
    engine's last stats appended to `seen`."""
    # 6 streams: the 16-row decode bucket leaves rows for their proposals. No overlap
    # (tests/scheduler covers it with proposals).
    cfg = SchedulerConfig(speculative=speculative, ttft_target_s=0.0, max_running=max_running,
                          draft_model="draft" if speculative == "draft" else None,
                          overlap=overlap,
                          max_step_tokens=80, queue_deadline_s=600.0, max_waiting=1000,
                          kv_reserve_pages=2)
    engine = Engine(runner, detok or Detok(), cfg, proposer=proposer)
    # Proposals wherever there are rows for them: whether they pay on this CPU is the
    # policy's business (tests/scheduler), what they produce is this file's.
    engine.scheduler._spec_step_time = lambda rows, explore=True: 0.0
    out = [None] * len(reqs)

    async def one(i):
        h = engine.submit(reqs[i])
        toks, lps = [], []
        async for ev in h.events:
            if isinstance(ev, TokenEvent):
                toks.extend(ev.token_ids)
                lps.extend(ev.logprobs or [])
            else:
                out[i] = (toks, lps, ev)

    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        if concurrent:
            async with trio.open_nursery() as inner:
                for i in range(len(reqs)):
                    inner.start_soon(one, i)
        else:
            for i in range(len(reqs)):
                await one(i)
        stats = engine.stats(audit=True)
        spec = engine.scheduler.spec_stats()
        nursery.cancel_scope.cancel()
    assert stats.kv_audit == [] and stats.kv_pages_in_use == 0
    assert not stats.kv_window or stats.kv_window["pages_in_use"] == 0
    if seen is not None:
        seen.append(stats)
    assert all(isinstance(o[2], FinishEvent) for o in out), [o[2] for o in out]
    return out, spec


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves now and then (small alphabets, copied spans), as
    text does, so that proposals are found, some right and some wrong."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(n):
        alphabet = rng.integers(3, TINY.vocab_size, size=int(rng.integers(2, 40)))
        p = rng.choice(alphabet, size=int(rng.integers(3, 60))).tolist()
        if rng.random() < 0.5 and len(p) > 6:  # a span copied later on
            a = int(rng.integers(0, len(p) - 4))
            p += p[a:a + int(rng.integers(3, 12))]
        prompts.append(p)
    return prompts


def test_greedy_equal_over_200_random_prompts_batched_and_alone(runner):
    prompts = random_prompts(200)
    reqs = [GenerateRequest(prompt_ids=p, max_tokens=int(12 + i % 21), sampling=GREEDY,
                            ignore_eos=True) for i, p in enumerate(prompts)]
    plain, _ = trio.run(lambda: generate(runner, reqs, speculative="off", concurrent=True))
    spec, stats = trio.run(lambda: generate(runner, reqs, speculative="ngram",
                                            concurrent=True))
    assert stats["accepted_tokens"] > 100 and stats["drafts"] > 100, stats
    assert stats["draft_tokens"] > stats["accepted_tokens"]  # some were refused too
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert b[0] == a[0], f"prompt {i}: batched, speculative differs"
        assert b[2].completion_tokens == a[2].completion_tokens == reqs[i].max_tokens
    alone_reqs = reqs[::5]  # 40 of them one at a time
    alone, stats = trio.run(lambda: generate(runner, alone_reqs, speculative="ngram",
                                             concurrent=False))
    assert stats["accepted_tokens"] > 0
    for i, b in enumerate(alone):
        assert b[0] == plain[5 * i][0], f"prompt {5 * i}: alone, speculative differs"


def test_seeded_sampling_penalties_and_logprobs_are_unchanged(runner):
    prompts = random_prompts(24, seed=1)
    params = [SamplingParams(temperature=0.2 + 0.02 * i, top_p=0.9, seed=i, logprobs=True,
                             top_logprobs=2, presence_penalty=0.3 * (i % 2),
                             frequency_penalty=0.2 * (i % 3 == 0))
              for i in range(len(prompts))]
    reqs = [GenerateRequest(prompt_ids=p, max_tokens=20, sampling=sp, ignore_eos=True)
            for p, sp in zip(prompts, params)]
    plain, _ = trio.run(lambda: generate(runner, reqs, speculative="off", concurrent=True))
    spec, stats = trio.run(lambda: generate(runner, reqs, speculative="ngram",
                                            concurrent=True))
    assert stats["drafts"] > 0
    for a, b in zip(plain, spec):
        assert b[0] == a[0]
        assert [t.token_id for t in b[1]] == [t.token_id for t in a[1]]
        np.testing.assert_allclose([t.logprob for t in b[1]], [t.logprob for t in a[1]],
                                   atol=1e-4)
        assert [[x.token_id for x in t.top_logprobs] for t in b[1]] == \
            [[x.token_id for x in t.top_logprobs] for t in a[1]]


def test_stop_strings_and_max_tokens_end_where_plain_decoding_does(runner):
    prompts = random_prompts(16, seed=2)
    reqs = [GenerateRequest(prompt_ids=p, max_tokens=5 + i, sampling=GREEDY, ignore_eos=True,
                            stop=("q",) if i % 2 else ())
            for i, p in enumerate(prompts)]
    plain, _ = trio.run(lambda: generate(runner, reqs, speculative="off", concurrent=True))
    spec, _ = trio.run(lambda: generate(runner, reqs, speculative="ngram", concurrent=True))
    for a, b in zip(plain, spec):
        assert (b[0], b[2].finish_reason, b[2].completion_tokens) == \
            (a[0], a[2].finish_reason, a[2].completion_tokens)


class Allow:
    """A grammar stand-in: only tokens below `limit`, then it is finished after `n`."""

    def __init__(self, limit: int, n: int) -> None:
        self.limit, self.n, self.seen, self.error = limit, n, [], None
        self.checked: list[list[int]] = []  # proposals offered to `valid_prefix`

    def fill(self, row):
        words = np.zeros(len(row) * 32, bool)
        words[:self.limit] = True
        row[:] = np.packbits(words.reshape(-1, 32)[:, ::-1], axis=1).view(">u4") \
            .astype(np.uint32).view(np.int32)[:, 0]

    def accept(self, t):
        if t >= self.limit:
            self.error = f"token {t} not allowed"
            return False
        self.seen.append(t)
        return True

    @property
    def finished(self):
        return len(self.seen) >= self.n

    def valid_prefix(self, tokens):
        self.checked.append(list(tokens))
        for i, t in enumerate(tokens):
            if t >= self.limit:
                return i
        return len(tokens)

    def after(self, tokens):
        return self


def test_a_grammar_masks_every_verify_position(runner):
    """Prompts full of tokens the grammar forbids: every verify row samples under the
    mask (proposals are checked first: tests/scheduler/test_speculative.py), and the
    answers equal plain decoding's, all allowed."""
    limit = 120
    prompts = random_prompts(12, seed=4)
    outs = {}
    for mode in ("off", "ngram"):
        grammars = [Allow(limit, 24) for _ in prompts]
        # Every allowed pair of the prompt seen again, followed by a forbidden token.
        reqs = [GenerateRequest(prompt_ids=p + [x for a, b in zip(al, al[1:])
                                                for x in (a, b, 250)],
                                max_tokens=30, sampling=GREEDY, ignore_eos=True,
                                constraint=g)
                for p, g in zip(prompts, grammars)
                for al in [[t for t in p if t < limit] * 2]]
        outs[mode], stats = trio.run(lambda: generate(runner, reqs, speculative=mode,
                                                      concurrent=True))
        for toks, _, fin in outs[mode]:
            assert isinstance(fin, FinishEvent) and all(t < limit for t in toks)
        if mode == "ngram":
            assert stats["drafts"] > 0 and any(g.checked for g in grammars)
    assert [o[0] for o in outs["ngram"]] == [o[0] for o in outs["off"]]


def test_unseeded_verify_draws_follow_the_model(tmp_path):
    """A 24-token model (the top-20 logprobs need 20), a verify of [t, d] over and over (own pages each time): the
    first token's frequencies match softmax(logits at t), and, where it equals d, the
    second's match softmax(logits after d), by chi-square (p > 0.001; seeded rows, so the
    test itself is deterministic)."""
    cfg = ModelConfig(name="tiny-24", vocab_size=24, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                      max_position=256, tie_embeddings=True, eos_token_ids=(23,))
    params = random_params(cfg, seed=5)
    params["embed"] *= 3  # logits spread enough that some tokens are likely, some not
    r = ModelRunner(cfg, params, page_size=8, num_pages=40, max_context=64,
                    decode_buckets=(16,), prefill_buckets=(16,), block_q=8,
                    max_prefill_seqs=1, dtype="float32")
    r.warmup()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]  # page 1
    r.step(StepPlan([SeqChunk(0, prompt, 0, [1], sample=False)]))
    t = 7
    ref = r.step(StepPlan([SeqChunk(1, [t], 8, [1, 2], sample=True,
                                    sampling=GREEDY)]), return_logits=True).logits[1]
    p1 = np.exp(ref - ref.max())
    p1 /= p1.sum()
    d = int(np.argmax(np.where(np.arange(24) == t, 0, p1)))  # likely, not always accepted
    assert 0.1 < p1[d] < 0.9, p1
    ref2 = r.step(StepPlan([SeqChunk(1, [t, d], 8, [1, 2], sample=True, sampling=GREEDY)]),
                  return_logits=True).logits[1]
    p2 = np.exp(ref2 - ref2.max())
    p2 /= p2.sum()
    first, second = np.zeros(24), np.zeros(24)
    trials = 0
    for step in range(300):
        chunks = [SeqChunk(10 + j, [t, d], 8, [1, 2 + j], sample=True, draft=1,
                           sampling=SamplingParams(temperature=1.0, seed=step * 8 + j))
                  for j in range(8)]
        res = r.step(StepPlan(chunks))
        for c in chunks:
            a, b = res.drafted[c.seq_id]
            first[a.token_id] += 1
            if a.token_id == d:
                second[b.token_id] += 1
            trials += 1

    def chi2_ok(counts, p):
        n = counts.sum()
        keep = p * n >= 5  # classes expected at least 5 times; the rest pooled
        exp = np.append(p[keep] * n, p[~keep].sum() * n)
        obs = np.append(counts[keep], counts[~keep].sum())
        if exp[-1] == 0:
            exp, obs = exp[:-1], obs[:-1]
        stat = ((obs - exp) ** 2 / exp).sum()
        # 0.999 quantiles of chi-square by degrees of freedom (1..23)
        q = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26,
             32.91, 34.53, 36.12, 37.70, 39.25, 40.79, 42.31, 43.82, 45.31, 46.80, 48.27,
             49.73]
        return stat < q[len(exp) - 2], stat

    assert trials == 2400
    ok, stat = chi2_ok(first, p1)
    assert ok, (stat, first, p1 * trials)
    assert second.sum() > 200, second.sum()
    ok, stat = chi2_ok(second, p2)
    assert ok, (stat, second, p2 * second.sum())


FIDELITY = [
    "What is the capital of France?", "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.", "List three prime numbers and say why.",
    "How do I reverse a list in Python?", "Who wrote Pride and Prejudice?",
    "Give me a recipe for pancakes.", "Why is the sky blue?",
    "Copy this sentence exactly: the keeper opens the gates one at a time.",
    "Repeat after me: red, green, blue, red, green, blue.",
    "Rename x to y in: def f(x): return x * x + x",
    "Count from one to ten in words.", "What does HTTP stand for?",
    "Translate 'good morning' into French and Spanish.",
    "Summarise: the river rose, the gates held, the town stayed dry.",
    "Write a Python function that adds two numbers.", "What is 12 times 12?",
    "Name the days of the week.", "Say hello in three languages.",
]


@pytest.mark.slow
def test_the_fidelity_set_on_the_embedded_model(embedded_model):
    """The 19 fidelity prompts on SmolLM2 (f32 weights, batch-invariant): speculative
    answers equal plain ones, batched, and alone for 4 that repeat or count (where
    proposals are accepted most; one at a time is the suite's slowest part)."""
    enable_compilation_cache()
    m = embedded_model
    r = ModelRunner(m.config, m.params, page_size=16, kv_cache_bytes=256 << 20,
                    max_context=2048, decode_buckets=(1, 4, 8, 16, 32),
                    prefill_buckets=(64,), mixed_decode_buckets=(32,), block_q=16,
                    max_prefill_seqs=4, dtype="float32", quantization="none",
                    kv_cache_dtype="float32")
    r.warmup()
    tok = m.tokenizer
    reqs = [GenerateRequest(prompt_ids=tok.encode_chat([{"role": "user", "content": q}]),
                            max_tokens=32, sampling=GREEDY) for q in FIDELITY]
    # All 19 at once (their prompts in the first steps), 13 rows left for proposals.
    plain, _ = trio.run(lambda: generate(r, reqs, speculative="off", concurrent=True,
                                         detok=tok, max_running=19))
    spec, stats = trio.run(lambda: generate(r, reqs, speculative="ngram", concurrent=True,
                                            detok=tok, max_running=19))
    lone = [8, 9, 11, 17]  # copy, repeat, count, days
    alone, stats1 = trio.run(lambda: generate(r, [reqs[i] for i in lone], speculative="ngram",
                                              concurrent=False, detok=tok))
    # Batched, how many proposals are accepted depends on the order the prompts reached
    # the batch (the policy backs off after early rejections): that proposals were made
    # is certain, acceptance is asserted one at a time (and batched on the tiny model).
    assert stats["drafts"] > 0 and stats1["accepted_tokens"] > 0, (stats, stats1)
    for q, a, b in zip(FIDELITY, plain, spec):
        assert b[0] == a[0], f"{q!r}: batched, speculative differs"
    for i, c in zip(lone, alone):
        assert c[0] == plain[i][0], f"{FIDELITY[i]!r}: alone, speculative differs"


@pytest.mark.parametrize("draft_seed", [3, 7])
def test_a_draft_model_proposes_and_nothing_changes(runner, draft_seed):
    """A draft model (the target itself, seed 3: every guess right; another random
    model, seed 7: most wrong) guesses greedily in its own pool: answers equal plain
    decoding's, and every draft page goes back."""
    from model.draft import DraftProposer

    draft = ModelRunner(TINY, random_params(TINY, seed=draft_seed), page_size=8,
                        num_pages=300, max_context=512, decode_buckets=(1, 4, 8, 16),
                        prefill_buckets=(32, 64), block_q=8, max_prefill_seqs=2,
                        dtype="float32")
    draft.warmup()
    proposer = DraftProposer(draft)
    prompts = random_prompts(30, seed=6)
    reqs = [GenerateRequest(prompt_ids=p, max_tokens=16 + i % 9, sampling=GREEDY,
                            ignore_eos=True) for i, p in enumerate(prompts)]
    plain, _ = trio.run(lambda: generate(runner, reqs, speculative="off", concurrent=True))
    spec, stats = trio.run(lambda: generate(runner, reqs, speculative="draft",
                                            concurrent=True, proposer=proposer))
    assert [s[0] for s in spec] == [p[0] for p in plain]
    # (a draft that keeps missing is soon asked only now and then)
    assert stats["drafts"] > (20 if draft_seed == 3 else 0) and proposer.steps > 0
    if draft_seed == 3:  # the target as its own draft: greedy guesses all accepted
        assert stats["accepted_tokens"] == stats["draft_tokens"]
    else:
        assert stats["accepted_tokens"] < 0.5 * stats["draft_tokens"]
    assert len(proposer._free) == draft.num_pages - 1 and not proposer._seqs
