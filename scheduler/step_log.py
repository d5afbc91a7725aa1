"""What the engine's steps did: the last few `StepRecord`s and the running totals that
`Engine.stats` reports.

`StepLog.record` is the one place a `StepRecord` is built, for a step that ran and for
one that failed alike, so the two cannot drift apart. Pure Python; the engine passes
the times.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .policy import Batch


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one step did, for tests and debugging (the engine keeps the last few)."""

    index: int
    started_at: float
    ended_at: float
    decoded: tuple[int, ...]  # seq_ids that decoded one token
    prefilled: tuple[tuple[int, int], ...]  # (seq_id, prompt tokens) per prefill chunk
    real_tokens: int
    padded_tokens: int
    copies: int = 0
    preempted: tuple[int, ...] = ()
    error: str | None = None


# Measured / predicted step time: how far the step-cost model's estimate (what admission
# and the prefill budget plan with) is off. A histogram's upper bounds.
PREDICTION_BUCKETS = (0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, float("inf"))


class StepLog:
    def __init__(self, maxlen: int) -> None:
        self.records: deque[StepRecord] = deque(maxlen=maxlen)
        self.steps = 0  # steps run, failed ones included
        self.busy_s = 0.0  # wall time inside runner steps, failed ones included
        self.real_tokens = 0  # tokens computed that belonged to a request
        self.padded_tokens = 0  # tokens computed including bucket padding
        self.prompt_tokens = 0  # prompt tokens computed (prefix-cache hits are not)
        self.generation_tokens = 0  # tokens sampled (the engine counts them at commit)
        self.prediction_counts = [0] * len(PREDICTION_BUCKETS)  # per bucket, not cumulative
        self.prediction_sum = 0.0

    def record(self, batch: Batch, started_at: float, ended_at: float, *,
               real_tokens: int = 0, padded_tokens: int = 0,
               error: str | None = None, predicted_s: float = 0.0,
               measured_s: float = 0.0) -> StepRecord:
        """Log a step. A failed one (`error` set) computed nothing: it counts as a step
        and as busy time, but adds no tokens. `predicted_s` / `measured_s`: the step-cost
        model's estimate and the runner's time, when both are known."""
        if predicted_s > 0 and measured_s > 0 and error is None:
            ratio = measured_s / predicted_s
            self.prediction_sum += ratio
            self.prediction_counts[next(i for i, le in enumerate(PREDICTION_BUCKETS)
                                        if ratio <= le)] += 1
        plan, nd = batch.plan, batch.num_decode
        rec = StepRecord(
            index=self.steps, started_at=started_at, ended_at=ended_at,
            decoded=tuple(c.seq_id for c in plan.chunks[:nd]),
            prefilled=tuple((c.seq_id, len(c.token_ids)) for c in plan.chunks[nd:]),
            real_tokens=real_tokens, padded_tokens=padded_tokens, copies=len(plan.copies),
            preempted=tuple(batch.preempted), error=error)
        self.records.append(rec)
        self.steps += 1
        self.busy_s += ended_at - started_at
        if error is None:
            self.real_tokens += real_tokens
            self.padded_tokens += padded_tokens
            self.prompt_tokens += sum(n for _, n in rec.prefilled)
        return rec

    def totals(self) -> dict[str, float]:
        """The `EngineStats` fields kept here."""
        return dict(steps=self.steps, busy_s=self.busy_s, real_tokens=self.real_tokens,
                    padded_tokens=self.padded_tokens, prompt_tokens=self.prompt_tokens,
                    generation_tokens=self.generation_tokens,
                    step_prediction=(list(self.prediction_counts), self.prediction_sum))
