"""One benchmark run against one target: calibrate, send the workload, summarise.

Each workload has a phase function. `shared-prefix` and `mixed` are one steady phase in
the chosen load shape. `long-interference` runs short streams in a closed loop, sends
the long prompt after a warm-up, and stops the short streams a little after it ends.
`overload` first measures capacity (a closed loop, unless ``--rate`` is given), then
sends an open loop at a multiple of it. Server metrics cover the measured phase only.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, AsyncIterator

import httpx
import trio

from .client import RequestRecord, open_client
from .loops import Shooter, SpecOf, closed_loop, open_loop
from .options import BenchConfig
from .progress import RunProgress
from .server_metrics import Sampler
from .stats import interference, summarize
from .workloads import (DEFAULT_WORDS_PER_TOKEN, AdapterMix, LongInterference, Workload,
                        calibrate, make_workload)

CAPACITY_INDEX = 1_000_000  # capacity-phase requests: distinct from the measured ones
WARMUP_INDEX = 2_000_000


class BenchError(Exception):
    """The run cannot go on (target unreachable, no capacity at all)."""


@dataclass
class Result:
    summary: dict[str, Any]
    records: list[RequestRecord] = field(default_factory=list)  # every phase, by tag


@dataclass
class _Ctx:
    cfg: BenchConfig
    workload: Workload
    http: httpx.AsyncClient
    sampler: Sampler
    model: str | None
    extra: dict[str, Any]
    mix: AdapterMix | None = None

    @property
    def request(self) -> SpecOf:
        """The workload's requests, each naming its adapter under --adapters."""
        spec_of = self.workload.request
        return self.mix.wrap(spec_of) if self.mix else spec_of

    def shooter(self, progress: RunProgress | None = None) -> Shooter:
        return Shooter(self.http, model=self.model, extra=self.extra,
                       timeout_s=self.cfg.timeout_s, progress=progress)

    def progress(self, what: str, *, requests: int | None = None,
                 duration_s: float | None = None) -> RunProgress:
        title = f"{self.cfg.label or self.cfg.url} {what}"
        return RunProgress(title, total_requests=requests, duration_s=duration_s,
                           enabled=self.cfg.progress)

    @asynccontextmanager
    async def measured(self, progress: RunProgress) -> AsyncIterator[None]:
        """Server metrics and the progress ticker around the measured phase."""
        await self.sampler.begin()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.sampler.poll, self.cfg.metrics_interval_s)
            nursery.start_soon(progress.tick)
            yield
            nursery.cancel_scope.cancel()
        await self.sampler.end()


async def adapters_of(http: httpx.AsyncClient, model: str | None, n: int) -> list[str]:
    """The first n adapters (by name) GET /v1/models lists with `model` as parent."""
    r = await http.get("/v1/models")
    cards = r.json().get("data", []) if r.status_code == 200 else []
    names = sorted(c["id"] for c in cards if c.get("parent") and c["parent"] == model)
    if len(names) < n:
        raise BenchError(f"--adapters {n}: the server lists {len(names)} adapters of "
                         f"{model!r} ({', '.join(names) or 'none'})")
    return names[:n]


async def first_model(http: httpx.AsyncClient) -> str | None:
    """The first model the server lists; raises BenchError if it cannot be reached."""
    try:
        r = await http.get("/v1/models")
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {http.base_url}: {type(e).__name__}: {e}") from e
    try:
        return r.json()["data"][0]["id"] if r.status_code == 200 else None
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def pool_size(cfg: BenchConfig) -> int:
    """Connections: one per request that the load shape can have in flight at once."""
    if cfg.workload == "long-interference":
        return cfg.short_streams + 1
    if cfg.workload == "overload":
        return max(cfg.max_inflight, cfg.capacity_concurrency or cfg.concurrency)
    return cfg.max_inflight if cfg.rate else cfg.concurrency


async def run_bench(cfg: BenchConfig) -> Result:
    cfg = cfg.bounded()
    load = open_client(cfg.url, pool_size(cfg), api_key=cfg.api_key, timeout_s=cfg.timeout_s)
    # Model list, /tokenize and /metrics go on their own connections, never queued
    # behind the load.
    side = open_client(cfg.url, 2, api_key=cfg.api_key, timeout_s=30.0)
    async with load as http, side:
        model = cfg.model or await first_model(side)
        wpt, source = cfg.words_per_token, "flag"
        if wpt is None and cfg.calibrate:
            wpt, source = await calibrate(side, model, cfg.seed), "tokenize"
        if wpt is None:
            wpt, source = DEFAULT_WORDS_PER_TOKEN, "default"
        workload = make_workload(cfg.workload, cfg.seed, wpt, cfg.max_tokens,
                                 system_tokens=cfg.system_tokens,
                                 long_prompt_tokens=cfg.long_prompt_tokens,
                                 long_max_tokens=cfg.long_max_tokens)
        extra: dict[str, Any] = {}
        if cfg.temperature is not None:
            extra["temperature"] = cfg.temperature
        if cfg.ignore_eos:
            extra["ignore_eos"] = True
        extra.update(cfg.extra_body or {})
        mix = None
        if cfg.adapters:
            mix = AdapterMix(await adapters_of(side, model, cfg.adapters), cfg.adapter_dist,
                             cfg.seed)
        ctx = _Ctx(cfg, workload, http, Sampler(side), model, extra, mix)
        started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        if cfg.warmup_requests:
            with ctx.progress("warm-up", requests=cfg.warmup_requests) as p:
                warm = mix.wrap(workload.request, round_robin=True) if mix else workload.request
                await closed_loop(ctx.shooter(p), warm, 1,
                                  requests=cfg.warmup_requests, start_index=WARMUP_INDEX)
        phase = {"long-interference": _long_interference, "overload": _overload}.get(
            cfg.workload, _steady)
        records, head, tail = await phase(ctx)
    summary: dict[str, Any] = {
        "label": cfg.label, "target": cfg.url, "model": model, "workload": cfg.workload,
        "seed": cfg.seed, "started_at": started, **head,
        "calibration": {"words_per_token": wpt, "source": source},
        "max_tokens": cfg.max_tokens, "ignore_eos": cfg.ignore_eos,
        **tail, "server": ctx.sampler.summary(),
    }
    if mix is not None:
        ok = Counter(mix.pick(r.index) for r in records if r.status == "ok" and r.index >= 0)
        summary["adapters"] = {"n": len(mix.names), "distribution": mix.dist,
                               "names": mix.names, "ok_by_adapter": dict(sorted(ok.items()))}
    return Result(summary, records)


Phase = tuple[list[RequestRecord], dict[str, Any], dict[str, Any]]  # records, head, tail


async def _steady(ctx: _Ctx) -> Phase:
    cfg = ctx.cfg
    with ctx.progress(cfg.workload, requests=cfg.requests, duration_s=cfg.duration_s) as p:
        shooter = ctx.shooter(p)
        async with ctx.measured(p):
            if cfg.rate:
                await open_loop(shooter, ctx.request, cfg.rate,
                                requests=cfg.requests, duration_s=cfg.duration_s,
                                start_index=cfg.start_index, seed=cfg.seed,
                                max_inflight=cfg.max_inflight)
            else:
                await closed_loop(shooter, ctx.request, cfg.concurrency,
                                  requests=cfg.requests, duration_s=cfg.duration_s,
                                  start_index=cfg.start_index, ramp_up_s=cfg.ramp_up_s)
        wall = shooter.now()
    head = {"load": _load(cfg)}
    return shooter.records, head, summarize(
        shooter.records, wall_s=wall, slo_ttft=cfg.slo_ttft, slo_itl=cfg.slo_itl,
        concurrency=None if cfg.rate else cfg.concurrency)


async def _long_interference(ctx: _Ctx) -> Phase:
    cfg, workload = ctx.cfg, ctx.workload
    assert isinstance(workload, LongInterference)
    with ctx.progress("long-interference") as p:
        shooter = ctx.shooter(p)
        async with ctx.measured(p), trio.open_nursery() as nursery:
            # The shorts' own bound only matters if the long request hangs past its timeout.
            bound = cfg.warmup_s + cfg.timeout_s + cfg.tail_s
            nursery.start_soon(partial(closed_loop, shooter, ctx.request,
                                       cfg.short_streams, duration_s=bound,
                                       start_index=cfg.start_index))
            await trio.sleep(cfg.warmup_s)
            long = await shooter.fire(workload.long(), -1)
            await trio.sleep(cfg.tail_s)
            nursery.cancel_scope.cancel()  # in-flight shorts end as "cancelled"
        wall = shooter.now()
    shorts = [r for r in shooter.records if r.tag == "short"]
    head = {"load": {"mode": "closed", "concurrency": cfg.short_streams, "warmup_s": cfg.warmup_s,
                     "tail_s": cfg.tail_s}}
    tail = summarize(shorts, wall_s=wall, slo_ttft=cfg.slo_ttft, slo_itl=cfg.slo_itl)
    tail["long_interference"] = interference(shorts, long)
    return shooter.records, head, tail


async def _overload(ctx: _Ctx) -> Phase:
    cfg = ctx.cfg
    records: list[RequestRecord] = []
    capacity: dict[str, Any] | None = None
    rate = cfg.rate
    if rate is None:
        conc = cfg.capacity_concurrency or cfg.concurrency
        n = cfg.capacity_requests or 2 * conc
        with ctx.progress("capacity", requests=n) as p:
            probe = ctx.shooter(p)
            await closed_loop(probe, ctx.request, conc, requests=n,
                              duration_s=cfg.capacity_duration_s,
                              start_index=cfg.start_index + CAPACITY_INDEX,
                              ramp_up_s=cfg.ramp_up_s)
            wall = probe.now()
        for r in probe.records:
            r.tag = "capacity"
        records += probe.records
        ok = sum(1 for r in probe.records if r.status == "ok")
        if ok == 0:
            raise BenchError("no request succeeded while measuring capacity")
        capacity = {"concurrency": conc, "requests": len(probe.records), "ok": ok,
                    "wall_s": wall, "requests_per_s": ok / wall}
        rate = cfg.overload_factor * ok / wall
    with ctx.progress(f"overload {rate:.2f}/s", requests=cfg.requests,
                      duration_s=cfg.duration_s) as p:
        shooter = ctx.shooter(p)
        async with ctx.measured(p):
            await open_loop(shooter, ctx.request, rate, requests=cfg.requests,
                            duration_s=cfg.duration_s, start_index=cfg.start_index,
                            seed=cfg.seed, max_inflight=cfg.max_inflight)
        wall = shooter.now()
    records += shooter.records
    tail = summarize(shooter.records, wall_s=wall, slo_ttft=cfg.slo_ttft, slo_itl=cfg.slo_itl)
    tail["overload"] = {"capacity": capacity, "factor": cfg.overload_factor if capacity else None,
                        "rate_rps": rate}
    return records, {"load": {"mode": "open", "rate_rps": rate}}, tail


def _load(cfg: BenchConfig) -> dict[str, Any]:
    if cfg.rate:
        return {"mode": "open", "rate_rps": cfg.rate, "max_inflight": cfg.max_inflight}
    return {"mode": "closed", "concurrency": cfg.concurrency, "ramp_up_s": cfg.ramp_up_s}
