"""The engine loop: one trio task per replica drives the runner, step after step.

Each iteration, on the trio thread:

1. aborts noted during the last step take effect (their pages go back to the pool);
2. requests that waited past their queue deadline are shed (ErrorEvent kind="shed");
3. `Scheduler.schedule()` plans the step; with nothing to do the loop sleeps on an event
   that `submit` and `abort` set (no busy loop);
4. `runner.step(plan)` runs in a worker thread, so the event loop keeps serving HTTP;
5. the results are committed: tokens appended, text decoded incrementally, stops applied
   (eos, stop ids, stop strings across tokens, max_tokens, context), events delivered with
   `send_nowait`, and finished sequences' pages freed, all before the next plan.

Ownership: every `Sequence` and the page allocator are touched only on the trio thread
(call `submit`, `abort` and `stats` from it, never from a worker thread).
The worker thread only reads the `StepPlan`, and nothing it references is mutated while
the step is in flight: `abort()` of a sequence inside the step only marks it.

Delivery never blocks the loop: each request has a bounded channel; when it is full the
tokens stay in the request's `OutputStream` and go out coalesced into the next event once
the client has read. A client that went away (receiver closed) is treated as an abort.

Failures: an exception from `runner.step` fails the requests in that step with an
ErrorEvent and the loop goes on; `max_consecutive_failures` in a row mean the runner is
broken, so the engine marks itself dead (health checks see `alive == False`), fails
everything, and `run()` returns. `submit` then raises `EngineDead`.
"""

from __future__ import annotations

import math
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Callable

import trio

from config.settings import SchedulerConfig

from .api import (EngineDead, EngineStats, ErrorEvent, FinishEvent, GenerateRequest,
                  Overloaded, RequestHandle)
from .output import OutputStream
from .policy import Batch, Scheduler
from .protocol import Detokenizer, Runner
from .request import Phase, Sequence

EVENT_BUFFER = 16  # events per request channel; more than that are coalesced
_IDLE_POLL_S = 0.01  # while undelivered events wait for a slow client and nothing runs


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


class Engine:
    """One replica: a runner, its KV pool's books, a waiting queue and a running batch."""

    max_consecutive_failures = 3

    def __init__(
        self,
        runner: Runner,
        detokenizer: Detokenizer,
        config: SchedulerConfig,
        *,
        name: str = "default",
        clock: Callable[[], float] = time.monotonic,
        step_records: int = 1024,
    ) -> None:
        self.runner = runner
        self.detokenizer = detokenizer
        self.config = config
        self.name = name
        self.clock = clock
        self.scheduler = Scheduler(config, num_pages=runner.num_pages,
                                   page_size=runner.page_size, limits=runner.limits,
                                   clock=clock)
        self.step_records: deque[StepRecord] = deque(maxlen=step_records)
        self._seqs: dict[str, Sequence] = {}  # request_id -> live sequence
        self._free_ids: list[int] = []  # seq_ids to reuse (keeps them small)
        self._next_id = 0
        self._arrivals = 0
        self._undelivered: dict[int, Sequence] = {}  # id(seq) -> seq with pending events
        self._pending_aborts: list[Sequence] = []
        self._in_step = False
        self._step_ends_at = 0.0  # the step in flight: when it is expected to end
        self._wakeup = trio.Event()
        self._alive = True
        self._draining = False
        self._failures = 0
        self._finish_times: deque[float] = deque(maxlen=256)  # for Retry-After
        self._started_at = clock()
        # counters
        self._steps = 0
        self._busy_s = 0.0
        self._real_tokens = 0
        self._padded_tokens = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._rejections: dict[str, int] = {}

    # -- the public face ---------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._alive

    def submit(self, req: GenerateRequest) -> RequestHandle:
        """Queue a request; never blocks. Raises `Overloaded` (queue full, draining),
        `EngineDead`, or ValueError for a request this replica can never serve."""
        if not self._alive:
            raise EngineDead(f"engine {self.name!r} is dead")
        if self._draining:
            raise self._reject("draining", 0.0, "server is draining; retry elsewhere")
        self._validate(req)
        sched = self.scheduler
        cfg = self.config
        if sched.num_waiting >= cfg.max_waiting:
            raise self._reject("queue_full", self._retry_after())
        if sched.waiting.num_tokens + len(req.prompt_ids) > cfg.max_waiting_tokens:
            raise self._reject("queue_tokens", self._retry_after())
        if not req.batch:
            self._admit_by_ttft(len(req.prompt_ids))

        now = self.clock()
        request_id = req.request_id or uuid.uuid4().hex
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        deadline = cfg.queue_deadline_s if req.deadline_s is None else req.deadline_s
        self._arrivals += 1
        seq = Sequence(req, request_id=request_id, seq_id=self._new_seq_id(), arrived_at=now,
                       deadline_at=now + deadline, arrival_order=self._arrivals)
        send, recv = trio.open_memory_channel(EVENT_BUFFER)
        stop_ids = frozenset(req.stop_token_ids)
        if not req.ignore_eos:
            stop_ids |= self.runner.eos_token_ids
        seq.output = OutputStream(
            self.detokenizer.incremental(seq.prompt_ids), stop_ids=stop_ids, stops=req.stop,
            channel=send, want_logprobs=req.sampling.logprobs or req.sampling.top_logprobs > 0)
        self._seqs[request_id] = seq
        sched.add(seq)
        self._wakeup.set()
        return RequestHandle(request_id=request_id, events=recv)

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone). Synchronous and safe in a cancelled scope or a
        `finally`: it never awaits. Its pages are back in the pool before the next
        iteration starts: at once, unless the sequence is inside the step now running,
        in which case right after that step returns."""
        seq = self._seqs.get(request_id)
        if seq is not None and not seq.aborted:
            self._abort_seq(seq)
            self._wakeup.set()

    def _abort_seq(self, seq: Sequence) -> None:
        seq.aborted = True
        if self._in_step and seq.is_running:
            self._pending_aborts.append(seq)  # the runner may be reading its page table
        else:
            self._end(seq, "abort")

    def start_draining(self) -> None:
        """Refuse new work (Overloaded "draining"); what is queued or running finishes."""
        self._draining = True

    def seq_id_of(self, request_id: str) -> int | None:
        """The small integer the runner knows the request by (while it is in flight)."""
        seq = self._seqs.get(request_id)
        return seq.seq_id if seq is not None else None

    def stats(self) -> EngineStats:
        sched = self.scheduler
        pages = sched.pages
        now = self.clock()
        oldest = sched.waiting.oldest_queued_at()
        return EngineStats(
            running=sched.num_running,
            waiting=sched.num_waiting,
            oldest_waiting_age_s=max(0.0, now - oldest) if oldest is not None else 0.0,
            kv_pages_total=pages.num_usable,
            kv_pages_in_use=pages.num_in_use,
            kv_pages_cached=pages.num_cached,
            kv_pages_free=pages.num_free,
            prefix_cache_queries_tokens=pages.query_tokens,
            prefix_cache_hits_tokens=pages.hit_tokens,
            preemptions=sched.num_preemptions,
            rejections=dict(self._rejections),
            steps=self._steps,
            busy_s=self._busy_s,
            uptime_s=max(0.0, now - self._started_at),
            real_tokens=self._real_tokens,
            padded_tokens=self._padded_tokens,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            alive=self._alive,
        )

    # -- the loop ------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled or dead. Calls ``task_status.started()`` once ready."""
        self._started_at = self.clock()
        # Our own thread token: the app's other to_thread users must never delay a step.
        self._limiter = trio.CapacityLimiter(1)
        task_status.started()
        try:
            while self._alive:
                self._apply_pending_aborts()
                self._shed_expired()
                if self._undelivered:
                    self._deliver_pending()
                batch = self.scheduler.schedule()
                if batch is None:
                    await self._idle()
                    continue
                await self._step(batch)
                # Let other tasks (HTTP handlers reading events) run between steps even if
                # the runner returned instantly.
                await trio.lowlevel.checkpoint()
        finally:
            if self._alive:  # cancelled: nobody will serve what is left
                self._alive = False
                self._fail_all("engine stopped")

    async def _idle(self) -> None:
        self._wakeup = trio.Event()
        timeout = math.inf
        deadline = self.scheduler.waiting.next_deadline()
        if deadline is not None:
            timeout = max(0.0, deadline - self.clock())
        if self._undelivered:
            timeout = min(timeout, _IDLE_POLL_S)
        with trio.move_on_after(timeout):
            await self._wakeup.wait()

    async def _step(self, batch: Batch) -> None:
        runner = self.runner
        t0 = self.clock()
        self._in_step = True
        self._step_ends_at = t0 + self.scheduler.cost.estimate(
            batch.num_decode, batch.plan.num_tokens - batch.num_decode)
        try:
            result = await trio.to_thread.run_sync(runner.step, batch.plan,
                                                   limiter=self._limiter)
        except Exception as exc:  # the runner failed this step
            self._in_step = False
            self._step_failed(batch, exc, t0)
            return
        finally:  # also on Cancelled, which only arrives after the thread is done
            self._in_step = False
        try:
            sampled = self.scheduler.commit(batch, result)
        except Exception as exc:  # a malformed result (a token missing)
            self._step_failed(batch, exc, t0)
            return
        t1 = self.clock()
        self._failures = 0
        tokens = batch.plan.num_tokens
        if result.device_seconds > 0:
            self.scheduler.cost.observe(batch.num_decode, tokens - batch.num_decode,
                                        result.device_seconds)
        self._record(batch, t0, t1, result.real_tokens or tokens,
                     result.padded_tokens or tokens)
        self._generation_tokens += len(sampled)
        max_context = runner.max_context
        for seq, tok in sampled:
            if seq.first_token_at is None:
                seq.first_token_at = t1
            out = seq.output
            reason = "stop" if out.append(tok) else None
            if reason is None and (seq.num_generated >= seq.max_tokens
                                   or seq.num_tokens >= max_context):
                reason = "length"
            if reason is not None:
                self._end(seq, reason)
            elif out.has_text:
                self._deliver(seq)
        self._apply_pending_aborts()

    def _record(self, batch: Batch, t0: float, t1: float, real: int, padded: int) -> None:
        plan = batch.plan
        nd = batch.num_decode
        prefilled = tuple((c.seq_id, len(c.token_ids)) for c in plan.chunks[nd:])
        self.step_records.append(StepRecord(
            index=self._steps, started_at=t0, ended_at=t1,
            decoded=tuple(c.seq_id for c in plan.chunks[:nd]), prefilled=prefilled,
            real_tokens=real, padded_tokens=padded, copies=len(plan.copies),
            preempted=tuple(batch.preempted)))
        self._steps += 1
        self._busy_s += t1 - t0
        self._real_tokens += real
        self._padded_tokens += padded
        self._prompt_tokens += sum(n for _, n in prefilled)

    def _step_failed(self, batch: Batch, exc: Exception, t0: float) -> None:
        t1 = self.clock()
        self._failures += 1
        message = f"model step failed: {type(exc).__name__}: {exc}"
        self.step_records.append(StepRecord(
            index=self._steps, started_at=t0, ended_at=t1,
            decoded=tuple(c.seq_id for c in batch.plan.chunks[:batch.num_decode]),
            prefilled=tuple((c.seq_id, len(c.token_ids))
                            for c in batch.plan.chunks[batch.num_decode:]),
            real_tokens=0, padded_tokens=0, copies=len(batch.plan.copies),
            preempted=tuple(batch.preempted), error=message))
        self._steps += 1
        self._busy_s += t1 - t0
        for seq in (*batch.seqs, *batch.copied):
            if seq.phase is not Phase.DONE:
                self._end(seq, "error", ErrorEvent(message=message))
        if self._failures >= self.max_consecutive_failures:
            self._alive = False
            self._fail_all(f"engine {self.name!r} is dead after {self._failures} failed "
                           f"steps; last: {message}")

    # -- ending requests ---------------------------------------------------------------
    def _end(self, seq: Sequence, reason: str, error: ErrorEvent | None = None) -> None:
        """Finish a request: pages back to the pool now, final event queued for delivery."""
        self.scheduler.finish(seq)
        now = self.clock()
        seq.finished_at = now
        seq.finish_reason = reason
        self._seqs.pop(seq.request_id, None)
        self._free_ids.append(seq.seq_id)
        out = seq.output
        if error is None:
            # At "length" the text held back for a possible stop string goes out after
            # all (unless the decoder's last bytes complete one: then it is a stop).
            if reason == "length" and out.close():
                reason = seq.finish_reason = "stop"
            if reason in ("stop", "length"):
                self._finish_times.append(now)
            out.final = FinishEvent(
                finish_reason=reason,
                prompt_tokens=seq.num_prompt_tokens,
                completion_tokens=seq.num_generated,
                cached_tokens=seq.num_cached_tokens,
                ttft_s=None if seq.first_token_at is None else seq.first_token_at - seq.arrived_at,
                queue_s=None if seq.admitted_at is None else seq.admitted_at - seq.arrived_at,
                e2e_s=now - seq.arrived_at,
            )
        else:
            out.final = error
        if seq.aborted:
            # Nobody is listening (or will be soon): say goodbye once, never hold state.
            self._deliver(seq)
            if seq.output.final is not None:
                self._drop(seq)
        else:
            self._deliver(seq)

    def _fail_all(self, message: str) -> None:
        for seq in list(self._seqs.values()):
            self._end(seq, "error", ErrorEvent(message=message))
        for seq in list(self._undelivered.values()):
            self._drop(seq)  # the loop that would retry is gone

    def _shed_expired(self) -> None:
        for seq in self.scheduler.waiting.expired(self.clock()):
            self._reject_count("shed")
            waited = self.clock() - seq.arrived_at
            self._end(seq, "shed", ErrorEvent(
                message=f"request waited {waited:.1f}s in the queue, past its deadline",
                kind="shed", retry_after_s=self._retry_after()))

    def _apply_pending_aborts(self) -> None:
        if self._pending_aborts:
            pending, self._pending_aborts = self._pending_aborts, []
            for seq in pending:
                if seq.phase is not Phase.DONE:
                    self._end(seq, "abort")

    # -- delivery ----------------------------------------------------------------------
    def _deliver(self, seq: Sequence) -> None:
        """Send what is pending without blocking; leftovers wait in the OutputStream."""
        out = seq.output
        ch = out.channel
        try:
            if out.has_tokens:
                ch.send_nowait(out.token_event())
                out.sent()
            if out.final is not None:
                ch.send_nowait(out.final)
                out.final = None
                ch.close()
        except trio.WouldBlock:
            self._undelivered[id(seq)] = seq
            return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The receiver is gone: the client left without (yet) calling abort.
            self._drop(seq)
            if seq.phase is not Phase.DONE:
                self._abort_seq(seq)
            return
        self._undelivered.pop(id(seq), None)

    def _deliver_pending(self) -> None:
        for seq in list(self._undelivered.values()):
            if seq.aborted and seq.phase is Phase.DONE:
                self._drop(seq)
            else:
                self._deliver(seq)

    def _drop(self, seq: Sequence) -> None:
        self._undelivered.pop(id(seq), None)
        out = seq.output
        out.sent()
        out.final = None
        out.channel.close()

    # -- helpers -------------------------------------------------------------------------
    def _validate(self, req: GenerateRequest) -> None:
        n = len(req.prompt_ids)
        if n == 0:
            raise ValueError("prompt is empty")
        if req.max_tokens < 1:
            raise ValueError(f"max_tokens={req.max_tokens} must be >= 1")
        limit = self.runner.max_context
        if n + req.max_tokens > limit:
            self._reject_count("too_long")
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({req.max_tokens}) exceeds "
                             f"the context limit of {limit} tokens")
        pages = self.scheduler.pages
        if pages.pages_for(n + req.max_tokens) > pages.num_usable:
            self._reject_count("too_long")
            raise ValueError(f"prompt + max_tokens ({n + req.max_tokens} tokens) does not fit "
                             f"in this replica's KV cache ({pages.num_usable} pages of "
                             f"{pages.page_size})")

    def _new_seq_id(self) -> int:
        if self._free_ids:
            return self._free_ids.pop()
        self._next_id += 1
        return self._next_id - 1

    def _completion_rate(self) -> float | None:
        """Requests finished per second over the last minute; None with too few."""
        now = self.clock()
        times = self._finish_times
        while times and now - times[0] > 60.0:
            times.popleft()
        if len(times) < 2 or now <= times[0]:
            return None
        return len(times) / (now - times[0])

    def _retry_after(self) -> float:
        """Seconds until the queue has likely drained: waiting requests over the recent
        completion rate (1 s when nothing finished recently), clamped to [0.1, 60]."""
        rate = self._completion_rate()
        if rate is None:
            return 1.0
        return min(60.0, max(0.1, (self.scheduler.num_waiting + 1) / rate))

    def _expected_wait(self) -> float | None:
        """Seconds before a new request would likely start its prefill, counting the
        work ahead of it: requests waiting beyond the free running slots (over the recent
        completion rate), the prompt tokens waiting ahead of it (discounted by the
        prefix-cache hit rate) at the measured cost of a prefill token, and what is left
        of the step in flight. Prompts already running are not ahead of it: their chunks
        share steps with newcomers (a 6,000-token prefill in progress does not delay a
        short question's admission). None when there is no estimate yet (the count bound
        still applies)."""
        sched = self.scheduler
        wait: float | None = None
        ahead = sched.num_waiting + 1 - max(0, sched.max_running - sched.num_running)
        if ahead <= 0:
            wait = 0.0
        elif (rate := self._completion_rate()) is not None:
            wait = ahead / rate
        if sched.cost.prefill_token_s:
            wait = (wait or 0.0) + self._prefill_estimate(sched.waiting.num_tokens)
        if wait is not None and wait > 0.0 and self._in_step:
            wait += max(0.0, self._step_ends_at - self.clock())  # the step in flight
        return wait

    def _admit_by_ttft(self, prompt_tokens: int) -> None:
        """Refuse at the door (429 in microseconds, so the client can go elsewhere) a
        request whose first token would likely come later than `ttft_target_s`: the
        expected wait for the work ahead of it, plus its own step (its prompt, less the
        cache's recent hit rate, at the measured cost of a prefill token, beside the
        running decodes at their measured step time). A prompt too long to meet the
        target even alone is judged on the wait alone: it is served when the replica has
        room, however long its prefill takes."""
        target = self.config.ttft_target_s
        if target <= 0:
            return  # admission by predicted TTFT is off
        wait = self._expected_wait()
        if wait is None or wait <= 0.0:
            return
        # Its own step: its prompt (cache-discounted) beside the running decodes.
        own = (self._prefill_estimate(prompt_tokens)
               + self.scheduler.cost.estimate(self.scheduler.num_running, 0))
        ttft = wait + own if own <= target else wait
        if ttft > target:
            raise self._reject("queue_wait", wait, f"expected time to first token "
                                                   f"{ttft:.1f}s exceeds {target:g}s "
                                                   f"(queue wait {wait:.1f}s); retry later")

    def _prefill_estimate(self, tokens: float) -> float:
        """Seconds to prefill `tokens` prompt tokens, discounted by the prefix cache's
        hit rate so far, at the measured per-token cost (0 before any is measured)."""
        per_token = self.scheduler.cost.prefill_token_s
        if not per_token:
            return 0.0
        pages = self.scheduler.pages
        miss = 1.0 - pages.hit_tokens / pages.query_tokens if pages.query_tokens else 1.0
        return tokens * miss * per_token

    def _reject(self, reason: str, retry_after_s: float, message: str = "") -> Overloaded:
        self._reject_count(reason)
        return Overloaded(reason, retry_after_s, message)

    def _reject_count(self, reason: str) -> None:
        self._rejections[reason] = self._rejections.get(reason, 0) + 1
