"""One object per request: everything the scheduler knows about it.

A `Sequence` is created by `Engine.submit` and from then on mutated only by the scheduler
side of the engine (policy, page allocator, output stream), always on the trio thread and
never while a runner step that includes it is in flight. The runner only reads what the
`StepPlan` hands it (slices of `token_ids`, the live `kv_pages` list), which is why those
lists are appended in place and never rebound: no per-token copies.

Token bookkeeping, the one thing to hold in mind:

- ``token_ids`` is prompt + generated tokens; ``output_ids`` is the generated part.
- ``num_computed_tokens`` counts positions whose K/V is in the pool (prefix-cache hits
  included). A sequence is decoding when exactly one token, the last sampled one, is not
  yet computed; before that it is prefilling (in chunks).
- With overlapped scheduling, a launched step's chunks count as computed at once
  (`Scheduler.launched`), and a chunk that samples leaves ``inflight = 1``: the next
  step is planned with that token's position (a `pending` chunk) before its value is
  known. ``token_ids`` only ever holds known tokens.
- Preemption by recompute sets ``num_computed_tokens`` back to 0 and releases the pages;
  ``token_ids`` stays, so on return the prompt *and* the tokens already streamed are
  prefilled again (mostly prefix-cache hits), and the next sampled token continues the
  stream where it stopped. Nothing is ever sent twice because output state (decoder,
  held-back text) lives on the sequence and survives preemption.
"""

from __future__ import annotations

import enum
from typing import Any

from .api import FinishEvent, GenerateRequest
from .protocol import SamplingParams, SeqChunk


class Phase(enum.Enum):
    QUEUED = "queued"  # in the waiting queue (new, or preempted and waiting to return)
    PREFILL = "prefill"  # admitted: holds pages, prompt chunks still to compute
    DECODE = "decode"  # one new token per step
    DONE = "done"  # finished, aborted, shed or failed; pages released


class Sequence:
    __slots__ = (
        "request_id", "seq_id", "phase",
        "prompt_ids", "token_ids", "output_ids", "max_tokens",
        "sampling", "tenant", "priority", "weight", "batch", "max_running", "cache_salt",
        "adapter", "adapter_slot", "constraint", "index", "prompt_logprobs", "prompt_scores",
        "export_pages_from",
        "kv_pages", "page_keys", "window_pages", "window_first", "num_computed_tokens", "num_cached_tokens", "uncached_tokens",
        "num_charged_tokens",
        "arrived_at", "arrival_order", "queued_at", "deadline_at", "admitted_at", "first_token_at",
        "predicted_ttft", "finished_at", "finish_reason", "num_preemptions", "aborted", "output", "inflight", "spec",
    )

    def __init__(
        self,
        req: GenerateRequest,
        *,
        request_id: str,
        seq_id: int,
        arrived_at: float,
        deadline_at: float,
        arrival_order: int = 0,
    ) -> None:
        self.request_id = request_id
        self.seq_id = seq_id
        self.phase = Phase.QUEUED
        self.prompt_ids: list[int] = list(req.prompt_ids)
        self.token_ids: list[int] = list(self.prompt_ids)  # prompt + generated, in place
        self.output_ids: list[int] = []
        self.max_tokens = req.max_tokens
        self.sampling: SamplingParams = req.sampling
        self.tenant = req.tenant
        self.priority = req.priority
        self.weight = req.weight if req.weight > 0 else 1.0
        self.batch = req.batch
        self.max_running = req.tenant_max_running
        # Pages computed under one adapter never serve another, nor the base model.
        self.cache_salt = (req.cache_salt if req.adapter is None
                           else f"{req.cache_salt}\x00lora:{req.adapter}")
        self.adapter = req.adapter  # LoRA adapter name, None: the base model
        self.adapter_slot = -1  # the slot holding it while the sequence runs
        self.constraint = req.constraint  # structured output's grammar state, or None
        self.index = req.index  # which of its request's choices
        self.prompt_logprobs = req.prompt_logprobs  # top alternatives per prompt token, or None
        self.export_pages_from = req.export_pages_from  # disaggregated prefill, or None
        self.prompt_scores: list[Any] = []  # [j]: prompt token j + 1's logprob (SampledToken)
        self.kv_pages: list[int] = []  # page table: page id per page_size positions
        self.page_keys: list[int] = []  # prefix-cache keys of full pages (may run ahead)
        # The sliding layers' own page table where they have one (scheduler/window_pages.py):
        # same positions as `kv_pages`, pages before `window_first` released (0).
        self.window_pages: list[int] = []
        self.window_first = 0
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache (first admit)
        # Prompt tokens expected to need computing, judged when it was queued (prefix cache
        # and the prompts queued or running before it): what its prefill will cost.
        self.uncached_tokens = len(self.prompt_ids)
        self.num_charged_tokens = 0  # fair-share high-water mark: recompute is not charged
        self.arrived_at = arrived_at
        self.arrival_order = arrival_order  # ties in arrived_at (coarse or fake clocks)
        self.queued_at = arrived_at  # entered the waiting queue (again, after preemption)
        self.deadline_at = deadline_at  # shed if still waiting, never started, after this
        self.admitted_at: float | None = None  # first admission (queue_s)
        self.first_token_at: float | None = None
        self.predicted_ttft: float | None = None  # the door's, when it was submitted
        self.finished_at: float | None = None
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.aborted = False
        self.output: Any = None  # the engine's OutputStream (decoder, stops, outbox)
        # Overlapped scheduling: 1 while a launched step has sampled this sequence's next
        # token and the host has not seen it yet (position `len(token_ids)`).
        self.inflight = 0
        # Speculative decoding's state (scheduler/speculative.py `SpecState`), or None.
        self.spec: Any = None

    # -- what the policy asks ------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def scoring_prompt(self) -> bool:
        """Prompt logprobs asked and not all computed yet (the prefix cache is not used
        meanwhile: a cached position would have no logits)."""
        return (self.prompt_logprobs is not None
                and len(self.prompt_scores) < len(self.prompt_ids) - 1)

    def record_scores(self, start: int, scores: list) -> None:
        """Keep a chunk's prompt logprobs (`StepResult.prompt_logprobs`); positions
        recomputed after a preemption are already known and skipped."""
        for pos, s in enumerate(scores, start):
            if s is not None and pos == len(self.prompt_scores):
                self.prompt_scores.append(s)

    @property
    def needs_host_token(self) -> bool:
        """Its next step needs its last token on the host (a grammar's allowed-token mask,
        penalties' token counts): never planned with a token in flight."""
        return self.constraint is not None or self.sampling.needs_penalties

    @property
    def is_running(self) -> bool:
        return self.phase is Phase.PREFILL or self.phase is Phase.DECODE

    @property
    def class_key(self) -> tuple[int, int]:
        """Admission class: interactive before batch, then priority (smaller first)."""
        return (1 if self.batch else 0, self.priority)

    @property
    def victim_key(self) -> tuple[int, int, float, int]:
        """Sorts most urgent first; preemption takes victims from the other end
        (lowest priority, latest arrived)."""
        return (1 if self.batch else 0, self.priority, self.arrived_at, self.arrival_order)

    def chunk(self, start: int, n: int) -> SeqChunk:
        """What the runner gets to compute positions ``[start, start + n)``; with a token
        in flight, ``chunk(len(token_ids), 1)`` is its pending decode."""
        end = start + n
        known = len(self.token_ids)
        pending = end > known  # the token the step in flight samples
        if pending and not (self.inflight and n == 1 and start == known):
            raise ValueError(f"chunk [{start}, {end}) of {self!r}: past the known "
                             f"tokens and not the one in flight")
        targets: list[int] = []
        if self.scoring_prompt:
            last, scored = len(self.prompt_ids) - 1, len(self.prompt_scores)
            targets = [self.prompt_ids[i + 1] if scored <= i < last else -1
                       for i in range(start, end)]
            if max(targets) < 0:
                targets = []
        return SeqChunk(
            seq_id=self.seq_id,
            token_ids=[-1] if pending else self.token_ids[start:end],
            start_pos=start,
            page_table=self.kv_pages,  # the live list: nothing mutates it during the step
            sample=end >= known,
            sampling=self.sampling,
            num_generated=len(self.output_ids) + pending,
            penalty_token_ids=self.output_ids,
            prompt_token_ids=self.prompt_ids,
            adapter_slot=self.adapter_slot,
            constraint=self.constraint if end == known else None,
            score_targets=targets,
            score_top=self.prompt_logprobs or 0,
            pending=pending,
            window_table=self.window_pages,
        )

    def finish_event(self) -> FinishEvent:
        """The last event of a sequence that ended normally (set `finished_at` and
        `finish_reason` first): its usage and timings."""
        arrived = self.arrived_at
        return FinishEvent(
            finish_reason=self.finish_reason,
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_generated,
            cached_tokens=self.num_cached_tokens,
            ttft_s=None if self.first_token_at is None else self.first_token_at - arrived,
            queue_s=None if self.admitted_at is None else self.admitted_at - arrived,
            e2e_s=self.finished_at - arrived,
            index=self.index,
            predicted_ttft_s=self.predicted_ttft,
        )

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, {self.phase.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, pages={len(self.kv_pages)})")
