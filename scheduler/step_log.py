"""What the engine's steps did: the last few `StepRecord`s and the running totals that
`Engine.stats` reports.

`StepLog.record` is the one place a `StepRecord` is built, for a step that ran and for
one that failed alike, so the two cannot drift apart. Pure Python; the engine passes
the times.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .batch import Batch


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
    predicted_s: float = 0.0  # the step-cost model's estimate when it was planned
    compute_s: float = 0.0  # the runner's step less its own host work (packing)
    # The engine's host work this iteration: planning, packing, reading back, commit,
    # detokenizing, delivery (beside the next step's computation when overlapped).
    host_s: float = 0.0
    # The computation's idle gap before this step: host work it waited for, the engine's
    # and other tasks' on the event loop (overlapped: only what did not fit in a step).
    idle_s: float = 0.0
    # Which rule sized its prompt chunks (`policy.STEP_PLANS`) and the ITL budget it was
    # planned within (0: none).
    why: str = ""
    budget_s: float = 0.0


# Measured / predicted step time: how far the step-cost model's estimate (what admission
# and the ITL target plan with) is off. A histogram's upper bounds, 5% apart near 1.
PREDICTION_BUCKETS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.15, 1.2, 1.3,
                      1.5, 2.0, 3.0, float("inf"))
# Host seconds of an iteration that are not the step's computation (`StepRecord.host_s`).
HOST_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, float("inf"))


class Histogram:
    """Counts per bucket (not cumulative) and the sum, for a Prometheus histogram."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def add(self, value: float) -> None:
        self.sum += value
        self.counts[next(i for i, le in enumerate(self.bounds) if value <= le)] += 1

    def snapshot(self) -> tuple[list[int], float]:
        return list(self.counts), self.sum


class StepLog:
    def __init__(self, maxlen: int) -> None:
        self.records: deque[StepRecord] = deque(maxlen=maxlen)
        self.steps = 0  # steps run, failed ones included
        self.busy_s = 0.0  # wall time inside runner steps, failed ones included
        self.real_tokens = 0  # tokens computed that belonged to a request
        self.padded_tokens = 0  # tokens computed including bucket padding
        self.prompt_tokens = 0  # prompt tokens computed (prefix-cache hits are not)
        self.generation_tokens = 0  # tokens sampled (the engine counts them at commit)
        self.prediction = Histogram(PREDICTION_BUCKETS)  # measured / predicted
        self.host = Histogram(HOST_BUCKETS)  # host seconds per step
        self.compute_s = 0.0  # seconds of step computation (StepRecord.compute_s)
        self.idle_s = 0.0  # seconds the computation stood idle between steps (idle_s)

    def record(self, batch: Batch, started_at: float, ended_at: float, *,
               real_tokens: int = 0, padded_tokens: int = 0,
               error: str | None = None, predicted_s: float = 0.0,
               measured_s: float = 0.0, compute_s: float = 0.0,
               host_s: float = 0.0, idle_s: float = 0.0) -> StepRecord:
        """Log a step. A failed one (`error` set) computed nothing: it counts as a step
        and as busy time, but adds no tokens. `predicted_s` / `measured_s`: the step-cost
        model's estimate and the runner's time, when both are known; `compute_s` /
        `host_s`: the step's computation and the engine's host work around it;
        `idle_s`: how long the computation waited for host work before it."""
        if predicted_s > 0 and measured_s > 0 and error is None:
            self.prediction.add(measured_s / predicted_s)
        if error is None and (compute_s > 0 or host_s > 0):
            self.host.add(host_s)
            self.compute_s += compute_s
            self.idle_s += idle_s
        plan, nd = batch.plan, batch.num_decode
        rec = StepRecord(
            index=self.steps, started_at=started_at, ended_at=ended_at,
            decoded=tuple(c.seq_id for c in plan.chunks[:nd]),
            prefilled=tuple((c.seq_id, len(c.token_ids)) for c in plan.chunks[nd:]),
            real_tokens=real_tokens, padded_tokens=padded_tokens, copies=len(plan.copies),
            preempted=tuple(batch.preempted), error=error, predicted_s=predicted_s,
            compute_s=compute_s, host_s=host_s, idle_s=idle_s, why=batch.why,
            budget_s=batch.budget_s)
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
                    step_prediction=self.prediction.snapshot(),
                    step_host=self.host.snapshot(), compute_s=self.compute_s,
                    idle_s=self.idle_s)
