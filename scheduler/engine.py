"""The engine loop: one trio task per replica drives the runner, step after step.

Each iteration, on the trio thread:

1. aborts noted during the last step take effect (their pages go back to the pool);
2. requests that waited past their queue deadline are shed (ErrorEvent kind="shed");
3. `Scheduler.schedule()` plans the step; with nothing to do the loop sleeps on an event
   that `submit` and `abort` set (no busy loop);
4. `runner.launch(plan)` packs it and starts its computation, in a worker thread, so the
   event loop keeps serving HTTP;
5. the step launched before it is collected (`runner.collect`, in a worker thread: it
   waits for that computation) and committed: tokens appended, text decoded
   incrementally, stops applied (eos, stop ids, stop strings across tokens, max_tokens,
   context), events delivered with `send_nowait`, finished sequences' pages freed.

Overlapped scheduling (`SchedulerConfig.overlap`, on by default; vLLM's async scheduling,
SGLang's overlap scheduler): steps 1-4 for step N+1 run while step N computes, so the host
work of an iteration leaves the computation idle only where it takes longer than a step.
N+1 is planned as if each of N's sampled tokens were known: such a sequence's decode is a
`pending` chunk, whose token the runner reads on the device from N's sampler output. The
bookkeeping is `Scheduler.launched` (chunks count as computed, one token in flight) and
`Scheduler.commit` (the token appended). A sequence that N ends (a stop, eos) has one
wasted row in N+1, whose token is dropped: nothing is delivered that the plain loop would
not deliver (tests/test_overlap.py checks token equality). A step holding a sequence that
needs its last token on the host to plan its next (structured output, penalties) is
committed before the next plan; so is every step of a runner that cannot overlap
(`can_overlap`, a multi-host replica) or has only `step`. Without overlap, each step is
launched and committed at once.

Ownership: every `Sequence` and the page allocator are touched only on the trio thread
(call `submit`, `abort` and `stats` from it, never from a worker thread).
The worker thread only reads the `StepPlan`, and nothing it references is mutated while
it packs: `abort()` of a sequence inside a step in flight only marks it. Once launched, a
step's pages may be freed and given to another sequence: the device runs steps in launch
order, so the old step has written and read them before the new owner's step touches
them.

Delivery never blocks the loop, and every request ends in one place: scheduler/delivery.py.

Failures are contained to the requests they touch (docs/reliability.md):
- an exception from `runner.step` fails the requests in that step with an ErrorEvent and
  the loop goes on; `max_consecutive_failures` in a row mean the runner is broken, so the
  engine marks itself dead (`alive == False`, `death` says why), fails everything, and
  `run()` returns. `submit` then raises `EngineDead`. `RunnerLost` (a multi-host
  replica's process is gone; also polled while idle) kills it at once;
- a row the runner reports in `StepResult.failed` (non-finite logits) ends that request
  alone with an ErrorEvent; the step's other rows are committed as usual;
- an exception while turning one sequence's token into output (its detokenizer, stop
  strings, grammar) ends that request alone (`_output_failed`).

The admission prediction is not here: the door is scheduler/admission.py, the step-cost
model it and the policy predict from is scheduler/step_cost.py; the engine only tells the
door when the steps in flight should end (`step_ends_at`) and feeds the model measured
step times. The step log is scheduler/step_log.py.
(About 560 lines: the loop and a step's whole way through it, launch, collect, commit
and the step record, are read in one place, beside the replica's face to the app:
submit, abort, and the pages a prefill server computed for it.)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import uuid
from collections import deque
from typing import Any, Callable

import trio

from config.settings import SchedulerConfig

from .admission import Admission
from .api import EngineDead, EngineStats, ErrorEvent, GenerateRequest, RequestHandle
from .batch import Batch
from .delivery import Delivery
from .kv_tiers import KVTiers
from .output import OutputStream
from .policy import Scheduler
from .protocol import Detokenizer, Runner, RunnerLost
from .request import Phase, Sequence
from .step_log import StepLog, StepRecord

log = logging.getLogger("sluice.engine")

EVENT_BUFFER = 16  # events per request channel; more than that are coalesced
_IDLE_POLL_S = 0.01  # while undelivered events wait for a slow client and nothing runs
_LOST_POLL_S = 0.5  # how often an idle engine asks a runner that can be lost (multi-host)


@dataclasses.dataclass(slots=True)
class _Launched:
    """A step the runner has started and the engine has not committed yet."""

    batch: Batch
    handle: Any  # the runner's (`launch`'s return)
    t0: float  # when its launch began (engine clock)
    predicted: float  # the step-cost model's estimate of its seconds
    index: int  # launch order
    overlappable: bool  # the next step may be planned before its tokens are back

class Engine(Delivery):
    """One replica: a runner, its KV pool's books, a waiting queue and a running batch."""

    max_consecutive_failures = 3

    def __init__(self, runner: Runner, detokenizer: Detokenizer, config: SchedulerConfig, *,
                 name: str = "default", clock: Callable[[], float] = time.monotonic,
                 step_records: int = 1024, proposer: Any = None) -> None:
        self.runner = runner
        self.detokenizer = detokenizer
        self.config = config
        self.name = name
        self.clock = clock
        self.scheduler = Scheduler(config, num_pages=runner.num_pages,
                                   page_size=runner.page_size, limits=runner.limits,
                                   clock=clock, adapter_slots=runner.adapter_slots,
                                   max_context=runner.max_context)
        self.admission = Admission(self.scheduler, config, clock,
                                   max_context=runner.max_context)
        if proposer is not None and not self.scheduler.static:  # a draft model's
            # (model/draft.py), built by the loader
            self.scheduler.proposer = proposer
        # The KV tiers below the pool (scheduler/kv_tiers.py), if the runner keeps them.
        store = getattr(runner, "kv_store", None)
        if store is not None:
            self.scheduler.pages.tiers = KVTiers(store.host_slots, store.page_bytes,
                                                 disk=getattr(store, "source", store.disk),
                                                 page_size=runner.page_size)
        self._log = StepLog(step_records)
        self.step_records: deque[StepRecord] = self._log.records  # the last few steps
        self._seqs: dict[str, Sequence] = {}  # request_id -> live sequence
        self._free_ids: list[int] = []  # seq_ids to reuse (keeps them small)
        self._next_id = 0
        self._arrivals = 0
        self._undelivered: dict[int, Sequence] = {}  # id(seq) -> seq with pending events
        self._pending_aborts: list[Sequence] = []  # aborted inside the step in flight
        self._step_ends_at: float | None = None  # the step in flight's expected end; None: none
        self._wakeup = trio.Event()
        self._alive = True
        self.death: str | None = None  # why the engine stopped (None: it has not)
        self._draining = False
        self._failures = 0
        self._started_at = clock()
        self._seeded = 0  # runner.warmup_times already fed to the step-cost model
        # When this iteration's host work began: the previous step's end, unless the loop
        # idled in between (then the top of this iteration).
        self._iter_from: float | None = None
        self._last_end = -math.inf  # when the last committed step ended
        self._launches = 0  # steps launched so far
        self._host = 0.0  # the engine's host work since the last step was logged
        self._failed_index = 0  # the last failed step's launch index
        # Steps launched and not yet committed, oldest first (at most two, for a moment).
        self._flight: list[_Launched] = []
        # Prompts a prefill replica is computing for this one (`reserve_room`).
        self._reserved = 0  # pages promised to them
        self._in_transit = 0

    # -- the public face ---------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._alive

    def precheck(self, pending: int = 0, max_tokens: int | None = None) -> None:
        """Raise `Overloaded` (or `EngineDead`) if even the shortest request asking for
        `max_tokens` (None: not said) would be refused now, `pending` more being
        tokenized: the server answers 429 before tokenizing anything."""
        if not self._alive:
            raise EngineDead(f"engine {self.name!r} is dead")
        self._seed_costs()
        # Prompts a prefill replica is computing for this one come here next.
        self.admission.precheck(step_ends_at=self._step_ends_at,
                                pending=pending + self._in_transit, max_tokens=max_tokens)

    def _seed_costs(self) -> None:
        """The runner's timed warm-up runs, as they come, into the step-cost model."""
        times = self.runner.warmup_times
        while self._seeded < len(times):
            self.scheduler.cost.seed(*times[self._seeded])
            self._seeded += 1

    def submit(self, req: GenerateRequest, events: Any = None) -> RequestHandle:
        """Queue a request; never blocks. Raises `Overloaded` (draining, or refused by
        `Admission.check`: queue full, expected time to first token past the target),
        `EngineDead`, or ValueError for a request this replica can never serve.
        `events`: a send channel to clone for this sequence's events (one of `n`
        choices sharing the caller's stream); None: a channel of its own."""
        if not self._alive:
            raise EngineDead(f"engine {self.name!r} is dead")
        if self._draining:
            raise self.admission.refuse("draining", 0.0, "server is draining; retry elsewhere")
        if req.adapter is not None and not self.runner.adapter_slots:
            raise ValueError(f"adapter {req.adapter!r}: this model has no adapter slots")
        self._seed_costs()
        now = self.clock()
        request_id = req.request_id or uuid.uuid4().hex
        cfg = self.config
        deadline = cfg.queue_deadline_s if req.deadline_s is None else req.deadline_s
        # Built first (no id yet) so the door can look its prompt up in the prefix cache.
        seq = Sequence(req, request_id=request_id, seq_id=-1, arrived_at=now,
                       deadline_at=now + deadline, arrival_order=self._arrivals + 1)
        seq.predicted_ttft = self.admission.check(
            req, step_ends_at=self._step_ends_at,
            uncached=self.scheduler.expected_uncached(seq),
            prefix_wait=self.scheduler.prefix_wait_tokens(seq))
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        self._arrivals += 1
        seq.seq_id = self._new_seq_id()
        if events is None:
            send, recv = trio.open_memory_channel(EVENT_BUFFER)
        else:
            send, recv = events.clone(), None
        stop_ids = frozenset(req.stop_token_ids)
        if not req.ignore_eos:
            stop_ids |= self.runner.eos_token_ids
        seq.output = OutputStream(
            self.detokenizer.incremental(seq.prompt_ids), stop_ids=stop_ids, stops=req.stop,
            channel=send, want_logprobs=req.sampling.logprobs or req.sampling.top_logprobs > 0,
            index=req.index)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        self._wakeup.set()
        return RequestHandle(request_id=request_id, events=recv)

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone). Synchronous and safe in a cancelled scope or a
        `finally`: it never awaits. Its pages are back in the pool before the next
        iteration starts: at once, unless the sequence is inside the step now running,
        in which case right after that step returns."""
        seq = self._seqs.get(request_id)
        if seq is not None and not seq.aborted:
            self._abort_request(seq)
            self._wakeup.set()

    def retire_adapter(self, name: str) -> None:
        """An adapter was unloaded: its weights go once no sequence here needs them (the
        app refuses new requests for it; queued and running ones finish)."""
        if self.scheduler.adapters.retire(name):
            self.runner.drop_adapter(name)

    def persist_prefixes(self) -> int:
        """At shutdown, once the loop has stopped: the device's cached prefix pages not on
        the disk tier yet go there, so a restart on the same folder finds them (the
        runner's `save_pages`; 0 without a disk tier). Returns the pages written."""
        store = getattr(self.runner, "kv_store", None)
        if store is None or store.disk is None or self._flight:
            return 0
        entries = [e for e in self.scheduler.pages.cached_entries() if e[1] not in store.disk]
        return self.runner.save_pages(entries)

    # -- disaggregated prefill (app/disagg.py) ------------------------------------------
    def _probe(self, req: GenerateRequest) -> Sequence:
        now = self.clock()
        return Sequence(req, request_id="", seq_id=-1, arrived_at=now, deadline_at=now)

    @property
    def free_pages(self) -> int:
        """KV pages free or only cached, less those promised to prompts being prefilled
        for this replica elsewhere (`reserve_room`)."""
        return self.scheduler.pages.num_available - self._reserved

    def prompt_page_keys(self, req: GenerateRequest) -> list[int]:
        """The prefix-cache keys of the prompt's full pages."""
        return [key for key, _ in self.scheduler.pages.metas_from(self._probe(req), 0)]

    def held_prompt_pages(self, req: GenerateRequest) -> int:
        """Leading full pages of the prompt this replica has already (its pool or a tier
        below it): a prefill replica need not send them."""
        return self.scheduler.pages.expected_hits(self._probe(req)) // self.runner.page_size

    def reserve_room(self, req: GenerateRequest) -> int:
        """Before a prefill replica computes the prompt for this one: `Overloaded` unless
        the queue would take it and free pages hold its prompt now, beside the prompts
        already being prefilled for it (never prefill and drop); ValueError for one it can
        never serve. Returns the pages reserved: `release_room` once it is submitted."""
        if not self._alive:
            raise EngineDead(f"engine {self.name!r} is dead")
        self.admission.validate(req)
        self.precheck(0, req.max_tokens)
        pages = self.scheduler.pages
        need = pages.pages_for(len(req.prompt_ids) + 1)
        if need > self.free_pages:
            raise self.admission.refuse("kv_full", self.admission.ticket(
                self.admission.retry_after()), "no free KV pages for the prompt")
        self._reserved += need
        self._in_transit += 1
        return need

    def release_room(self, pages: int) -> None:
        self._reserved -= pages
        self._in_transit -= 1

    def receive_pages(self, req: GenerateRequest, first: int, data: Any) -> list[int]:
        """Pages a prefill replica computed for `req`'s prompt (page `first` on, `data`
        [n, *page_shape]) into this replica's inbox, where its admission finds them as a
        tier hit; returns their keys (`discard_pages` once the request is in or gone)."""
        inbox = self.runner.kv_store.inbox
        seq = self._probe(req)
        entries = [(key, meta, data[j]) for j, (key, meta) in
                   zip(range(len(data)), self.scheduler.pages.metas_from(seq, first))]
        inbox.deposit(entries)
        self._wakeup.set()
        return [key for key, _, _ in entries]

    def import_pages(self, req: GenerateRequest, first: int, data: Any) -> int:
        """Pages a prefill replica of this process computed for `req`'s prompt (page
        `first` on, its runner's `export_pages` result), written straight into this
        replica's pool by its next step and cached (`PageAllocator.adopt`); returns how
        many it took (0: no room now: `receive_pages` them instead)."""
        n = self.scheduler.pages.adopt(self._probe(req), first, data)
        self._wakeup.set()
        return n

    def discard_pages(self, keys: list[int]) -> None:
        if keys:
            self.runner.kv_store.inbox.discard(keys)

    def start_draining(self) -> None:
        """Refuse new work (Overloaded "draining"); what is queued or running finishes."""
        self._draining = True

    def seq_id_of(self, request_id: str) -> int | None:
        """The small integer the runner knows the request by (while it is in flight)."""
        seq = self._seqs.get(request_id)
        return seq.seq_id if seq is not None else None

    def stats(self, audit: bool = False) -> EngineStats:
        """`audit`: also check the KV books against the live page tables (O(pages))."""
        now = self.clock()
        return EngineStats(**self.scheduler.usage(now, audit=audit), **self._log.totals(),
                           rejections=dict(self.admission.rejections),
                           ttft_factor=self.admission.ttft_factor(),
                           uptime_s=max(0.0, now - self._started_at), alive=self._alive)

    # -- the loop ------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled or dead. Calls ``task_status.started()`` once ready."""
        self._started_at = self.clock()
        # Our own thread token: the app's other to_thread users must never delay a step.
        self._limiter = trio.CapacityLimiter(1)
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:  # the KV tiers' disk reads
                self._nursery = nursery
                await self._loop()
                nursery.cancel_scope.cancel()
        finally:
            if self._alive:  # cancelled: nobody will serve what is left
                self._die("engine stopped")

    async def _loop(self) -> None:
        """Plan, launch and commit steps until the engine dies."""
        while self._alive:
            if lost := getattr(self.runner, "lost", None):
                self._die(f"engine {self.name!r} is dead: {lost}")
                break
            if self._iter_from is None:
                self._iter_from = self.clock()
            t_plan = self.clock()
            self._seed_costs()
            self._end_deferred_aborts()
            self._shed_expired()
            if self._undelivered:
                self._deliver_pending()
            prev = self._flight[0] if self._flight else None
            if prev is not None and not prev.overlappable:
                await self._finish(prev)  # its tokens are needed to plan the next step
                continue
            if wanted := self.scheduler.spec_wanted():
                await self._draft(wanted)  # a draft model's guesses, before the plan
            batch = self.scheduler.schedule()
            self._host += self.clock() - t_plan
            if self.scheduler.pages.tiers is not None:
                self._start_loads()
            if batch is None:
                if prev is not None:
                    await self._finish(prev)
                    continue
                self._iter_from = None
                await self._idle()
                continue
            launched = await self._launch(batch)
            if prev is not None:  # the step launched before: its tokens, while the new one runs
                await self._finish(prev)
            if launched is not None and not (self._overlap and launched.overlappable):
                await self._finish(launched)
            # Let other tasks (HTTP handlers reading events) run between steps even if
            # the runner returned instantly.
            await trio.lowlevel.checkpoint()

    async def _draft(self, wanted) -> None:
        """A draft model guesses for `wanted` (sequence, k) in the worker thread, beside
        no step of the target's (they share the cores). A failure costs the guesses,
        never a request."""
        try:
            await trio.to_thread.run_sync(self.scheduler.proposer.prepare, wanted,
                                          limiter=self._limiter)
        except Exception:  # noqa: BLE001 - logged; this step plans without guesses
            log.warning("engine %s: the draft model's guesses failed", self.name,
                        exc_info=True)

    def _start_loads(self) -> None:
        """Disk reads the last plan asked for: each in a worker thread beside the steps
        (the prompt waiting for them is admitted once they are in host slots)."""
        for job in self.scheduler.pages.tiers.take_loads():
            self._nursery.start_soon(self._load, job)

    async def _load(self, job) -> None:
        t0 = self.clock()
        try:
            await trio.to_thread.run_sync(self.runner.kv_store.load, job)
        finally:  # a read that failed or was cancelled gives its slots back
            self.scheduler.pages.tiers.loaded(job, self.clock() - t0)
            self._wakeup.set()

    async def _idle(self) -> None:
        self._wakeup = trio.Event()
        timeout = math.inf
        deadline = self.scheduler.next_deadline()
        if deadline is not None:
            timeout = max(0.0, deadline - self.clock())
        if self._undelivered:
            timeout = min(timeout, _IDLE_POLL_S)
        if hasattr(self.runner, "lost"):
            timeout = min(timeout, _LOST_POLL_S)
        with trio.move_on_after(timeout):
            await self._wakeup.wait()

    # The runner is read at each call (tests wrap a live engine's runner in fault injection).
    @property
    def _overlap(self) -> bool:
        """Plan and launch the next step while the last one runs: configured, and the
        runner has `launch`/`collect` and does not refuse it (`can_overlap`)."""
        runner = self.runner
        return (self.config.overlap and hasattr(runner, "launch")
                and getattr(runner, "can_overlap", True))

    def _runner_launch(self, plan):
        launch = getattr(self.runner, "launch", None)
        return self.runner.step(plan) if launch is None else launch(plan)

    def _runner_collect(self, handle):
        collect = getattr(self.runner, "collect", None)
        return handle if collect is None else collect(handle)

    async def _launch(self, batch: Batch) -> _Launched | None:
        """Start a planned step (packed and running when this returns); None: it failed."""
        t0 = self.clock()
        index = self._launches = self._launches + 1
        predicted = self.scheduler.predict(batch)
        # Set while a step is in flight (aborts of its sequences wait for it); admission
        # counts what is left of the steps launched.
        self._step_ends_at = max(t0, self._step_ends_at or t0) + predicted
        try:
            handle = await trio.to_thread.run_sync(self._runner_launch, batch.plan,
                                                   limiter=self._limiter)
            self._host += self.clock() - t0  # packing, queueing the programs
        except Exception as exc:  # the runner failed this step
            if not self._flight:
                self._step_ends_at = None
            self._failed_index = index
            self._step_failed(batch, exc, t0)
            if isinstance(exc, RunnerLost) and self._alive:
                self._die(f"engine {self.name!r} is dead: {exc}")
            return None
        self.scheduler.launched(batch)
        # A verify's next proposals need its tokens on the host too.
        launched = _Launched(batch, handle, t0, predicted, index,
                             overlappable=not (batch.draft_rows or batch.spec_sync or any(
                                 s.needs_host_token for s in batch.seqs)))
        self._flight.append(launched)
        return launched

    async def _finish(self, launched: _Launched) -> None:
        """Wait for a launched step (the oldest in flight) and commit its results."""
        batch, t0 = launched.batch, launched.t0
        t_collect = self.clock()
        try:
            result = await trio.to_thread.run_sync(self._runner_collect, launched.handle,
                                                   limiter=self._limiter)
        except Exception as exc:  # the runner failed this step
            self._failed_index = launched.index
            self._step_failed(batch, exc, t0)
            if isinstance(exc, RunnerLost) and self._alive:
                self._die(f"engine {self.name!r} is dead: {exc}")
            return
        finally:  # also on Cancelled, which only arrives after the thread is done
            self._flight.remove(launched)
            if not self._flight:
                self._step_ends_at = None
        t_commit = self.clock()
        for seq in batch.seqs:  # rows the runner could not sample (non-finite logits)
            if (why := result.failed.get(seq.seq_id)) is not None and seq.is_running:
                self._end_request(seq, "error", ErrorEvent(message=f"model step failed: {why}"))
        try:
            sampled = self.scheduler.commit(batch, result)
        except Exception as exc:  # a malformed result (a token missing)
            self._step_failed(batch, exc, t0)
            return
        t1 = self.clock()
        if launched.index > self._failed_index:  # "in a row" counts in launch order
            self._failures = 0
        if result.device_seconds > 0:
            self.scheduler.observe(batch, result.device_seconds, result.shape)
        if result.swap_in_seconds > 0 and (tiers := self.scheduler.pages.tiers) is not None:
            tiers.note_rate("host", len(batch.plan.swap_in) * tiers.page_bytes,
                            result.swap_in_seconds)
        # A verify yields several tokens of one sequence, appended already: each is
        # taken with the number after it, which a stop among them takes back.
        after = {}
        for seq, _ in sampled:
            after[id(seq)] = after.get(id(seq), 0) + 1
        for seq, tok in sampled:
            after[id(seq)] -= 1
            if seq.phase is Phase.DONE:
                continue  # ended by a token before this one of the same verify
            try:
                self._take(seq, tok, t1, unseen=after[id(seq)])
            except Exception as exc:  # this request's output alone is broken
                self._output_failed(seq, exc)
        self._end_deferred_aborts()
        # Host work: the engine's own, this iteration (planning the next step, packing
        # and queueing it, reading this one back, commit, detokenizing, delivery), over-
        # lapped with a computation or not; the computation's idle gap before this step,
        # as the runner measured it, within the iteration (not while the engine idled).
        end = self.clock()
        compute = max(0.0, result.device_seconds - result.host_seconds)
        readback = max(0.0, t_commit - t_collect - result.wait_seconds) \
            if result.wait_seconds else 0.0
        host, self._host = self._host + readback + end - t_commit, 0.0
        wall = end - (t0 if self._iter_from is None else self._iter_from)
        idle = min(result.idle_seconds, wall) if result.idle_seconds else 0.0
        self._iter_from = end
        # Steps' intervals in the log do not overlap: one launched while the previous ran
        # starts, for the record, when that one ended.
        start = max(t0, self._last_end)
        self._last_end = t1
        tokens = batch.plan.num_tokens
        if self._overlap:  # the host work a verify's step adds to its computation
            sched = self.scheduler
            sched.spec_sync_s += 0.1 * (host - sched.spec_sync_s)
        self._log.record(batch, start, max(start, t1), real_tokens=result.real_tokens or tokens,
                         padded_tokens=result.padded_tokens or tokens,
                         predicted_s=launched.predicted, measured_s=result.device_seconds,
                         compute_s=compute, host_s=host, idle_s=idle)
        self._log.generation_tokens += len(sampled)

    def _die(self, reason: str) -> None:
        self._alive = False
        self.death = reason
        self._fail_all(reason)

    def _step_failed(self, batch: Batch, exc: Exception, t0: float) -> None:
        t1 = self.clock()
        self._failures += 1
        message = f"model step failed: {type(exc).__name__}: {exc}"
        self._log.record(batch, t0, t1, error=message)
        # Sequences admitted since its launch onto the pages it was to compute fail too.
        for seq in (*batch.seqs, *batch.copied, *self.scheduler.forget(batch)):
            self._end_request(seq, "error", ErrorEvent(message=message))
        if self._failures >= self.max_consecutive_failures:
            self._die(f"engine {self.name!r} is dead after {self._failures} failed steps in "
                      f"a row; last: {message}")

    # -- helpers -------------------------------------------------------------------------
    def _new_seq_id(self) -> int:
        if self._free_ids:
            return self._free_ids.pop()
        self._next_id += 1
        return self._next_id - 1
