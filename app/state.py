"""What one server process holds: its phase, pools, tenants, guardrails, metrics and flights.

A `Flight` is one admitted request from admission to its last byte. It owns three things
that must be given back exactly once, whatever way the request ends (finished, failed,
client gone, server draining): the engine's sequence (`abort`, which frees its pages
before the next iteration), the tenant's lease, and a slot under `max_streams`.
`Flight.close` gives all three back, is synchronous (cleanup runs in `finally` of an
already-cancelled scope, where nothing may be awaited) and idempotent (it is called from
the stream's `finally` and again by the ASGI safety net in server.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable

import trio

from config.settings import Settings

from .guardrails import Guardrails
from .metrics import Metrics
from .pools import Pool, Router
from .request_log import RequestLog
from .schemas import Health
from .tenants import Lease, Tenants


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"


@dataclass(eq=False)
class Flight:
    state: ServerState
    pool: Pool
    lease: Lease
    prompt_tokens: int
    replica: int = -1
    handle: Any = None  # scheduler RequestHandle (.request_id, .events) once submitted
    generated: int = 0
    closed: bool = False
    stop_reason: str | None = None  # set when the server ends the request (drain)
    receive_scope: trio.CancelScope | None = None  # cancelled by `stop` to wake the reader
    log: RequestLog | None = None  # its line in the request log, written at close
    # Run at close: a decode pool drops prefilled pages its replica never took (disagg).
    cleanup: list[Callable[[], None]] = field(default_factory=list)

    def submitted(self, replica: int, handle: Any) -> None:
        self.replica, self.handle = replica, handle
        if self.closed:  # stopped while it was being submitted (e.g. at the input check)
            for request_id in _request_ids(handle):
                self.pool.finish(replica, request_id)

    def abort_choice(self, index: int) -> None:
        """Stop generating one of `n` choices (its output check refused it); the others go
        on. The pool's accounting of it ends with the flight."""
        ids = _request_ids(self.handle)
        if 0 <= index < len(ids):
            self.pool.engines[self.replica].abort(ids[index])

    def stop(self, reason: str) -> None:
        """End the request from outside (drain): abort it and wake its reader."""
        self.stop_reason = reason
        if self.receive_scope is not None:
            self.receive_scope.cancel()
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.handle is not None:
            for request_id in _request_ids(self.handle):
                self.pool.finish(self.replica, request_id)
        self.lease.release(self.prompt_tokens + self.generated if self.handle else 0)
        for fn in self.cleanup:
            fn()
        self.state.flights.discard(self)
        if self.log is not None:
            self.log.emit(self.prompt_tokens, self.generated)
        if not self.state.flights:
            self.state.idle.set()


@dataclass
class Choices:
    """The handle of a request with `n` choices: their engine ids, and the one event
    stream they share (events tagged with their choice's index)."""

    request_ids: list[str]
    events: Any

    @property
    def request_id(self) -> str:
        return self.request_ids[0]


def _request_ids(handle: Any) -> list[str]:
    return getattr(handle, "request_ids", None) or [handle.request_id]


@dataclass(eq=False)
class ServerState:
    settings: Settings
    tenants: Tenants
    guard: Guardrails
    metrics: Metrics = field(default_factory=Metrics)
    router: Router | None = None
    phase: Phase = Phase.LOADING
    load_error: str | None = None
    flights: set[Flight] = field(default_factory=set)
    idle: trio.Event = field(default_factory=trio.Event)  # set whenever flights empties
    drain_requested: trio.Event = field(default_factory=trio.Event)
    drain_now: trio.Event = field(default_factory=trio.Event)  # end running streams at once
    batches: Any = None  # app.batches.Batches once the store is open (None: batch jobs off)
    door_passes: Any = None  # app.door.Passes: the front door's passes not yet in the app

    def request_drain(self, now: bool = False) -> None:
        """Begin a graceful shutdown (what SIGINT/SIGTERM do); server.py carries it out.
        `now`: do not wait for running streams (the second signal): each ends at once with
        a final error event."""
        self.drain_requested.set()
        if now:
            self.drain_now.set()

    def health(self) -> tuple[Health, int]:
        """What /health answers, and its status: 200 serving ("ok", or "degraded" where a
        replica died and the others serve), 503 loading, draining or dead (a pool with no
        live replica: restart the server). The app's route and the front door's answer
        on a new connection (app/front_door.py) both give this."""
        if self.phase is Phase.LOADING:
            return Health("loading"), 503
        if self.phase is Phase.DRAINING:
            return Health("draining"), 503
        assert self.router is not None
        deaths = [d for p in self.router.pools for d in p.deaths]
        if not self.router.alive:
            return Health("engine_dead", "; ".join(deaths)), 503
        warming = sum(p.warmup_remaining for p in self.router.pools)
        if deaths:  # serving on the live replicas; the dead ones need a restart
            return Health("degraded", "; ".join(deaths), warming), 200
        detail = f"serving; {warming} step shapes still compiling in the background" \
            if warming else ""
        return Health("ok", detail, warming), 200

    def ready(self, router: Router) -> None:
        self.router = router
        self.metrics.router = router
        if self.phase is Phase.LOADING:
            self.phase = Phase.READY

    def add_flight(self, flight: Flight) -> None:
        if not self.flights:
            self.idle = trio.Event()
        self.flights.add(flight)
