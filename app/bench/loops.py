"""Load shapes: a closed loop at a concurrency, an open loop at a Poisson rate.

Both are bounded: by a request count, a duration, or both (whichever comes first), and
each request by its timeout, so every run ends by itself. After the bound the loops
stop sending and wait for the requests in flight (not cut off: their latencies are the
ones the load produced).

A closed loop that gets a 429 waits for the Retry-After (at most 1 s) before its next
request, and 0.1 s after a transport error: otherwise a refusing server would be
hammered in a tight loop that measures nothing. An open loop never waits: arrivals are
the point, and refusals are what it measures.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from typing import Any, Callable

import httpx
import trio

from .client import RequestRecord, send
from .progress import RunProgress
from .workloads import RequestSpec

SpecOf = Callable[[int], RequestSpec]


class Shooter:
    """Sends requests to one target and keeps every record, in send order."""

    def __init__(self, http: httpx.AsyncClient, *, model: str | None, extra: dict[str, Any],
                 timeout_s: float, progress: RunProgress | None = None) -> None:
        self.http, self.model, self.extra, self.timeout_s = http, model, extra, timeout_s
        self.progress = progress
        self.t0 = time.perf_counter()
        self.records: list[RequestRecord] = []
        self.in_flight = 0

    def now(self) -> float:
        """Seconds since this shooter was made: the run's clock."""
        return time.perf_counter() - self.t0

    def record(self, spec: RequestSpec, index: int, status: str = "pending") -> RequestRecord:
        rec = RequestRecord(index=index, tag=spec.tag, start=self.now(),
                            max_tokens=spec.max_tokens, status=status)
        self.records.append(rec)
        return rec

    async def fire(self, spec: RequestSpec, index: int) -> RequestRecord:
        rec = self.record(spec, index)
        self.in_flight += 1
        await self._send(spec, rec)
        return rec

    def launch(self, nursery: trio.Nursery, spec: RequestSpec, index: int) -> None:
        """`fire` in the background, counted in flight at once (the open loop's bound)."""
        rec = self.record(spec, index)
        self.in_flight += 1
        nursery.start_soon(self._send, spec, rec)

    async def _send(self, spec: RequestSpec, rec: RequestRecord) -> None:
        try:
            await send(self.http, spec, rec, model=spec.model or self.model, extra=self.extra,
                       timeout_s=self.timeout_s)
        finally:
            self.in_flight -= 1
            if self.progress is not None:
                self.progress.done(rec)


async def closed_loop(shooter: Shooter, spec_of: SpecOf, concurrency: int, *,
                      requests: int | None = None, duration_s: float | None = None,
                      start_index: int = 0, ramp_up_s: float = 0.0) -> None:
    """``concurrency`` workers, each sending its next request when the last one ends.
    With `ramp_up_s`, worker k starts k * ramp_up_s / concurrency seconds in."""
    if requests is None and duration_s is None:
        raise ValueError("a closed loop needs a request count or a duration")
    indices = itertools.count(start_index)
    stop_index = start_index + requests if requests is not None else math.inf
    deadline = trio.current_time() + (duration_s if duration_s is not None else math.inf)

    async def worker(k: int) -> None:
        await trio.sleep(k * ramp_up_s / concurrency)
        while trio.current_time() < deadline:
            i = next(indices)
            if i >= stop_index:
                return
            rec = await shooter.fire(spec_of(i), i)
            pause = 0.0
            if rec.status == "rate_limited":
                pause = min(rec.retry_after if rec.retry_after is not None else 0.1, 1.0)
            elif rec.status == "transport_error":
                pause = 0.1
            if pause:
                await trio.sleep(min(pause, max(0.0, deadline - trio.current_time())))

    async with trio.open_nursery() as nursery:
        for k in range(concurrency):
            nursery.start_soon(worker, k)


async def open_loop(shooter: Shooter, spec_of: SpecOf, rate: float, *,
                    requests: int | None = None, duration_s: float | None = None,
                    start_index: int = 0, seed: int = 0, max_inflight: int = 512) -> None:
    """Poisson arrivals at ``rate`` a second, whatever the server does.

    The inter-arrival times come from their own seeded RNG, so a run is repeatable. An
    arrival that finds ``max_inflight`` requests in flight (the connection pool's size)
    is recorded as ``dropped`` instead of queueing in the client, where it would wait
    unseen and make the server look faster than it is.
    """
    if requests is None and duration_s is None:
        raise ValueError("an open loop needs a request count or a duration")
    if rate <= 0:
        raise ValueError(f"{rate=} must be positive")
    rng = random.Random(f"arrivals:{seed}")
    begin = trio.current_time()
    at = begin
    async with trio.open_nursery() as nursery:
        for k in itertools.count():
            if requests is not None and k >= requests:
                break
            if duration_s is not None and at - begin > duration_s:
                break
            await trio.sleep_until(at)
            i = start_index + k
            spec = spec_of(i)
            if shooter.in_flight >= max_inflight:
                rec = shooter.record(spec, i, status="dropped")
                if shooter.progress is not None:
                    shooter.progress.done(rec)
            else:
                shooter.launch(nursery, spec, i)
            at += rng.expovariate(rate)
