"""How big a step's prompt chunks are beside the streams' decodes, and why: the part of the
policy (`policy.Scheduler`) that trades the two SLOs, a mixin of `Scheduler` kept apart so
the per-iteration policy reads in one place (as `itl_plan.py` is for a strict target).

- `_short_chunk`: a short question spread over the steps its TTFT target leaves room for,
  or whole while such questions come rarely;
- `_deadline_chunk`: a longer prompt that the ITL budget's chunks would bring past its TTFT
  target takes bigger ones, while it can still make it;
- `_why`: which rule built a step (`STEP_PLANS`), for /v1/stats and the dashboard.

The ITL budget itself is `step_cost.StepCostModel.itl_budget`; docs/operations.md, "The
ITL target: both SLOs at once".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .request import Sequence

if TYPE_CHECKING:
    from .batch import Batch

# The share of the TTFT target a short prompt's chunks are planned to fit in
# (`Scheduler._short_chunk`); the rest absorbs mispredicted step times.
_TTFT_PLAN_SHARE = 0.6
# Seconds of short-prompt arrivals `_short_chunk` counts to judge how often they come.
_ARRIVAL_WINDOW_S = 10.0

# Why a step carries the prompt tokens it does (`Batch.why`), one rule each:
STEP_PLANS = (
    "decode-only",    # no prompt chunk: nothing waited, or no room
    "prefill-only",   # no stream decoding: no token gap at stake, chunks as big as allowed
    "itl-target",     # chunks fill the ITL target that the decodes alone leave room under
    "itl-derived",    # the decodes alone fill the target: chunks get the share the learned
                      # step costs derive (decode step * prefill_slowdown)
    "ttft",           # a chunk grew past the budget: its prompt would miss the TTFT target
    "rare-question",  # a short prompt whole: such prompts come too rarely to matter to ITL
    "itl-strict",     # every step held to the target, the running set too (`itl_strict`)
    "unpaced",        # no budget: ITL planning off, or no step measured yet
)


class ChunkSizing:
    """Mixed into `policy.Scheduler`, whose state it reads (`cost`, `config`, `clock`,
    `itl_target`, `_short_arrivals`, `_gap_s`)."""

    def _why(self, batch: "Batch", itl_budget: tuple[float, str, float] | None,
             reasons: set[str]) -> str:
        """The rule that sized the step's prompt chunks (`STEP_PLANS`)."""
        if len(batch.seqs) == batch.num_decode:
            return "decode-only"
        if batch.num_decode == 0:
            return "prefill-only"
        if self.itl_target:
            return "itl-strict"
        if itl_budget is None:
            return "unpaced"
        for why in ("ttft", "rare-question"):
            if why in reasons:
                return why
        return itl_budget[1]

    def _short_chunk(self, seq: Sequence, rest: int, num_decode: int, pace: int,
                     new: bool = False, beside: int = 0) -> tuple[int, str]:
        """The next chunk of a short prompt (`rest` tokens left, `new`: just admitted)
        joining `num_decode` running streams: the prompt is spread over as many steps as
        its TTFT target leaves room for, each chunk at least `pace` (a long prompt's chunk
        beside these decodes), so that it lengthens the streams' token gaps as little as
        its own first token allows. Why: a 72-token question after a cached 2,000-token
        system prompt, prefilled whole beside 16 streams on the 2-core CPU, made their gap
        ~0.3 s against ~0.07 (docs/history/benchmarks-log.md, "Short prompts spread over the TTFT
        target").

        Whole when the target is off or the costs are not measured yet; whole again once
        the request has waited too long to spread it (each step re-plans the rest from
        the time then left); and whole while such prompts arrive rarely enough that one
        long gap each stays within `short_prefill_stall_share` of the streams' gaps (their
        rate times the gap the streams have lately seen, a long row's walk in it): a
        p95 of the gaps then never sees those stalls, and spreading would only put ~5
        gaps at the pace's length where one was (4 streams, a question every 0.5 s:
        ITL p95 25 ms whole against 49 spread; docs/history/benchmarks-log.md, "Whole while
        questions are rare").

        A step is planned at the decodes' time plus the prompt tokens already in it
        (`beside`: the chunks of the prompts ahead, spread the same way): a second wave of
        questions after a first burst, each planned as if alone in its steps, came at
        1.7x its plan.

        Returns the chunk and why it is past the pace (`STEP_PLANS`; "": it is not)."""
        cost, target = self.cost, self.config.ttft_target_s
        decode, per_token = cost.decode_time(num_decode), cost.prefill_token_s
        if target <= 0 or not decode or not per_token or rest <= pace:
            return rest, ""
        now, arrivals = self.clock(), self._short_arrivals
        if new:  # judged once, as it joins; a spread prompt stays spread
            arrivals.append(now)
            while arrivals and arrivals[0] < now - _ARRIVAL_WINDOW_S:
                arrivals.popleft()
            gap = max(decode, self._gap_s or 0.0)
            if len(arrivals) / _ARRIVAL_WINDOW_S * gap <= self.config.short_prefill_stall_share:
                return rest, "rare-question"
        # Planned to finish by a share of the target: the step in flight comes first, and
        # predicted step times err on a busy host.
        step = decode + beside * per_token
        ahead = now - seq.arrived_at + step + rest * per_token
        steps = min(int((target * _TTFT_PLAN_SHARE - ahead) / step), rest // max(1, pace))
        if steps <= 1:
            return rest, "ttft"
        if seq.predicted_ttft is not None:  # the door's calibration compares to the plan
            seq.predicted_ttft = max(seq.predicted_ttft, ahead + steps * step)
        chunk = -(-rest // steps)
        return chunk, "ttft" if chunk > pace else ""

    def _deadline_chunk(self, seq: Sequence, rest: int, decode: float,
                        pace: int) -> int | None:
        """The next chunk of a prompt longer than `short_prefill_tokens` (`rest` tokens
        left) when the pace would bring its first token after the TTFT target (less the
        plan's margin, `_TTFT_PLAN_SHARE`) and bigger chunks still would not: spread over
        as many steps as the time left allows, each carrying the decodes. None: the pace
        will do, or no pace would (a document too long for the target at any chunk size
        keeps the budget's chunks: growing them would stretch the streams' gaps for a
        first token that is late anyway). Each step re-plans from the time then left.
        `decode`: the decodes' own predicted seconds a step."""
        target, per_token = self.config.ttft_target_s, self.cost.prefill_token_s
        if target <= 0 or not decode or not per_token or rest <= pace:
            return None
        waited = self.clock() - seq.arrived_at
        left = target * _TTFT_PLAN_SHARE - waited  # planned, with the margin
        if -(-rest // pace) * (decode + pace * per_token) <= left:
            return None  # on time at the pace
        if rest * per_token + decode > target - waited:
            return None  # cannot make the target itself, even in one step
        steps = max(1, int((left - rest * per_token) / decode + 1e-9))
        return max(pace, -(-rest // steps))
