"""The door of one replica: may a request join the waiting queue now, and if not, when
should the client retry?

`Engine.submit` asks `Admission.check` before queueing. In order:

1. can this replica ever serve it: a prompt, at least one token to generate, prompt +
   max_tokens within the context and the KV pool (ValueError; "too_long" is counted);
2. the queue's bounds: `max_waiting` requests and `max_waiting_tokens` tokens
   (Overloaded "queue_full" / "queue_tokens");
3. for interactive requests only (batch jobs wait for idle capacity instead), the
   predicted time to first token against `ttft_target_s` (Overloaded "ttft_target", or
   "itl_target" when the wait is for a running slot only the ITL target holds back):
   refusing in microseconds lets the client go elsewhere, where queueing it would only
   serve it late.

The prediction is built from what the scheduler has measured, read through the narrow
`SchedulerQueries` API (`policy.Scheduler` implements it): the running and waiting counts,
the prompt tokens waiting that are not expected to hit the prefix cache (each judged
when it was queued: the cache then, and the prompts queued or running ahead of it, so
the first burst after start, which all carries one system prompt, counts it once), and
the step-cost model's estimates.
The engine passes when the step in flight is expected to end. The only state kept here
is what the engine reports: when requests completed (for the completion rate behind
Retry-After), and the refusal counts `EngineStats.rejections` shows.

Pure Python and clock-agnostic (the engine passes its clock), so tests drive it with a
fake clock and a fake scheduler. (Not to be confused with the policy's admission of a
queued sequence into the running batch when its pages fit: that comes later, per step.)
(About 500 lines: the door's rules, the estimates they read, its Retry-After book and
its calibration are one argument.)
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from typing import Callable, Protocol

from config.settings import SchedulerConfig

from .api import GenerateRequest, Overloaded

_RATE_WINDOW_S = 60.0  # completions older than this do not count toward the rate
# What an answer is expected to cost before any has finished here: "a few hundred tokens"
# (the completed ones' running average replaces it).
_PRIOR_OUTPUT_TOKENS = 256.0
_MAX_RETRY_S = 60.0
_SLOTS_KEPT_S = 0.05  # `_next_free_slot` reuses its heap this long at most
# The door's calibration of its own TTFT predictions (`ttft_factor`): the recent admitted
# requests' measured / predicted TTFT, at this quantile, once there are enough of them;
# predictions under this share of the target are not counted (a fixed cost, HTTP and
# delivery, would make their ratios large and say nothing about a TTFT near the target).
_TTFT_SAMPLES = 64
_TTFT_MIN_SAMPLES = 16
_TTFT_QUANTILE = 0.9
_TTFT_MIN_SHARE = 0.25
_TTFT_MAX_FACTOR = 1.5


class SchedulerQueries(Protocol):
    """All that admission reads of the scheduler."""

    max_running: int

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def waiting_tokens(self) -> int: ...
    # ... of which batch jobs', which give way to interactive requests
    @property
    def batch_running(self) -> int: ...
    @property
    def batch_waiting(self) -> int: ...
    @property
    def batch_waiting_tokens(self) -> int: ...

    @property
    def prefill_token_s(self) -> float | None: ...

    @property
    def prefix_hit_rate(self) -> float: ...

    # Prompt tokens the waiting interactive requests will compute (cache hits excluded),
    # and those running prompts still have to compute ahead of a newcomer's (ITL target).
    @property
    def waiting_uncached_tokens(self) -> int: ...

    @property
    def prefill_backlog(self) -> int: ...

    def step_estimate(self, num_decode: int, prefill_tokens: int) -> float: ...

    # Sequences that may run at once now (`max_running`, or fewer under an ITL target),
    # and how long a prompt's uncached tokens take to prefill.
    @property
    def running_capacity(self) -> int: ...

    def prefill_seconds(self, tokens: float) -> float: ...

    # ... and a short prompt's (at most `short_prefill_tokens`), at what questions cost.
    def question_seconds(self, tokens: float) -> float: ...

    def kv_capacity(self) -> tuple[int, int]: ...

    # Tokens each running interactive answer is expected still to generate, shortest first.

    def answers_left(self, answer_tokens: float) -> list[float]: ...


class Admission:
    """One replica's door; the engine owns one and tells it what it needs to know."""

    def __init__(self, scheduler: SchedulerQueries, config: SchedulerConfig,
                 clock: Callable[[], float], *, max_context: int) -> None:
        self.scheduler = scheduler
        self.config = config
        self.clock = clock
        self.max_context = max_context  # the runner's: prompt + generated tokens
        self.finish_times: deque[float] = deque(maxlen=256)  # completions, for the rate
        self.rejections: dict[str, int] = {}  # refusals by reason (Overloaded.reason, "shed")
        self.output_tokens = _PRIOR_OUTPUT_TOKENS  # running average of completed answers
        self._last_promise = -float("inf")  # the latest time a refused client was told
        # Refused clients told to come back later: (when, answer tokens expected), in the
        # order told; each will take a running slot then (`_next_free_slot`).
        self._promises: deque[tuple[float, float]] = deque()
        # `_next_free_slot`'s heap, kept while the replica's state and the promises told
        # stay as they were: (state, when built, heap, promises in it).
        self._slots: tuple[tuple, float, list[float], int] | None = None
        self._answer_hint: int | None = None  # see `service_rate`
        self._ttft_ratios: deque[float] = deque(maxlen=_TTFT_SAMPLES)  # see `ttft_factor`

    # -- what the engine reports -------------------------------------------------------
    def completed(self, at: float, output_tokens: int | None = None) -> None:
        """A request finished normally (stop or length); aborts and errors say nothing
        about how fast the replica serves."""
        self.finish_times.append(at)
        if output_tokens:
            self.output_tokens += 0.1 * (output_tokens - self.output_tokens)

    def first_token(self, measured_s: float, predicted_s: float | None) -> None:
        """An admitted interactive request's first token came `measured_s` after it was
        submitted; the door had predicted `predicted_s` (None: no prediction)."""
        target = self.config.ttft_target_s
        if predicted_s is None or target <= 0 or predicted_s < _TTFT_MIN_SHARE * target:
            return
        self._ttft_ratios.append(measured_s / predicted_s)

    def ttft_factor(self) -> float:
        """How much later than predicted first tokens come: the recent measured /
        predicted TTFT at its 90th percentile, within [1, 1.5]; until 16 are known,
        `ttft_factor_uncalibrated` (1.5).
        The door judges a newcomer's TTFT at its prediction times this, so that the
        admitted meet the target at the p95, not the p50 (a step-time prediction right
        at the median is late one step in ten, and a TTFT spans several steps). A fresh
        server's predictions rest on warm-up figures (dummy contexts, a cold cache) and
        came ~2x early in a first burst (docs/benchmarks.md, "The defaults"): until its
        first tokens show how late they come, the door assumes the latest it allows."""
        ratios = self._ttft_ratios
        if len(ratios) < _TTFT_MIN_SAMPLES:
            return max(1.0, self.config.ttft_factor_uncalibrated)
        ranked = sorted(ratios)
        q = ranked[min(len(ranked) - 1, int(_TTFT_QUANTILE * len(ranked)))]
        return min(_TTFT_MAX_FACTOR, max(1.0, q))

    def count(self, reason: str) -> None:
        """Count a refusal: at the door, a request too long to ever fit, or a shed one."""
        self.rejections[reason] = self.rejections.get(reason, 0) + 1

    def refuse(self, reason: str, retry_after_s: float, message: str = "") -> Overloaded:
        """The exception to raise for a refusal (counted)."""
        self.count(reason)
        return Overloaded(reason, retry_after_s, message)

    # -- the door ----------------------------------------------------------------------
    def check(self, req: GenerateRequest, *, step_ends_at: float | None = None,
              uncached: int | None = None, prefix_wait: int = 0) -> float | None:
        """Raise ValueError for a request this replica can never serve, `Overloaded` for
        one it should not queue now; return to let it in, with its predicted time to
        first token (None: none, or a batch job; the engine reports the measured one to
        `first_token`). `step_ends_at`: when the step in flight is expected to end (None:
        no step in flight); `uncached`: the prompt tokens it would compute (None: judged
        from the cache's hit rate so far); `prefix_wait`: prompt tokens a running prefill
        must compute before the prefix this request shares with it is cached (it waits
        for them)."""
        self.validate(req)
        sched, cfg = self.scheduler, self.config
        prompt_tokens = len(req.prompt_ids)
        waiting, tokens = sched.num_waiting, sched.waiting_tokens
        if not req.batch:  # batch jobs waiting give way: they do not fill the queue
            waiting -= sched.batch_waiting
            tokens -= sched.batch_waiting_tokens
        if waiting >= cfg.max_waiting:
            raise self.refuse("queue_full", self.ticket(self.retry_after()))
        if tokens + prompt_tokens > cfg.max_waiting_tokens:
            raise self.refuse("queue_tokens", self.ticket(self.retry_after()))
        if req.batch:
            return None
        # Before any completion, an answer is expected to cost no more than this one's
        # max_tokens (a burst of similar requests), nor more than the prior.
        self._answer_hint = req.max_tokens
        try:
            return self.check_ttft(prompt_tokens, step_ends_at=step_ends_at,
                                   uncached=uncached, prefix_wait=prefix_wait)
        finally:
            self._answer_hint = None

    def precheck(self, *, step_ends_at: float | None = None, pending: int = 0,
                 max_tokens: int | None = None) -> None:
        """Raise `Overloaded` if an interactive request of one token would be refused now
        (the queue is full, or the wait alone misses the TTFT target): the server can
        answer 429 before tokenizing or templating anything. `pending`: requests past
        this check and not yet submitted (still being tokenized), which will be ahead;
        `max_tokens`: the body's (None: none given, so the context left, which the
        prior's answer length bounds), judged as the door proper will judge it, so the
        precheck never refuses what the door would admit."""
        sched, cfg = self.scheduler, self.config
        if sched.num_waiting - sched.batch_waiting + pending >= cfg.max_waiting:
            raise self.refuse("queue_full", self.ticket(self.retry_after()))
        if self._slots_ahead() + pending <= 0:
            # Nobody waits for a running slot: what is ahead is prompts' prefill, and
            # whether this one shares a prefix being computed (which the door admits
            # behind it) is known only from its prompt. The door judges.
            return
        self._answer_hint = max_tokens
        try:
            self.check_ttft(1, step_ends_at=step_ends_at, pending=pending)
        finally:
            self._answer_hint = None

    def validate(self, req: GenerateRequest) -> None:
        """Raise ValueError unless the request could be served here, however idle."""
        n = len(req.prompt_ids)
        if n == 0:
            raise ValueError("prompt is empty")
        if req.max_tokens < 1:
            raise ValueError(f"max_tokens={req.max_tokens} must be >= 1")
        limit = self.max_context
        if n + req.max_tokens > limit:
            self.count("too_long")
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({req.max_tokens}) exceeds "
                             f"the context limit of {limit} tokens")
        num_pages, page_size = self.scheduler.kv_capacity()
        if n + req.max_tokens > num_pages * page_size:  # more pages than the pool has
            self.count("too_long")
            raise ValueError(f"prompt + max_tokens ({n + req.max_tokens} tokens) does not fit "
                             f"in this replica's KV cache ({num_pages} pages of {page_size})")

    def check_ttft(self, prompt_tokens: int, *, step_ends_at: float | None = None,
                   pending: int = 0, uncached: int | None = None,
                   prefix_wait: int = 0) -> float | None:
        """Refuse a request whose first token would likely come later than
        `ttft_target_s`: the expected wait for the work ahead of it, plus its own step
        (its prompt's tokens not expected to hit the cache, at the measured cost of a prefill
        token, beside the running decodes at their measured step time). A prompt too long
        to meet the target even alone is judged on the wait alone: it is served when the
        replica has room, however long its prefill takes. Retry-After is the wait.

        A prompt whose prefix a running prefill is still computing (`prefix_wait` tokens
        to go) cannot start before that prefix is in, and is judged on the target like
        any other: the followers of a new system prompt are refused (Retry-After: when
        the prefix is expected in) until it is cached, then admitted, so that every
        admitted request of a first burst is expected within the target. With
        `queue_prefix_followers` (for clients that count a refusal as an error,
        GuideLLM's) it is admitted whenever its first token comes here no later than on
        an idle replica without the prefix cached (which would compute the whole
        prompt): nowhere would it be served sooner.

        The prediction is judged times `ttft_factor` (how late first tokens have come
        against their predictions), and returned: None when there is none yet."""
        target = self.config.ttft_target_s
        if target <= 0:
            return None  # admission by predicted TTFT is off
        wait = self.expected_wait(step_ends_at=step_ends_at, pending=pending)
        if wait is None:
            return None
        sched = self.scheduler
        # Without its own count, the prompt is discounted by the cache's hit rate so far.
        tokens = (prompt_tokens * (1.0 - sched.prefix_hit_rate) if uncached is None
                  else uncached)
        if not sched.prefill_token_s:
            prefill = 0.0
        elif tokens <= self.config.short_prefill_tokens:
            prefill = sched.question_seconds(tokens)  # a question: at what questions cost
        else:
            prefill = sched.prefill_seconds(tokens)
        step = sched.step_estimate(sched.num_running - sched.batch_running, 0)
        own = prefill + step
        # What is left of the steps in flight comes first, whatever is queued (the
        # expected wait counts it only when something is; a prompt's big chunks in
        # flight made first tokens predicted at 0.15-0.19 s come at 1.1-1.3 s). Judged
        # once prefill costs are measured, as the rest of the prediction is.
        in_flight = (0.0 if step_ends_at is None or not sched.prefill_token_s
                     else max(0.0, step_ends_at - self.clock()))
        follower = bool(prefix_wait and sched.prefill_token_s)
        if follower:
            # It cannot start before the prefix it shares with a running prefill is in:
            # the steps in flight first (their chunks no longer count in `prefix_wait`).
            ttft = max(wait, in_flight + sched.prefill_seconds(prefix_wait)) + own
            alone = sched.prefill_seconds(prompt_tokens) + step
            if ttft <= alone and self.config.queue_prefix_followers:
                return ttft
        elif wait <= 0.0:
            # Nothing queued ahead: admitted (nowhere would it start sooner), predicted
            # after the steps in flight. (Refusing it when those steps made it late
            # refused the short questions through a 6,000-token prefill in half the
            # runs, whose one-query-block chunks at a long context make steps of ~0.3 s,
            # while they came within 0.45 s; a first burst gained little from it.)
            return own + in_flight
        else:
            # Too long to meet the target even on an idle replica (at the full prefill
            # speed, not the chunks an ITL target leaves it): judged on the queue's wait
            # alone (it misses the target wherever it goes).
            idle = tokens * (sched.prefill_token_s or 0.0) + step
            ttft = max(wait, in_flight) + own if idle <= target else wait
        # A follower is judged on the target itself, whatever the slack: what is ahead of
        # it is one prompt's prefill in progress, not a bunch about to share steps.
        limit = target if follower else self._limit(target, pending)
        if ttft * self.ttft_factor() > limit:
            retry = self.ticket(self._drain_time(ttft - target, pending))
            # "itl_target": the wait is for a running slot while the ITL target holds the
            # running set below `max_running`.
            cap = sched.running_capacity
            itl = cap < sched.max_running and self._slots_ahead() + pending > 0
            raise self.refuse("itl_target" if itl else "ttft_target", retry,
                              f"expected time to first token {ttft:.1f}s exceeds {target:g}s "
                              f"(queue wait {wait:.1f}s"
                              + (f"; {cap} streams at once keep the ITL target" if itl else "")
                              + f"); retry in {retry:.1f}s")
        return ttft

    def _limit(self, target: float, pending: int) -> float:
        """The TTFT a refusal needs: the target while requests wait for a running slot
        (overload: refusing protects those admitted) and under an ITL target; with slots
        free, `ttft_slack` times it. Then what is ahead is prompts
        that arrived together, all about to be prefilled: a refused client that comes
        back finds the same work ahead (its first token, counted from its first try, only
        comes later), and one that does not retry (GuideLLM) fails. Only a real prefill
        backlog is worth refusing."""
        if self._slots_ahead() + pending > 0 or self.config.strict_itl_s > 0:
            # (Under an ITL target a prompt's prefill gets only the room a step leaves
            # beside the decodes, whatever arrived with it: the slack's case does not arise.)
            return target
        return target * max(1.0, self.config.ttft_slack)

    # -- the estimates -----------------------------------------------------------------
    def expected_wait(self, *, step_ends_at: float | None = None,
                      pending: int = 0) -> float | None:
        """Seconds before a new request would likely start its prefill, counting the
        work ahead of it: requests waiting beyond the free running slots (over the recent
        completion rate), the prompt tokens waiting ahead of it that will not hit the
        prefix cache at the measured cost of a prefill token, and what is left of the step in
        flight (expected to end at `step_ends_at`). Prompts already running are not ahead
        of it: their chunks share steps with newcomers (a 6,000-token prefill in progress
        does not delay a short question's admission), unless an ITL target leaves each
        step only a little room for prompts (`prefill_backlog`); nor are batch jobs (they
        give way).
        None when there is no estimate yet (the count bound still applies)."""
        sched = self.scheduler
        ahead = self._slots_ahead() + pending
        wait = 0.0 if ahead <= 0 else self._slot_wait(ahead)
        if sched.prefill_token_s:
            # (the running prompts ahead are short ones: at what questions cost)
            wait = (wait or 0.0) + sched.prefill_seconds(sched.waiting_uncached_tokens) + (
                sched.question_seconds(sched.prefill_backlog))
        if wait is not None and wait > 0.0 and step_ends_at is not None:
            wait += max(0.0, step_ends_at - self.clock())  # the step in flight
        return wait

    def _slot_wait(self, ahead: int) -> float | None:
        """Seconds until `ahead` more running slots are free: the later of two estimates.
        The completion rate's (`ahead / service_rate`) holds in a steady state, answers
        ending at staggered times; the running answers' own ends (what each has left of
        an average answer, within its max_tokens, at the decode step's time) hold after a
        burst, whose answers started together and end together: there the first slot
        frees after a whole answer, not after 1/rate (a first burst's 17th request was
        admitted on a 0.5 s prediction and waited 6.5 s for a slot). None: neither known."""
        sched = self.scheduler
        rate = self.service_rate()
        flow = None if rate is None else ahead / rate
        left = sched.answers_left(self.output_tokens)
        step = sched.step_estimate(sched.running_capacity, 0)
        if not left or step <= 0:
            return flow
        ends = left[min(ahead, len(left)) - 1] * step
        if ahead > len(left) and rate:  # past one round of the running answers
            ends += (ahead - len(left)) / rate
        return ends if flow is None else max(flow, ends)

    def _slots_ahead(self) -> int:
        """Interactive requests that must finish before a newcomer gets a running slot
        (as many as may run now: `max_running`, or fewer under an ITL target)."""
        sched = self.scheduler
        running = sched.num_running - sched.batch_running
        return (sched.num_waiting - sched.batch_waiting + 1
                - max(0, sched.running_capacity - running))

    def _drain_time(self, excess_s: float, pending: int = 0) -> float:
        """Seconds until `excess_s` of the predicted wait is gone: prefill work ahead drains
        as it runs, but a wait for a running slot shrinks only when a request completes,
        so that part is rounded up to whole completions at the service rate."""
        rate = self.service_rate()
        if self._slots_ahead() + pending > 0 and rate:
            return max(excess_s, math.ceil(excess_s * rate - 1e-9) / rate)
        return excess_s

    def completion_rate(self) -> float | None:
        """Requests completed per second over the last minute; None with too few."""
        now = self.clock()
        times = self.finish_times
        while times and now - times[0] > _RATE_WINDOW_S:
            times.popleft()
        if len(times) < 2 or now <= times[0]:
            return None
        return len(times) / (now - times[0])

    def service_rate(self) -> float | None:
        """Requests this replica completes per second: measured over the last minute,
        else predicted from the step costs (warm-up measures every shape): as many answers
        as may run at once (`running_capacity`), of the average length (at most the
        request's max_tokens), decoding at that batch's step time. None when neither is
        known (the queue bounds still apply)."""
        rate = self.completion_rate()
        if rate is not None:
            return rate
        sched = self.scheduler
        cap = sched.running_capacity
        step = sched.step_estimate(cap, 0)
        if step <= 0:
            return None
        return cap / (self._answer() * step)

    def retry_after(self) -> float:
        """Seconds until the queue has likely drained: waiting requests over the service
        rate (1 s when it is not known), clamped to [0.1, 60]."""
        rate = self.service_rate()
        if rate is None:
            return 1.0
        sched = self.scheduler
        return min(_MAX_RETRY_S, max(0.1, (sched.num_waiting - sched.batch_waiting + 1) / rate))

    def ticket(self, wait_s: float) -> float:
        """The Retry-After for one refused client: no sooner than `wait_s`, one service
        interval after the client refused before it, and no sooner than a running slot
        is expected free for it, the clients told to come back before it each taking
        one (`_next_free_slot`). A burst told to come back does not come back as one
        burst (and get refused again): a client that honours the answer finds room on
        its first retry, as far as the prediction holds. At most 60 s."""
        now = self.clock()
        rate = self.service_rate()
        at = now + max(0.1, wait_s)
        if rate:
            at = max(at, self._last_promise + 1.0 / rate)
        slot = self._next_free_slot(now)
        if slot is not None:
            at = max(at, slot)
        at = min(at, now + _MAX_RETRY_S)
        self._last_promise = at
        self._promises.append((at, self._answer()))
        return at - now

    def _answer(self) -> float:
        """Tokens the request at the door is expected to generate: the completed answers'
        average, within its max_tokens when known."""
        hint = self._answer_hint
        return self.output_tokens if hint is None else min(self.output_tokens, hint)

    def _next_free_slot(self, now: float) -> float | None:
        """When a running slot is expected free for one more client: the free slots now,
        then each running answer's expected end (what it has left at the decode step's
        time), taken in turn by the requests waiting and by the clients told to come back
        that are not back yet, each holding its slot for its own answer. Why: a first
        burst's refused clients were told to come back one completion interval apart
        (1/rate), which in a burst admitted together lands them while every slot is
        still taken: refused again, and again. None: no step time known."""
        promises = self._promises
        while promises and promises[0][0] <= now:  # due: back by now, or gone
            promises.popleft()
            self._slots = None
        sched = self.scheduler
        cap = sched.running_capacity
        step = sched.step_estimate(cap, 0)
        if step <= 0:
            return None
        running = sched.num_running - sched.batch_running
        waiting = sched.num_waiting - sched.batch_waiting
        lefts = tuple(sched.answers_left(self.output_tokens))
        state = (cap, running, waiting, step, self.output_tokens, lefts)
        kept = self._slots
        if kept is not None and kept[0] == state and now - kept[1] <= _SLOTS_KEPT_S:
            # The same replica state as a moment ago (a flood's refusals between two
            # steps): only the promises told since go into the heap, not all of them
            # again for every refusal.
            _, built, slots, applied = kept
        else:
            built, applied = now, 0
            slots = [now] * max(0, cap - running) + [now + left * step for left in lefts]
            if not slots:
                return None
            heapq.heapify(slots)
            answer = self.output_tokens * step
            for _ in range(waiting):
                heapq.heapreplace(slots, slots[0] + answer)
        for at, tokens in itertools.islice(promises, applied, None):
            heapq.heapreplace(slots, max(slots[0], at) + tokens * step)
        self._slots = (state, built, slots, len(promises))
        return slots[0]
