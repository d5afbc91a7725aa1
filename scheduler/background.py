"""Batch jobs' share of a step: idle capacity only, never an interactive stream's time.

Sequences of batch jobs (`GenerateRequest.batch`) form the least urgent admission class
(`Sequence.class_key`) and are the first victims of preemption (`victim_key`). On top,
`Scheduler.schedule` asks this model, each iteration:

- `decode_rows(n)`: beside `n` interactive decodes, how many batch decodes the step may
  carry: as many as keep the measured step time within `(1 + batch_slowdown)` of the
  interactive decodes' own (a step padded up to a bucket has free rows: those are the
  room). Without interactive decodes, no limit.
- `prefill_tokens(n, total)`: beside them, how many batch prefill tokens fit in what is
  left of that allowance; the scheduler grants them only in a step that prefills an
  interactive prompt anyway (a prefill chunk moves a step to a bigger compiled shape).
  With no interactive sequence running, no limit.
- `kv_ok(...)`: a batch sequence is admitted only if `batch_kv_reserve` of the pages stay
  free for interactive arrivals.

Before planning, `Scheduler._make_room` preempts running batch sequences (least urgent
first) when an interactive request waits for a running slot or for pages. Pure Python;
the step times come from the scheduler's `StepCostModel`.
"""

from __future__ import annotations

from config.settings import SchedulerConfig

from .step_cost import StepCostModel


class BackgroundShare:
    def __init__(self, config: SchedulerConfig, cost: StepCostModel) -> None:
        self.slowdown = config.batch_slowdown
        self.kv_reserve = config.batch_kv_reserve
        self.cost = cost

    def _allowed(self, n_interactive: int) -> float | None:
        base = self.cost.decode_time(n_interactive)
        return None if base is None else base * (1.0 + self.slowdown)

    def decode_rows(self, n_interactive: int, n_batch: int, interactive: bool) -> int:
        """Batch decodes (of `n_batch` ready) that may join `n_interactive` decodes;
        `interactive`: some interactive sequence runs (prefilling, if none decodes)."""
        if not interactive:
            return n_batch
        if n_interactive == 0:
            return 0  # an interactive prompt is being prefilled: its TTFT first
        allowed = self._allowed(n_interactive)
        if allowed is None:
            return 0  # nothing measured yet: interactive first
        k = 0
        while k < n_batch:
            t = self.cost.decode_time(n_interactive + k + 1)
            if t is None or t > allowed:
                break
            k += 1
        return k

    def prefill_tokens(self, n_interactive: int, n_decode: int) -> int | None:
        """Batch prefill tokens a step with these decodes may carry, when some interactive
        sequence runs (the caller passes None otherwise: no limit)."""
        if n_interactive == 0:
            return 0
        allowed = self._allowed(n_interactive)
        per_token = self.cost.prefill_token_s
        if allowed is None or not per_token:
            return 0
        left = allowed - (self.cost.decode_time(n_decode) or 0.0)
        return max(0, int(left / per_token))

    def kv_ok(self, need: int, available: int, usable: int) -> bool:
        """May a batch sequence needing `need` pages take them?"""
        return available - need >= self.kv_reserve * usable
