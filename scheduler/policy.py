"""The per-iteration policy: which sequences run in the next step, and how many tokens each.

`Scheduler.schedule()` rebuilds the batch from scratch every iteration, in this order:

1. Decodes. Every running sequence that is decoding gets its one token, most urgent first.
   If one needs a new page (or a private copy of a shared one) and none is available, the
   least urgent running sequence (lowest priority, latest arrival) is preempted by
   recompute: its pages are released (full ones stay in the prefix cache) and it goes back
   to the front of its tenant's line. If it is the only candidate, the needy sequence
   preempts itself. The running cap guarantees all decodes fit in one step, so a long
   prefill can never starve them.
2. Chunks of prompts already being prefilled, within what is left of the step's token
   budget: ``min(max_step_tokens - decodes, limits.max_prefill_tokens)``, at most
   `limits.max_prefill_chunk` tokens a chunk and `limits.max_prefill_seqs` chunks a step,
   and beside decodes within the ITL budget (`StepCostModel.itl_budget`: what
   `itl_target_s` leaves of the step, or where the decodes alone fill it, the learned
   costs' share): the trade between the two SLOs. A prompt the budget's chunks would
   bring past its TTFT target takes bigger ones while it can still make it
   (`_deadline_chunk`). A 6,000-token prompt is thus spread over many steps, each also
   carrying every decode. Each step records which rule built it (`Batch.why`).
   A short prompt (at most `short_prefill_tokens` uncached) goes in whole, or beside decodes
   in as many such chunks as its TTFT target leaves room for, once such prompts come
   often enough that whole ones would stall too many of the streams' gaps (`_short_chunk`).
3. Admission (continuous mode): the next waiting sequence by class, fair share and tenant
   limit (`FairQueue.peek`) is admitted if its pages fit: prompt pages not covered by
   prefix hits, plus `kv_reserve_pages` kept back for the running decodes to grow into.
   An admitted sequence gets its first chunk in the same step, so a request joins a running
   batch within one iteration. A head that does not fit blocks the ones behind it (small
   requests must not starve a big urgent one forever). A sequence whose next uncached page
   is being computed right now by a running prefill waits for it instead (then it hits
   the prefix cache), and the sequences behind it go ahead. With KV tiers
   (scheduler/kv_tiers.py), hits continue below the device: pages in the host tier are
   copied up into fresh pages (`_lower_hits`, `PageAllocator.take_up`), and a prompt
   whose next pages are on disk waits while they are read, the others going ahead. A sequence with a LoRA
   adapter also needs an adapter slot (`adapters.py`); without one it waits, base-model
   sequences go ahead, and no other adapter sequence takes a slot past it. Batch jobs'
   sequences (the last class) take only what `background.py` grants beside interactive
   work, and give up their slots and pages when an interactive request waits for them.

Static mode gathers up to `static_batch_size` sequences when nothing runs, and admits no
one else until they have all finished: the baseline continuous batching is compared to.

With a strict ITL target (`itl_strict`), every step that carries a decode is planned within it
(`_fit_decodes`, `_room`, `_decode_slot`), and the queries admission reads
(`running_capacity`, `prefill_seconds`, `prefill_backlog`) say what the target allows:
`itl_plan.py`, a mixin of `Scheduler`.

Only host state changes here; the runner sees the result as a `StepPlan`. The policy's
arithmetic and books live beside it, one job a file: the batch share (background.py),
adapter residency (adapters.py), step costs (step_cost.py), prompt chunk sizes
(chunk_sizing.py), strict ITL planning (itl_plan.py), what the engine and the door read
(queries.py) and a step's books once planned (step_books.py: launched, commit, finish).
(About 480 lines: the per-iteration policy, decodes, prefill chunks, admission and
preemption, is read in one place.)
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from config.settings import SchedulerConfig

from .adapters import AdapterSlots
from .batch import Batch
from .background import BackgroundShare
from .chunk_sizing import STEP_PLANS, ChunkSizing
from .fairness import FairQueue
from .itl_plan import PRIOR_ANSWER_TOKENS, ItlPlanning
from .pages import PageAllocator
from .window_pages import WindowPages
from .queries import Queries
from .protocol import StepLimits, StepPlan
from .request import Phase, Sequence
from .step_cost import StepCostModel, chunk_work
from .speculative import Speculation
from .step_books import StepBooks

__all__ = ["Batch", "STEP_PLANS", "Scheduler"]


class Scheduler(ChunkSizing, ItlPlanning, Queries, Speculation, StepBooks):
    def __init__(
        self,
        config: SchedulerConfig,
        *,
        num_pages: int,
        page_size: int,
        limits: StepLimits,
        clock: Callable[[], float] = time.monotonic,
        adapter_slots: int = 0,
        max_context: int = 0,
    ) -> None:
        self.config = config
        self.limits = limits
        self.max_context = max_context  # positions the model has (0: not said)
        self.clock = clock
        self.pages = PageAllocator(num_pages, page_size, prefix_cache=config.prefix_cache)
        # The sliding layers' own pages, where the runner gives them some (window_pages.py).
        self.window = WindowPages(
            limits.window_pool, page_size, limits.window,
            limits.window_pages_per_seq(page_size),
            prefix_cache=config.prefix_cache) if limits.window_pool else None
        self.adapters = AdapterSlots(adapter_slots)
        self.waiting = FairQueue()
        self.running: dict[int, Sequence] = {}  # seq_id -> sequence, admission order
        self.num_preemptions = 0
        self.static = config.mode == "static"
        cap = min(config.max_running, limits.max_decode_seqs, config.max_step_tokens)
        if self.static:
            cap = min(cap, config.static_batch_size)
        if self.window is not None:  # each holding its window's pages at most
            cap = min(cap, self.window.max_seqs)
        # Every running sequence must be able to decode in the same step: no starvation.
        self.max_running = max(1, cap)
        # Prefill beside decodes is capped by measured step cost (the engine feeds it).
        self.cost = StepCostModel(itl_target_s=0.0 if self.static else config.strict_itl_s,
                                  itl_budget_s=0.0 if self.static else config.itl_target_s,
                                  prefill_slowdown=config.prefill_slowdown,
                                  min_prefill_tokens=config.min_prefill_tokens,
                                  shapes=limits.shapes, block_q=limits.block_q)
        # With a strict ITL target every step is planned to fit it (`_fit_decodes`,
        # `_room`, `_decode_slot`): the running set follows from the target and the
        # contexts. 0: the target (if any) sizes prompt chunks only (`itl_budget`).
        self.itl_target = self.cost.itl_target_s
        self.plans: dict[str, int] = dict.fromkeys(STEP_PLANS, 0)  # steps by `Batch.why`
        self.answer_tokens = PRIOR_ANSWER_TOKENS  # running average of finished answers
        self.question_sizes: deque[int] = deque(maxlen=64)  # `ItlPlanning.note_question`
        self.recent_ttfts: deque[float] = deque(maxlen=16)  # `ItlPlanning.note_ttft`
        self._ttft_notes = 0
        self.reserve_extra = 0  # query blocks `ItlPlanning.reserved_chunk` adds
        # Prompt page keys of the live sequences, counted: a request queued behind another
        # with the same system prompt will find it cached (`expected_uncached`).
        self._promised: dict[int, int] = {}
        # When short prompts that a whole prefill would make a long step of arrived beside
        # running decodes (`_short_chunk`): their rate, over `_ARRIVAL_WINDOW_S`.
        self._short_arrivals: deque[float] = deque()
        self._gap_s: float | None = None  # recent steps that carried decodes: mean seconds
        self.background = BackgroundShare(config, self.cost)  # batch jobs' share
        self._init_speculation(config)  # proposals verified in decode rows (speculative.py)

    # -- the queue's side ----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.phase = Phase.QUEUED
        seq.uncached_tokens = self.expected_uncached(seq)
        if self.itl_target:
            self.note_question(seq)
        if self.config.prefix_cache:
            promised = self._promised
            for i in range(seq.num_prompt_tokens // self.pages.page_size):
                key = self.pages.page_key(seq, i)
                promised[key] = promised.get(key, 0) + 1
        self.waiting.push(seq)
        if seq.adapter is not None:
            self.adapters.added(seq.adapter)

    def expired(self, now: float) -> list[Sequence]:
        """Take out the waiting sequences past their queue deadline (the engine sheds them)."""
        return self.waiting.expired(now)

    def next_deadline(self) -> float | None:
        return self.waiting.next_deadline()


    # -- one iteration -------------------------------------------------------------------
    def schedule(self) -> Batch | None:
        """Plan the next step; None when there is nothing to run."""
        cfg, lim = self.config, self.limits
        batch = Batch(StepPlan(chunks=[], copies=[]), [], 0)
        if self.static and not self.running:
            self._admit_group(batch)
        elif not self.static:
            self._make_room(batch)

        order = sorted(self.running.values(), key=Sequence.victim_key.fget)
        if self.itl_target:
            order = self._fit_decodes(order, batch)
        interactive = any(not s.batch for s in order)
        self._schedule_decodes(order, batch, interactive)
        num_decode = len(batch.seqs)
        batch.num_decode = num_decode
        if self.proposer is not None:
            self._speculate(batch)  # some decodes become verifies of proposed tokens
        rows = batch.decode_rows
        # Batch jobs' prefill beside interactive work: what the step's slack allows, and
        # only in a step that prefills an interactive prompt anyway (a prefill chunk moves
        # a decode step up to a bigger compiled shape: a batch prompt must not be why).
        bg = self.background.prefill_tokens(
            sum(1 for s in batch.seqs if not s.batch), num_decode) if interactive else None

        def batch_prefill() -> int | None:  # tokens a batch prompt may take now (None: any)
            if bg is None:
                return None
            return bg if any(not s.batch for s in batch.seqs[num_decode:]) else 0

        # A step of verifies carries no prompt chunk (speculation yields to prompts, and
        # rows past the streams have no shape beside one).
        budget = 0 if batch.draft_rows else min(cfg.max_step_tokens - rows,
                                                lim.max_prefill_tokens)
        # The ITL budget, the trade-off between the streams' token gaps and the waiting
        # prompts' first tokens: beside decodes, prompt chunks fill what is left of the
        # ITL target, or where the decodes alone fill it, the share the learned costs
        # derive (`StepCostModel.itl_budget`): the pace. A prompt that would miss its TTFT
        # target at that pace takes bigger chunks (`_short_chunk`, `_deadline_chunk`).
        soft = budget
        pace = None
        itl_budget = None if self.itl_target else self.cost.itl_budget(rows, batch.work)
        if itl_budget is not None:
            pace = self.cost.prefill_budget(rows, batch.work)
            soft = min(budget, pace)
            batch.budget_s = itl_budget[0]
        short = cfg.short_prefill_tokens
        split = pace is not None and cfg.split_short_prefill
        reasons: set[str] = set()  # chunks sized past the pace, and why

        def limit(seq: Sequence, new: bool = False) -> int:
            rest = seq.num_tokens - seq.num_computed_tokens
            # A long prompt's tail stays at the pace (256 tokens after 6,000 made a 0.5 s
            # step), unless the pace would make it miss a TTFT target it can still meet.
            if rest > short or seq.num_tokens - seq.num_cached_tokens > short:
                grown = None if pace is None or seq.batch else self._deadline_chunk(
                    seq, rest, itl_budget[2], pace)
                n = min(budget, soft if grown is None else max(soft, grown))
                if grown is not None:
                    reasons.add("ttft")
            elif split and not seq.batch:
                beside = sum(len(c.token_ids) for c in batch.plan.chunks[num_decode:])
                chunk, why = self._short_chunk(seq, rest, num_decode, pace, new, beside)
                n = min(budget, chunk)
                if why:
                    reasons.add(why)
            else:
                n = budget
            room = batch_prefill() if seq.batch else None
            n = n if room is None else min(n, room)
            # With no stream decoding, no token gap is at stake: the step may be long.
            return self._room(batch, seq, n) if self.itl_target and num_decode else n

        slots = lim.max_prefill_seqs
        for seq in order:
            if budget <= 0 or slots <= 0:
                break
            if seq.phase is Phase.PREFILL:
                n = self._schedule_prefill(seq, batch, limit(seq))
                budget -= n
                soft -= n
                slots -= n > 0
                if bg is not None and seq.batch:
                    bg -= n

        if not self.static:
            skip: set[Sequence] = set()
            slot_wanted = False  # an adapter sequence waits for a slot: no other takes one
            while budget > 0 and slots > 0 and len(self.running) < self.max_running:
                seq = self.waiting.peek(skip)
                if seq is None:
                    break
                if seq.batch and batch_prefill() == 0:
                    break  # batch jobs are the last class: nothing behind is interactive
                if seq.adapter is not None and (
                        slot_wanted or not self.adapters.available(seq.adapter)):
                    slot_wanted = True
                    skip.add(seq)
                    continue
                if not self._decode_slot(seq):
                    break  # one more stream would push the steps past the ITL target
                admitted = self._admit(seq, batch)
                if admitted is None:
                    skip.add(seq)  # waits for a prefix being computed right now
                    continue
                if not admitted:
                    break
                n = self._schedule_prefill(seq, batch, limit(seq, new=True))
                budget -= n
                soft -= n
                slots -= n > 0
                if bg is not None and seq.batch:
                    bg -= n
                if n == 0:
                    break  # admitted; its prefill starts next step

        plan = batch.plan
        plan.swap_out, plan.swap_in = self.pages.take_swaps()
        if self.pages.imports:  # a failed launch forgets the pages cached for them
            plan.imports = self.pages.take_imports()
            batch.registered += [p for ids, _ in plan.imports for p in ids]
        if not (batch.seqs or plan.copies or plan.swap_out or plan.swap_in or plan.imports):
            return None
        batch.why = self._why(batch, itl_budget, reasons)
        self.plans[batch.why] += 1
        return batch

    def _schedule_decodes(self, order: list[Sequence], batch: Batch,
                          interactive: bool) -> None:
        pages = self.pages
        ps = pages.page_size
        chunks, seqs, copies = batch.plan.chunks, batch.seqs, batch.plan.copies
        decode = Phase.DECODE
        # Batch decodes beside interactive work: only as many as the step's slack allows
        # (the others keep their pages and wait a step).
        n_bat = sum(1 for s in order if s.batch and s.phase is decode)
        rows = self.background.decode_rows(
            sum(1 for s in order if not s.batch and s.phase is decode), n_bat,
            interactive) if n_bat else 0
        end = len(order)  # order[i:end] are not planned yet: the only possible victims
        i = 0
        while i < end:
            seq = order[i]
            i += 1
            if seq.phase is not decode:
                continue
            if seq.inflight and self._last_in_flight(seq):
                continue  # the step in flight samples its last token: it ends at commit
            if seq.batch:
                if rows <= 0:
                    continue
                rows -= 1
            # The last sampled token is written at its position (with a token in flight,
            # that one: a pending chunk).
            pos = len(seq.token_ids) - 1 + seq.inflight
            idx = pos // ps
            table = seq.kv_pages
            grow = idx >= len(table)
            if grow or not pages.is_writable(table[idx]):
                while pages.num_available < 1:
                    if end > i:
                        end -= 1
                        victim = order[end]
                        if victim.is_running:
                            self._preempt(victim, batch)
                    else:
                        self._preempt(seq, batch)
                        break
                if seq.phase is not decode:
                    continue  # preempted itself: nobody less urgent was left
                if grow:
                    table.extend(pages.allocate(1))
                else:
                    copies.append(pages.copy_on_write(table, idx))
                    batch.copied.append(seq)
            if self.window is not None:
                self.window.prepare(seq, pos, 1, batch.plan.window_copies)
            self.waiting.charge(seq, pos + 1)
            chunks.append(seq.chunk(pos, 1))
            seqs.append(seq)
            batch.work += pos + 1

    def _schedule_prefill(self, seq: Sequence, batch: Batch, budget: int) -> int:
        start = seq.num_computed_tokens
        n = min(seq.num_tokens - start, budget, self.limits.max_prefill_chunk)
        if n <= 0:
            return 0
        pages = self.pages
        idx = start // pages.page_size
        if not pages.is_writable(seq.kv_pages[idx]):
            if pages.num_available < 1:
                return 0  # wait for a page rather than preempt from the prefill side
            batch.plan.copies.append(pages.copy_on_write(seq.kv_pages, idx))
            batch.copied.append(seq)
        if self.window is not None:
            self.window.prepare(seq, start, n, batch.plan.window_copies)
        batch.plan.chunks.append(seq.chunk(start, n))
        batch.seqs.append(seq)
        batch.work += chunk_work(start, n)
        batch.prefill_padded += self.cost.padded(n)
        return n

    # -- admission and preemption ----------------------------------------------------------
    def _admit(self, seq: Sequence, batch: Batch, *, wait_for_prefix: bool = True) -> bool | None:
        """Admit the queue's head if its pages fit; False leaves it at the head. None: it
        is better off waiting, because a running prefill is computing its next pages."""
        pages = self.pages
        scoring = seq.scoring_prompt  # computes its whole prompt: no prefix hits
        hits = [] if scoring else pages.match(seq)
        tail: list[int] = []
        if self.window is not None and hits:  # only as far as the window's tail is cached
            n, tail = self.window.hits(seq, len(hits))
            del hits[n:]
        lower: list[int] = []  # host slots continuing the device hits
        if pages.tiers is not None and not scoring and pages.prefix_cache:
            lower = self._lower_hits(seq, len(hits))
            if lower is None:
                return None  # its next pages are being read from disk: wait for them
        if (wait_for_prefix and not scoring and pages.prefix_in_flight(
                seq, len(hits) + len(lower), self.running.values())):
            return None
        num_tokens = seq.num_tokens
        cached = (len(hits) + len(lower)) * pages.page_size
        # A fully cached sequence still computes its last position, for the logits; that
        # write lands in a cached page, hence a private copy (one more page).
        full_hit = cached == num_tokens
        need = pages.pages_for(num_tokens) - len(hits) + full_hit
        leaving_lru = sum(1 for p in hits if pages.ref[p] == 0)
        reserve = self.config.kv_reserve_pages if self.running else 0
        available = pages.num_available - leaving_lru
        if need + reserve > available or (
                seq.batch and not self.background.kv_ok(need, available, pages.num_usable)):
            return False

        self.waiting.admit(seq)
        if seq.adapter is not None:  # available: checked by the caller
            seq.adapter_slot, load = self.adapters.acquire(seq.adapter)
            if load:
                batch.plan.adapter_loads.append((seq.adapter_slot, seq.adapter))
        pages.acquire(hits)
        seq.kv_pages.extend(hits)
        if self.window is not None:
            self.window.admit(seq, len(hits), tail)
        if lower:  # copied up before the step's copies and chunks run (batch.registered:
            batch.registered += pages.take_up(seq, lower)  # a failed launch forgets them)
            pages.tiers.count_hits(lower)
        seq.num_computed_tokens = num_tokens - 1 if full_hit else cached
        if full_hit and (copy := pages.copy_on_write(seq.kv_pages, len(seq.kv_pages) - 1)):
            batch.plan.copies.append(copy)  # (a page copied up may be private already)
            batch.copied.append(seq)
        pages.grow(seq, num_tokens)
        pages.query_tokens += num_tokens
        pages.hit_tokens += seq.num_computed_tokens
        now = self.clock()
        if seq.admitted_at is None:
            seq.admitted_at = now
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        seq.phase = Phase.PREFILL
        self.running[seq.seq_id] = seq
        # Charge the whole prompt now (cache hits are free) so that the next pick in this
        # same iteration already sees this tenant's counter move.
        if seq.num_charged_tokens < seq.num_computed_tokens:
            seq.num_charged_tokens = seq.num_computed_tokens
        self.waiting.charge(seq, num_tokens)
        return True

    def _lower_hits(self, seq: Sequence, first: int) -> list[int] | None:
        """Host slots holding the sequence's pages from page `first` on, where copying them
        up beats computing them; None: the pages after those are on disk and are being
        read into host slots now (asked for here if worth it), so it waits."""
        pages, tiers = self.pages, self.pages.tiers
        token_s = self.cost.prefill_token_s
        slots = tiers.match(pages.metas_from(seq, first))
        run, busy = tiers.on_disk(pages.metas_from(seq, first + len(slots)))
        if busy or (run and tiers.worth(len(run), "disk", token_s)
                    and tiers.request_load(run, keep=slots)):
            return None
        return slots if tiers.worth(len(slots), "host", token_s) else []

    def _admit_group(self, batch: Batch) -> None:
        while len(self.running) < self.max_running:
            seq = self.waiting.peek()
            if seq is None or (seq.adapter is not None
                               and not self.adapters.available(seq.adapter)):
                return
            if not self._admit(seq, batch, wait_for_prefix=False):
                return

    def _make_room(self, batch: Batch) -> None:
        """An interactive request waits for a running slot or for pages held by batch jobs'
        sequences: those give them up (least urgent first; recomputed later)."""
        if not self.waiting.num_interactive:
            return
        head = self.waiting.peek()
        if head is None or head.batch:
            return
        victims = sorted((s for s in self.running.values() if s.batch),
                         key=Sequence.victim_key.fget, reverse=True)
        pages = self.pages
        need = pages.pages_for(head.num_tokens) + self.config.kv_reserve_pages
        while victims and (len(self.running) >= self.max_running
                           or pages.num_available < need):
            self._preempt(victims.pop(0), batch)

    def _preempt(self, seq: Sequence, batch: Batch) -> None:
        """Recompute later: release the pages, back to the front of the line."""
        del self.running[seq.seq_id]
        self._free_pages(seq)
        self._release_adapter(seq)
        self.spec_forget(seq)
        seq.num_computed_tokens = 0
        seq.inflight = 0  # a token sampled in flight is dropped (`commit`): recomputed
        seq.num_preemptions += 1
        seq.queued_at = self.clock()
        self.num_preemptions += 1
        seq.phase = Phase.QUEUED
        # Queue first, then stop counting it as running: the tenant never looks idle, so
        # its fair-share counter is kept (preemption is not a reset).
        self.waiting.push(seq, front=True)
        self.waiting.stopped(seq)
        batch.preempted.append(seq.seq_id)

    # -- helpers --------------------------------------------------------------------------

    def _last_in_flight(self, seq: Sequence) -> bool:
        """The token in flight is the sequence's last: max_tokens or the context."""
        n = seq.num_generated + seq.inflight
        return n >= seq.max_tokens or bool(
            self.max_context and seq.num_tokens + seq.inflight >= self.max_context)

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.adapter is not None and seq.adapter_slot >= 0:
            self.adapters.release(seq.adapter)
            seq.adapter_slot = -1
