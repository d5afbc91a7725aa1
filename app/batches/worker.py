"""Runs stored batches through the engines, in idle capacity and by their deadlines.

One trio task (`BatchWorker.run`) ticks a few times a second:

- picks up batches (`validating` -> `in_progress`), including those a previous process
  left unfinished: requests still `pending` in the store run (again);
- hands each batch's pending requests to the engines, earliest deadline first, at most
  `max_in_flight` per replica at once. They enter the engine's background class
  (`GenerateRequest.batch`): admitted only in idle capacity, first to be preempted
  (scheduler/background.py);
- records each result in the store the moment it ends (exactly once: `Store.record`);
  a refused request (429/503) stays pending and is tried again;
- watches each batch's pace (`Pace`): when its remaining requests no longer fit its
  window at the measured completion rate, it is raised one level: 1 runs its requests in
  the interactive class behind every interactive request, with half its slots, 2 at its
  tenant's priority (what it had in the engines is withdrawn and handed out again at the
  new level);
- ends batches: `completed` when nothing is pending, `expired` past the window (finished
  results kept), `cancelled` after a cancel; output and error files are written then.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import trio

from config.settings import BatchConfig

from ..completions import BatchRun, admit_parsed, parse
from ..errors import APIError
from ..state import Phase, ServerState
from ..streaming import collect
from .lines import ENDPOINTS
from .store import AsyncStore

log = logging.getLogger("sluice.batches")
TICK_S = 0.2
RETRY_S = 1.0  # a refused request waits this long before its next try
LEVELS = (BatchRun(background=True), BatchRun(background=False, priority=1_000),
          BatchRun(background=False))
# Share of the batch slots (`max_in_flight` per replica) a batch may fill at each level:
# raised into the interactive class, where nothing preempts it, it leaves half of them
# free at level 1 so that interactive requests keep room to start.
LEVEL_SHARE = (1.0, 0.5, 1.0)


@dataclass
class Pace:
    """A batch's completion rate and the level it runs at. Pure; `now` is passed in."""

    created: float
    expires: float
    level: int = 0
    raised_at: float = 0.0
    done_at: deque = field(default_factory=lambda: deque(maxlen=512))
    window_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.window_s = self.expires - self.created
        self.raised_at = self.created

    def done(self, now: float) -> None:
        self.done_at.append(now)

    def rate(self, now: float) -> float | None:
        """Requests completed per second over the last tenth of the window (at least a
        minute), and only since the last raise: the pace at the level it runs at now."""
        since = max(now - max(60.0, 0.1 * self.window_s), self.raised_at)
        recent = [t for t in self.done_at if t >= since]
        if len(recent) < 2:
            return None
        return len(recent) / max(now - since, 1e-9)

    def eta(self, now: float, remaining: int) -> float | None:
        rate = self.rate(now)
        return None if rate is None else now + remaining / rate

    def at_risk(self, now: float, remaining: int) -> bool:
        """Would the remaining requests miss the window (with a 10% margin) at this pace?
        With no pace measured at this level yet: once a tenth of the window has passed
        without one (a fifth before the first raise)."""
        if remaining <= 0:
            return False
        eta = self.eta(now, remaining)
        if eta is None:
            return now - self.raised_at > (0.1 if self.level else 0.2) * self.window_s
        return eta > self.expires - 0.1 * self.window_s

    def update(self, now: float, remaining: int) -> int:
        """Raise one level when at risk, at most once per twentieth of the window."""
        if (self.level < len(LEVELS) - 1 and self.at_risk(now, remaining)
                and now - self.raised_at >= max(1.0, 0.05 * self.window_s)):
            self.level += 1
            self.raised_at = now
            log.info("batch raised to level %d (%d requests left)", self.level, remaining)
        return self.level


@dataclass
class _Active:
    row: dict
    pace: Pace
    queue: deque = field(default_factory=deque)  # pending rows not yet handed out
    cursor: int = -1  # last idx fetched from the store
    exhausted: bool = False  # the store has no pending rows past the cursor
    in_flight: dict[int, trio.CancelScope] = field(default_factory=dict)
    retry: list[tuple[float, dict]] = field(default_factory=list)  # (not before, row)

    @property
    def id(self) -> str:
        return self.row["id"]


class BatchWorker:
    def __init__(self, state: ServerState, store: AsyncStore, config: BatchConfig,
                 clock: Callable[[], float] = time.time) -> None:
        self.state, self.store, self.config, self.clock = state, store, config, clock
        self.active: dict[str, _Active] = {}
        self.wake = trio.Event()
        self.tokens_total = 0  # generated by batch requests since start
        self.completed_total = 0
        self.failed_total = 0

    def poke(self) -> None:
        """Something changed (a new batch, a cancel): look now."""
        self.wake.set()

    # -- what /metrics and GET /v1/batches/{id} read ----------------------------------
    def stats(self) -> dict[str, Any]:
        now = self.clock()
        pending = running = at_risk = 0
        oldest = 0.0
        for a in self.active.values():
            left = a.row["total"] - a.row["completed"] - a.row["failed"]
            running += len(a.in_flight)
            pending += max(0, left - len(a.in_flight))
            if left:
                oldest = max(oldest, now - a.row["created_at"])
            at_risk += a.pace.at_risk(now, left)
        return {"pending": pending, "running": running, "completed": self.completed_total,
                "failed": self.failed_total, "tokens": self.tokens_total,
                "oldest_pending_age_s": oldest, "at_risk": at_risk,
                "active": len(self.active)}

    def progress(self, batch_id: str) -> dict[str, Any] | None:
        a = self.active.get(batch_id)
        if a is None:
            return None
        left = a.row["total"] - a.row["completed"] - a.row["failed"]
        eta = a.pace.eta(self.clock(), left)
        return {"running": len(a.in_flight), "priority_level": a.pace.level,
                "estimated_completion_at": None if eta is None else int(eta),
                "at_risk": a.pace.at_risk(self.clock(), left)}

    def progress_all(self) -> list[dict[str, Any]]:
        """Every unfinished batch's progress, soonest deadline first (GET /v1/stats)."""
        now = self.clock()  # wall time, as the store's timestamps
        out = []
        for a in sorted(self.active.values(), key=lambda a: (a.row["expires_at"], a.id)):
            r = a.row
            left = r["total"] - r["completed"] - r["failed"]
            out.append({"id": a.id, "tenant": r["tenant"], "total": r["total"],
                        "completed": r["completed"], "failed": r["failed"],
                        "running": len(a.in_flight), "priority_level": a.pace.level,
                        "at_risk": bool(a.pace.at_risk(now, left)),
                        "expires_in_s": round(max(0.0, r["expires_at"] - now), 1)})
        return out

    # -- the loop ------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                if self.state.phase is Phase.READY:
                    await self._tick()
                with trio.move_on_after(TICK_S):
                    await self.wake.wait()
                self.wake = trio.Event()

    def _slots(self) -> int:
        router = self.state.router
        replicas = sum(len(p.engines) for p in router.pools) if router else 1
        return self.config.max_in_flight * max(1, replicas)

    async def _tick(self) -> None:
        now = self.clock()
        for row in await self.store.active_batches():
            a = self.active.get(row["id"])
            if a is None:
                a = self.active[row["id"]] = _Active(
                    row, Pace(float(row["created_at"]), float(row["expires_at"])))
            else:
                a.row = row
        free = self._slots() - sum(len(a.in_flight) for a in self.active.values())
        for a in sorted(self.active.values(), key=lambda a: (a.row["expires_at"], a.id)):
            status = a.row["status"]
            if status == "validating":
                await self.store.set_status(a.id, "in_progress")
                a.row["status"] = status = "in_progress"
            if status == "cancelling" or now >= a.row["expires_at"]:
                end = "cancelled" if status == "cancelling" else "expired"
                for scope in a.in_flight.values():
                    scope.cancel()
                if not a.in_flight:
                    await self._finalize(a, end)
                continue
            if status == "finalizing":
                await self._finalize(a, "completed")
                continue
            left = a.row["total"] - a.row["completed"] - a.row["failed"]
            level = a.pace.level
            if a.pace.update(now, left) > level:
                # Raised: what it has in the engines (most of it queued behind
                # interactive work) goes again at the new level.
                for scope in a.in_flight.values():
                    scope.cancel()
            share = int(self._slots() * LEVEL_SHARE[a.pace.level]) - len(a.in_flight)
            free -= await self._fill(a, now, max(0, min(free, share)))
            if left <= 0 and not a.in_flight:
                await self.store.set_status(a.id, "finalizing")
                await self._finalize(a, "completed")

    async def _fill(self, a: _Active, now: float, free: int) -> int:
        """Hand out up to `free` of the batch's pending requests; returns how many."""
        ready = [r for t, r in a.retry if t <= now]
        a.retry = [(t, r) for t, r in a.retry if t > now]
        a.queue.extendleft(reversed(ready))
        if len(a.queue) < free and not a.exhausted:
            rows = await self.store.pending(a.id, max(64, free), a.cursor)
            a.exhausted = not rows
            if rows:
                a.cursor = rows[-1]["idx"]
                a.queue.extend(rows)
        n = 0
        while a.queue and n < free and self.state.phase is Phase.READY:
            row = a.queue.popleft()
            if row["idx"] in a.in_flight:
                continue
            scope = trio.CancelScope()
            a.in_flight[row["idx"]] = scope
            self._nursery.start_soon(self._run_one, a, row, scope)
            n += 1
        return n

    async def _run_one(self, a: _Active, row: dict, scope: trio.CancelScope) -> None:
        idx = row["idx"]
        try:
            with scope:
                ok, line, usage = await self._execute(a, row)
                with trio.CancelScope(shield=True):  # a result computed is a result kept
                    if await self.store.record(a.id, idx, ok, line,
                                               usage.get("total_tokens", 0)):
                        a.row["completed" if ok else "failed"] += 1
                        a.pace.done(self.clock())
                        self.tokens_total += usage.get("completion_tokens", 0)
                        if ok:
                            self.completed_total += 1
                        else:
                            self.failed_total += 1
        except _Retry:
            a.retry.append((self.clock() + RETRY_S, row))
        else:
            if scope.cancelled_caught:  # raised, cancelled or expired: still pending
                a.retry.append((0.0, row))
        finally:
            a.in_flight.pop(idx, None)
            self.poke()

    async def _execute(self, a: _Active, row: dict) -> tuple[bool, bytes, dict]:
        kind = ENDPOINTS[row["url"]]
        tenant = self.state.tenants.named(a.row["tenant"])
        request_id = f"batch_req_{uuid.uuid4().hex}"
        try:
            parsed = parse(kind, row["body"])
            adm = await admit_parsed(self.state, kind, parsed, tenant, trio.current_time(),
                                     batch=LEVELS[a.pace.level])
            body = await collect(adm, None)
        except APIError as e:
            if e.status in (429, 503):
                raise _Retry from None
            err = json.loads(e.body())
            return False, _line(request_id, row["custom_id"], e.status, err,
                                {"code": e.detail.code, "message": e.detail.message}), {}
        out = json.loads(body)
        return True, _line(request_id, row["custom_id"], 200, out, None), out.get("usage") or {}

    async def _finalize(self, a: _Active, status: str) -> None:
        await self.store.finalize(a.id, status, f"file-{uuid.uuid4().hex}",
                                  f"file-{uuid.uuid4().hex}")
        self.active.pop(a.id, None)
        log.info("batch %s %s: %d completed, %d failed", a.id, status, a.row["completed"],
                 a.row["failed"])


class _Retry(Exception):
    """The request was refused for now (overload, draining): it stays pending."""


def _line(request_id: str, custom_id: str, status: int, body: dict,
          error: dict | None) -> bytes:
    return json.dumps({"id": request_id, "custom_id": custom_id,
                       "response": {"status_code": status, "request_id": request_id,
                                    "body": body}, "error": error}).encode()
