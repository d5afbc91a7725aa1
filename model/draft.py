"""A draft model's proposals for speculative decoding (scheduler/speculative.py).

A smaller model of the same tokenizer guesses each sequence's next k tokens greedily; the
target verifies them in one step. The guesses are a point proposal (the draft's argmax),
so the scheduler's verification (a guess kept while it equals the target's draw) keeps
the target's output exactly as it is without them.

`DraftProposer` holds the draft's own `ModelRunner` (its own KV pool, the pool's compiled
shapes) and its own page books: a free list, each sequence's pages, and how far the
draft has computed it. Before the scheduler plans a step, the engine hands it the
sequences worth guessing for (`Speculation.spec_wanted`) and it runs, in the engine's
worker thread:

1. catch-up: each sequence's tokens the draft has not computed (its prompt once, then
   the tokens accepted since), in prompt chunks within the draft runner's limits, the
   last chunk sampling the first guess;
2. k - 1 decode steps of all of them at once, each guessing the next token.

`propose` then hands the planner the guesses made for the sequence's current length.
After a verify, the draft's keys and values past the guesses the target accepted are
cut back (the next catch-up rewrites those positions). A sequence's pages go back when
it finishes or is preempted (`forget`). Where the draft's pool has no room, a sequence
simply gets no guess.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler.protocol import SamplingParams, SeqChunk, StepPlan

GREEDY = SamplingParams(temperature=0.0)


@dataclass(slots=True)
class _Draft:
    pages: list[int] = field(default_factory=list)
    computed: int = 0  # positions whose keys and values are in the draft's pool
    base: int = 0  # the sequence's length when the guesses below were made
    guesses: list[int] = field(default_factory=list)  # positions base.. (the first unwritten)


class DraftProposer:
    """Guesses from a draft model (implements scheduler.speculative.Proposer)."""

    name = "draft"

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.page_size = runner.page_size
        self._free = list(range(1, runner.num_pages))  # page 0 is the null page
        self._seqs: dict[int, _Draft] = {}  # seq_id -> its draft state
        self.steps = 0  # draft steps run (a guess of k costs its catch-up and k - 1)

    # -- the scheduler's side (engine thread) -------------------------------------------
    def propose(self, seq, k: int) -> list[int]:
        d = self._seqs.get(seq.seq_id)
        if d is None or d.base != len(seq.token_ids):
            return []
        return d.guesses[:k]

    def forget(self, seq) -> None:
        """The sequence finished or was preempted: its draft pages go back."""
        d = self._seqs.pop(seq.seq_id, None)
        if d is not None:
            self._free.extend(d.pages)

    # -- the device's side (the engine's worker thread) ----------------------------------
    def prepare(self, wanted: list[tuple[Any, int]]) -> None:
        """Guess up to k tokens for each (sequence, k); the engine's thread waits."""
        limits = self.runner.limits
        wanted = wanted[:limits.max_decode_seqs]
        live: list[tuple[Any, _Draft, int]] = []
        for seq, k in wanted:
            d = self._seqs.setdefault(seq.seq_id, _Draft())
            toks = seq.token_ids
            # Keep what agrees with the sequence: its own tokens, and the guesses it took.
            agreed = d.base
            while (agreed - d.base < len(d.guesses) and agreed < len(toks)
                   and toks[agreed] == d.guesses[agreed - d.base]):
                agreed += 1
            d.computed = min(d.computed, agreed, len(toks) - 1)
            d.guesses, d.base = [], len(toks)
            need = -(-(len(toks) + k - 1) // self.page_size) - len(d.pages)
            if need > len(self._free):
                continue  # no room in the draft's pool: no guess this time
            if need > 0:
                d.pages.extend(self._free[:need])
                del self._free[:need]
            live.append((seq, d, k))
        if not live:
            return
        self._catch_up(live, limits)
        for j in range(1, max(k for _, _, k in live)):
            chunks = [SeqChunk(seq.seq_id, [d.guesses[-1]], d.base + j - 1, d.pages,
                               sample=True, sampling=GREEDY)
                      for seq, d, k in live if j < k and len(d.guesses) == j]
            if not chunks:
                break
            self._step(chunks, live)

    def _catch_up(self, live, limits) -> None:
        """Prompt chunks of every uncomputed token, the last of each sequence sampling its
        first guess; within the runner's chunk and step limits."""
        while True:
            chunks, budget = [], limits.max_prefill_tokens
            for seq, d, _ in live:
                rest = d.base - d.computed
                if d.guesses or rest <= 0 or len(chunks) >= limits.max_prefill_seqs:
                    continue
                n = min(rest, limits.max_prefill_chunk, budget)
                if n <= 0:
                    break
                budget -= n
                chunks.append(SeqChunk(seq.seq_id, seq.token_ids[d.computed:d.computed + n],
                                       d.computed, d.pages, sample=n == rest,
                                       sampling=GREEDY))
            if not chunks:
                return
            self._step(chunks, live)

    def _step(self, chunks: list[SeqChunk], live) -> None:
        result = self.runner.step(StepPlan(chunks))
        self.steps += 1
        by_id = {seq.seq_id: d for seq, d, _ in live}
        for c in chunks:
            d = by_id[c.seq_id]
            d.computed = max(d.computed, c.start_pos + len(c.token_ids))
            if c.sample:
                tok = result.sampled.get(c.seq_id)
                if tok is not None:  # (a row the draft could not sample: no guess)
                    d.guesses.append(tok.token_id)
