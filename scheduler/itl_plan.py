"""Planning under an ITL target: the part of the policy (`policy.Scheduler`) that keeps every
step that carries a stream's next token within `itl_target_s`, and what admission reads of
it. A mixin of `Scheduler`, kept apart so the per-iteration policy reads in one place.

- `_fit_decodes`: when the decodes alone are predicted past the target (contexts grew), the
  least urgent decoding sequences are preempted until the rest fit;
- `_room`: how many prompt tokens of a sequence still fit beside what the step carries;
- `_decode_slot`: whether one more sequence may join the running set (a step of all of
  them at their expected contexts must keep room for the reserved prompt chunk);
- `reserved_chunk`: the room every step keeps for prompts, raised while first tokens come
  later than the TTFT target allows (`note_ttft`), within what the recent questions need;
- `running_capacity`, `prefill_seconds`, `prefill_backlog`: the door's view of the same.

Predictions are `step_cost.StepCostModel`'s; docs/operations.md, "The ITL target".
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .request import Phase, Sequence
from .step_cost import chunk_work

if TYPE_CHECKING:
    from .batch import Batch

# What an answer is expected to add to its context before any has finished here ("a few
# hundred tokens"); the finished ones' running average replaces it.
PRIOR_ANSWER_TOKENS = 256.0
# The share of the ITL target the door keeps in hand when it counts running slots.
_CAPACITY_MARGIN = 0.1
# Recent questions (`note_question`) before their sizes set the room a step keeps.
_MIN_QUESTIONS = 8
_TTFT_EVERY = 8  # first tokens between two moves of the reserved room (`note_ttft`)


def _p90(values) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


class ItlPlanning:
    """Mixed into `policy.Scheduler`, whose state it reads (`cost`, `running`, `config`,
    `limits`, `max_running`, `itl_target`, `answer_tokens`) and whose `_preempt` it calls."""

    @property
    def prefill_backlog(self) -> int:
        """The prompt tokens running sequences still have to prefill ahead of a newcomer's:
        under a strict ITL target all of them (they take the little room a step has beside
        the decodes before a newcomer does); otherwise the short prompts' (at most
        `short_prefill_tokens` uncached), whose chunks go into each step before a
        newcomer's, while a long prompt keeps to the pace and leaves a step's room to the
        newcomer (a 6,000-token prefill in progress does not delay a short question).
        Why the short ones count: a second wave of questions after a first burst (slots
        freed together) was admitted on predictions that ignored the questions admitted
        just before, and came at 2x them."""
        short = 0 if self.itl_target else self.config.short_prefill_tokens
        return sum(s.num_tokens - s.num_computed_tokens for s in self.running.values()
                   if s.phase is Phase.PREFILL and not s.batch
                   and (not short or s.num_tokens - s.num_cached_tokens <= short))

    @property
    def running_capacity(self) -> int:
        """Sequences that may run at once now, as admission promises them: `max_running`,
        or under an ITL target as many as leave a step within it, less a margin
        (`_CAPACITY_MARGIN`), with room for the reserved prompt chunk beside their decodes,
        at the contexts the running ones are expected to reach; at least 1. The margin:
        a step time that hovers at the target must not make the door promise a slot that
        the next step's plan (`_decode_slot`, at the target itself) then withholds."""
        if not self.itl_target:
            return self.max_running
        running = list(self.running.values())
        ctx = (sum(map(self.expected_context, running)) / len(running) if running
               else self.answer_tokens)
        chunk = self.reserved_chunk()
        limit = self.itl_target * (1.0 - _CAPACITY_MARGIN)
        # Upwards, stopping at the first that does not fit: the running set grows one at
        # a time (`_decode_slot`), so a bigger shape that looks cheap (a warm-up figure not
        # yet corrected) is no capacity while a smaller one in between is over.
        k = 1
        while k < self.max_running and self.cost.predict(
                k + 1, chunk, (k + 1) * ctx + chunk_work(int(ctx), chunk)) <= limit:
            k += 1
        return k

    def question_seconds(self, tokens: float) -> float:
        """`prefill_seconds` of a short prompt: at the cost measured on questions' steps
        (`StepCostModel.question_seconds`), or under a strict ITL target at the pace."""
        if self.itl_target:
            return self.prefill_seconds(tokens)
        return self.cost.question_seconds(tokens)

    def prefill_seconds(self, tokens: float) -> float:
        """Seconds a prompt of `tokens` uncached tokens takes to prefill: at the measured
        cost of a token, or under an ITL target at the pace of the chunks that fit beside
        the decodes of a full running set, one step each."""
        cost = self.cost
        alone = tokens * (cost.prefill_token_s or 0.0)
        if not self.itl_target or tokens <= 0:
            return alone
        nd = max(0, self.running_capacity - 1)
        chunk = cost.largest_prefill(nd, self.limits.max_prefill_tokens) or cost.block_q
        steps = math.ceil(tokens / chunk)
        return max(alone, steps * cost.predict(nd, cost.padded(min(chunk, math.ceil(tokens)))))

    def _fit_decodes(self, order: list[Sequence], batch: Batch) -> list[Sequence]:
        """When the decodes alone are predicted past the ITL target (their contexts
        grew), the least urgent decoding sequences are preempted (recomputed later, their
        full pages kept in the prefix cache) until the rest fit; one always stays. Returns
        `order` without them."""
        decoding = [s for s in order if s.phase is Phase.DECODE]
        work = sum(len(s.token_ids) for s in decoding)  # a decode row reads its context
        cut = False
        while len(decoding) > 1 and not self.cost.fits(len(decoding), 0, work):
            victim = decoding.pop()
            work -= len(victim.token_ids)
            self._preempt(victim, batch)
            cut = True
        return [s for s in order if s.is_running] if cut else order

    def note_question(self, seq: Sequence) -> None:
        """An interactive prompt joined the queue: its uncached tokens count toward the
        room `reserved_chunk` keeps, unless it is too long to meet the TTFT target even at
        the full prefill speed (a document, judged on its wait: no room would do)."""
        ttft, per_token = self.config.ttft_target_s, self.cost.prefill_token_s
        if seq.batch or (ttft > 0 and per_token and seq.uncached_tokens * per_token > ttft):
            return
        self.question_sizes.append(seq.uncached_tokens)

    def reserved_chunk(self) -> int:
        """The prompt tokens every step keeps room for beside the decodes of a full running
        set: `min_prefill_tokens`, raised block by block while the first tokens come later
        than the TTFT target allows (`note_ttft`), up to what the 90th percentile of recent
        questions needs to be prefilled within the target (less a margin and the step in
        flight), one chunk a step at the ITL target's pace. More room means fewer streams:
        a running set sized for a 16-token chunk left a 100-token question 7 steps, and
        its TTFT missed 1 s at a 0.15 s target; sized for 32 tokens on this CPU it held 4
        streams (docs/history/benchmarks-log.md, "Issue 16: a door that calibrates itself")."""
        least = self.cost.padded(self.config.min_prefill_tokens)
        return least + self.reserve_extra * self.cost.block_q

    def _most_extra(self) -> int:
        """The most query blocks `reserved_chunk` may add to `min_prefill_tokens`: up to
        the 90th percentile question's share of a step at the TTFT target's pace (none
        until 8 questions have come)."""
        ttft, sizes = self.config.ttft_target_s, self.question_sizes
        if ttft <= 0 or len(sizes) < _MIN_QUESTIONS:
            return 0
        steps = max(1, int(ttft * (1.0 - _CAPACITY_MARGIN) / self.itl_target) - 1)
        share = self.cost.padded(math.ceil(_p90(sizes) / steps))
        least = self.cost.padded(self.config.min_prefill_tokens)
        return max(0, (share - least) // self.cost.block_q)

    def note_ttft(self, seconds: float) -> None:
        """An interactive request's first token came `seconds` after it arrived. Every 8,
        the 90th percentile of the last 16 moves the room kept for prompts: a block more
        while it is past the TTFT target (less the margin), a block less while it is
        under 60% of it. The running set follows (`running_capacity`)."""
        ttft = self.config.ttft_target_s
        if ttft <= 0:
            return
        recent = self.recent_ttfts
        recent.append(seconds)
        self._ttft_notes += 1
        if self._ttft_notes % _TTFT_EVERY or len(recent) < _TTFT_EVERY:
            return
        p90 = _p90(recent)
        if p90 > ttft * (1.0 - _CAPACITY_MARGIN):
            self.reserve_extra = min(self._most_extra(), self.reserve_extra + 1)
        elif p90 < 0.6 * ttft:
            self.reserve_extra = max(0, self.reserve_extra - 1)

    def _room(self, batch: Batch, seq: Sequence, most: int) -> int:
        """The most prompt tokens of `seq` (up to `most`) that this step can take and
        still be predicted within the ITL target: a question may be spread over several
        steps. A chunk that does not end the prompt ends on a query block. The step's
        first chunk takes at least one block, so a prompt always moves."""
        cost = self.cost
        start = seq.num_computed_tokens
        nd, pf, work = batch.decode_rows, batch.prefill_padded, batch.work

        def fits(n: int) -> bool:
            return cost.fits(nd, pf + cost.padded(n), work + chunk_work(start, n))

        if most <= 0:
            return 0
        if not fits(1):
            # Nothing fits. The step's first prompt chunk still takes one block: a running
            # prompt, admitted when the prediction left room for it, must not be stranded
            # because a step turned out slower than predicted (the target is a plan; this
            # exceeds it only after a misprediction), nor may a step carry nothing.
            return min(most, cost.block_q) if batch.prefill_padded == 0 else 0
        lo, hi = 1, most
        while lo < hi:  # the largest n that fits (the prediction grows with n)
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        bq = cost.block_q
        if lo < seq.num_tokens - start and lo >= bq:
            lo -= lo % bq
        return lo

    def expected_context(self, seq: Sequence) -> float:
        """Tokens `seq`'s context is expected to reach: its prompt and an answer of the
        average length so far (within its max_tokens, at least what it has)."""
        answer = min(seq.max_tokens, max(seq.num_generated, self.answer_tokens))
        return seq.num_prompt_tokens + answer

    def _decode_slot(self, seq: Sequence) -> bool:
        """Under an ITL target, whether `seq` may join the running set: the decode step
        of every running sequence and it, at the contexts they are expected to reach,
        must still leave room for the reserved prompt chunk within the target (else the
        next newcomer could never be prefilled). With nothing running, always."""
        if not self.itl_target or not self.running:
            return True
        work = sum(map(self.expected_context, self.running.values()))
        work += self.expected_context(seq)
        chunk = self.reserved_chunk()
        return self.cost.fits(len(self.running) + 1, chunk,
                              work + chunk_work(seq.num_prompt_tokens, chunk))
