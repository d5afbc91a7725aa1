"""What the engine and the door (`Admission`, scheduler/admission.py) read of a
scheduler: queue sizes, the running batch, the KV pool, the prefix cache, step-cost
estimates. They never reach into `waiting`, `pages` or `cost` themselves.

`Queries` is a mixin of `Scheduler` (scheduler/policy.py) and implements
`admission.SchedulerQueries` with the strict-ITL queries of `itl_plan.ItlPlanning`
(`running_capacity`, `prefill_seconds`, `prefill_backlog`).
"""

from __future__ import annotations

from .batch import Batch
from .request import Phase, Sequence


class Queries:
    """Read-only views of the scheduler's state."""

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def waiting_tokens(self) -> int:  # tokens queued: what `max_waiting_tokens` bounds
        return self.waiting.num_tokens

    @property
    def batch_running(self) -> int:  # batch jobs' sequences among the running
        return sum(1 for s in self.running.values() if s.batch)

    @property
    def batch_waiting(self) -> int:
        return self.waiting.num_waiting - self.waiting.num_interactive

    @property
    def batch_waiting_tokens(self) -> int:
        return self.waiting.num_batch_tokens

    @property
    def waiting_uncached_tokens(self) -> int:
        """Prompt tokens the interactive requests waiting will have to compute (the prefix
        cache and the prompts ahead of each counted when it was queued)."""
        return self.waiting.num_uncached

    def answers_left(self, answer_tokens: float) -> list[float]:
        """Tokens each running interactive sequence is expected still to generate,
        shortest first: what is left of an answer of `answer_tokens` (the door's
        expectation), within its max_tokens; at least one. When they end is when their
        running slots free up (the door's wait for a slot, `Admission.expected_wait`)."""
        return sorted(
            max(1.0, min(s.max_tokens - s.num_generated, answer_tokens - s.num_generated))
            for s in self.running.values() if not s.batch)

    def prefix_wait_tokens(self, seq: Sequence) -> int:
        """Prompt tokens a running prefill must still compute before `seq` can use the
        prefix they share (a burst that carries one system prompt: the first request
        computes it, the others wait for it, `PageAllocator.prefix_in_flight`)."""
        if not self.config.prefix_cache:
            return 0
        ps, pages, most = self.pages.page_size, self.pages, 0
        full = seq.num_prompt_tokens // ps
        for other in self.running.values():
            if other.phase is not Phase.PREFILL or other.cache_salt != seq.cache_salt:
                continue
            shared = 0
            for i in range(min(full, other.num_prompt_tokens // ps)):
                if pages.page_key(seq, i) != pages.page_key(other, i):
                    break
                shared = i + 1
            most = max(most, shared * ps - other.num_computed_tokens)
        return most

    def expected_uncached(self, seq: Sequence) -> int:
        """Prompt tokens `seq` would have to compute if queued now: those neither in the
        prefix cache nor in a prompt queued or running ahead of it (at least one: the
        last position is always computed, for its logits)."""
        return max(1, seq.num_prompt_tokens - self.pages.expected_hits(seq, self._promised))

    @property
    def prefill_token_s(self) -> float | None:  # measured; None before a prefill step
        return self.cost.prefill_token_s

    @property
    def prefix_hit_rate(self) -> float:
        """Share of admitted tokens the prefix cache has served so far (0 before any)."""
        pages = self.pages
        return pages.hit_tokens / pages.query_tokens if pages.query_tokens else 0.0

    def step_estimate(self, num_decode: int, prefill_tokens: int) -> float:
        """Expected seconds of such a step (0 for the parts not measured yet)."""
        return self.cost.predict(num_decode, self.cost.padded(prefill_tokens))

    def predict(self, batch: Batch) -> float:
        """The step-cost model's estimate of a planned step's seconds (0: not known)."""
        return batch.predicted(self.cost)

    def kv_capacity(self) -> tuple[int, int]:
        """(usable KV pages, page size): a longer sequence could never be admitted."""
        return self.pages.num_usable, self.pages.page_size

    def usage(self, now: float, *, audit: bool = False) -> dict[str, float]:
        """The `EngineStats` fields the scheduler owns: queue, running batch, KV pool;
        `audit`: also the page allocator's audit (O(pages): asked for, not every read)."""
        pages = self.pages
        oldest = self.waiting.oldest_queued_at()
        return dict(
            running=self.num_running, waiting=self.num_waiting,
            running_capacity=self.running_capacity,
            oldest_waiting_age_s=max(0.0, now - oldest) if oldest is not None else 0.0,
            kv_pages_total=pages.num_usable, kv_pages_in_use=pages.num_in_use,
            kv_pages_cached=pages.num_cached, kv_pages_free=pages.num_free,
            prefix_cache_queries_tokens=pages.query_tokens,
            prefix_cache_hits_tokens=pages.hit_tokens, preemptions=self.num_preemptions,
            step_plans=dict(self.plans),
            adapters=self.adapters.stats(),
            kv_tiers=pages.tiers.stats() if pages.tiers is not None else {},
            speculative=self.spec_stats(),
            kv_window=self.window.stats(self.running.values()) if self.window else {},
            kv_audit=self._audit() if audit else [])

    def _audit(self) -> list[str]:
        running = list(self.running.values())
        errors = self.pages.audit(s.kv_pages for s in running)
        if self.window is not None:
            errors += [f"sliding: {e}" for e in self.window.audit(running)]
        return errors
