"""GET /v1/stats: what the console's dashboard draws, as JSON that is useful on its own.

Three sources, none of which touches the engine's step path:
- each replica's `stats()` and its last `StepRecord`s, read when asked;
- `LiveStats.run`, a once-a-second sampler keeping ten minutes of counters; rates (output
  tokens/s, refusals/s by reason, busy and useful-busy fractions, prefix hits, tenants'
  tokens/min) are differences between now and the sample `window_s` ago, and the per-second
  series the charts start from come from the same ring;
- `Recent`: TTFT and inter-token gaps as the stream handlers observe them (app/streaming.py,
  beside the Prometheus histograms), in per-second histograms of 1%-wide buckets: the
  percentiles over the last minute are within 0.5% of the exact ones (Prometheus' buckets
  are up to 2.5x wide), and memory does not grow with the rate.
The JSON's types are msgspec Structs (app/stats_schema.py), so /openapi.json describes
exactly what is sent. (About 400 lines: the sampler and the report's sections, pools,
replicas, KV tiers, speculation, tenants, read from the same samples.)
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import trio

from .stats_schema import (BatchProgress, KvPages, KvTiers, KvWindow, Percentiles, PoolStats,
                           ReplicaStats, Series, Slo, Speculative, Stats, Step, TenantStats)

if TYPE_CHECKING:
    from .pools import Pool
    from .state import ServerState
    from .tenants import Tenant

KEEP_S = 600.0  # samples and latencies kept: the widest window a caller may ask for
# GET /v1/stats?steps_since=default/0:1234,long/0:88 (pool/replica:last step index seen)
STEPS_SINCE = r"^([^,]+/[0-9]+:-?[0-9]+)?(,[^,]+/[0-9]+:-?[0-9]+)*$"
MAX_STEPS = 240  # step records returned per replica and call


class Recent:
    """One latency over the last `KEEP_S` seconds, as a histogram per second.

    Buckets are 1% wide on a log scale, so a percentile read back is within 0.5% of the
    exact one, and memory stays fixed whatever the rate (a GPU pool observes thousands
    of inter-token gaps a second): a second holds at most a few hundred distinct buckets.
    The mean is exact (sum and count kept per second).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.seconds: deque[_Second] = deque()

    def add(self, value: float) -> None:
        sec = int(self.clock())
        if not self.seconds or self.seconds[-1].at != sec:
            self.seconds.append(_Second(sec))
            while self.seconds[0].at < sec - KEEP_S:
                self.seconds.popleft()
        cur = self.seconds[-1]
        k = math.floor(math.log(value) / _LOG_STEP) if value > 0 else _ZERO
        cur.buckets[k] = cur.buckets.get(k, 0) + 1
        cur.total += value
        cur.count += 1

    def since(self, t: float) -> Percentiles:
        """p50, p95, mean and count of what was observed from `t` on (to the second)."""
        merged: dict[int, int] = {}
        total, count = 0.0, 0
        for s in self.seconds:
            if s.at >= math.floor(t):
                for k, n in s.buckets.items():
                    merged[k] = merged.get(k, 0) + n
                total, count = total + s.total, count + s.count
        if not count:
            return Percentiles(None, None, None, 0)
        keys = sorted(merged)
        cum = np.cumsum([merged[k] for k in keys])

        def pct(q: float) -> float:
            k = keys[int(np.searchsorted(cum, q / 100 * count, side="left"))]
            return 0.0 if k == _ZERO else math.exp((k + 0.5) * _LOG_STEP)

        return Percentiles(round(pct(50), 5), round(pct(95), 5), round(total / count, 5), count)


@dataclass(slots=True)
class _Second:
    at: int
    buckets: dict[int, int] = field(default_factory=dict)  # log bucket -> observations
    total: float = 0.0
    count: int = 0


_LOG_STEP = math.log(1.01)
_ZERO = -(10**9)  # the bucket of zero (and negative) values


class Observer:
    """A Prometheus histogram child and its `Recent` twin, observed together."""

    __slots__ = ("hist", "recent")

    def __init__(self, hist: Any, recent: Recent) -> None:
        self.hist, self.recent = hist, recent

    def observe(self, value: float) -> None:
        self.hist.observe(value)
        self.recent.add(value)


# -- the sampler ---------------------------------------------------------------------------
@dataclass
class _Sample:
    t: float
    pools: dict[str, dict[str, Any]]  # pool name -> summed counters and gauges
    replicas: dict[tuple[str, int], float]  # (pool, replica) -> busy seconds
    tenants: dict[str, int]  # tenant name -> tokens of ended requests


@dataclass
class LiveStats:
    """The recent past the dashboard needs: latencies per pool and a ring of samples."""

    clock: Callable[[], float] = time.monotonic
    ttft: dict[str, Recent] = field(default_factory=dict)
    itl: dict[str, Recent] = field(default_factory=dict)
    samples: deque[_Sample] = field(default_factory=lambda: deque(maxlen=int(KEEP_S) + 1))
    started: float = field(default_factory=time.monotonic)

    def recent(self, kind: str, pool: str) -> Recent:
        table = self.ttft if kind == "ttft" else self.itl
        if pool not in table:
            table[pool] = Recent(self.clock)
        return table[pool]

    def sample(self, state: ServerState) -> _Sample:
        pools: dict[str, dict[str, Any]] = {}
        replicas: dict[tuple[str, int], float] = {}
        for pool in state.router.pools if state.router else []:
            stats = pool.stats()
            pools[pool.name] = _counters(stats, state.metrics.app_rejections, pool)
            for i, s in enumerate(stats):
                replicas[(pool.name, i)] = s.busy_s
        tenants = {t.name: t.tokens for t in _tenants(state)}
        return _Sample(self.clock(), pools, replicas, tenants)

    async def run(self, state: ServerState) -> None:
        """Sample once a second until cancelled (started with the server)."""
        while True:
            self.samples.append(self.sample(state))
            await trio.sleep(1.0)

    def baseline(self, since: float) -> _Sample | None:
        """The oldest sample at or after `since` (None before the first)."""
        for s in self.samples:
            if s.t >= since:
                return s
        return self.samples[-1] if self.samples else None


def _counters(stats: list, app_rejections: dict, pool: Pool) -> dict[str, Any]:
    refused: dict[str, int] = {}
    for s in stats:
        for reason, n in s.rejections.items():
            refused[reason] = refused.get(reason, 0) + n
    for (_, pool_name, reason), n in app_rejections.items():
        if pool_name == pool.name:
            refused[reason] = refused.get(reason, 0) + n
    return dict(
        generation_tokens=sum(s.generation_tokens for s in stats),
        prompt_tokens=sum(s.prompt_tokens for s in stats),
        busy_s=sum(s.busy_s for s in stats),
        real_tokens=sum(s.real_tokens for s in stats),
        padded_tokens=sum(s.padded_tokens for s in stats),
        prefix_queries=sum(s.prefix_cache_queries_tokens for s in stats),
        prefix_hits=sum(s.prefix_cache_hits_tokens for s in stats),
        refused=refused,
        running=sum(s.running for s in stats),
        waiting=sum(s.waiting for s in stats),
        kv_in_use=sum(s.kv_pages_in_use for s in stats),
        replicas=len(stats),
        plans=_summed(s.step_plans for s in stats),
        tiers=_summed(_tier_counters(s.kv_tiers) for s in stats if s.kv_tiers),
        spec=_summed(_spec_counters(s.speculative) for s in stats if s.speculative),
    )


def _spec_counters(sp: dict) -> dict[str, int]:
    return {"drafts": sp["drafts"], "draft_tokens": sp["draft_tokens"],
            "accepted": sp["accepted_tokens"], "emitted": sp["emitted_tokens"],
            **{f"pos{i}": n for i, n in enumerate(sp["accepted_per_position"])}}


def _speculative(pool: Pool, cur: dict, old: dict, span: float) -> Speculative | None:
    mode = pool.config.scheduler.speculative
    if mode == "off":
        return None
    now, then = cur["spec"], old.get("spec") or {}

    def d(key: str) -> float:
        return now.get(key, 0) - then.get(key, 0)

    drafts, verified = d("drafts"), d("draft_tokens")
    k = pool.config.scheduler.num_speculative_tokens
    return Speculative(
        mode=mode, drafts_per_s=_rate(drafts, 0, span), draft_tokens_per_s=_rate(verified, 0, span),
        acceptance_rate=d("accepted") / verified if verified else None,
        mean_accepted_length=d("emitted") / drafts if drafts else None,
        acceptance_by_position=[d(f"pos{i}") / drafts if drafts else 0.0 for i in range(k)])


def _tier_counters(t: dict) -> dict[str, int]:
    disk = t.get("disk") or {}
    return {"hits_host": t["hit_tokens"]["host"], "hits_disk": t["hit_tokens"]["disk"],
            "hits_remote": t["hit_tokens"].get("remote", 0),
            "up": t["copy_up_bytes"], "down": t["copy_down_bytes"],
            "disk_read": disk.get("read_bytes", 0), "disk_write": disk.get("write_bytes", 0)}


def _kv_tiers(stats: list, cur: dict, old: dict, span: float) -> KvTiers | None:
    tiers = [s.kv_tiers for s in stats if s.kv_tiers]
    if not tiers:
        return None
    now, then = cur["tiers"], old.get("tiers") or {}

    def d(key: str) -> float:
        return now.get(key, 0) - then.get(key, 0)

    queries = cur["prefix_queries"] - old["prefix_queries"]
    lower = {"host": d("hits_host"), "disk": d("hits_disk"), "remote": d("hits_remote")}
    device = cur["prefix_hits"] - old["prefix_hits"] - sum(lower.values())
    rates = ({"device": device / queries, **{k: v / queries for k, v in lower.items()}}
             if queries else {})
    disks = [t["disk"] for t in tiers if t.get("disk")]
    errors = _summed(dk["errors"] for dk in disks)
    return KvTiers(
        host_pages=sum(t["host_pages"] for t in tiers),
        host_slots=sum(t["host_slots"] for t in tiers),
        disk_pages=sum(dk["pages"] for dk in disks) if disks else None,
        disk_bytes=sum(dk["bytes"] for dk in disks) if disks else None,
        disk_capacity_bytes=sum(dk["capacity_bytes"] for dk in disks) if disks else None,
        hit_rate_by_tier=rates,
        copy_up_bytes_per_s=_rate(d("up"), 0, span),
        copy_down_bytes_per_s=_rate(d("down"), 0, span),
        disk_read_bytes_per_s=_rate(d("disk_read"), 0, span),
        disk_write_bytes_per_s=_rate(d("disk_write"), 0, span), disk_errors=errors)


def _summed(dicts) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, n in d.items():
            out[k] = out.get(k, 0) + n
    return out


def _tenants(state: ServerState) -> list[Tenant]:
    t = state.tenants
    return [t.anonymous] if t.open else list(t.by_digest.values())


def parse_query(window: str | None, steps_since: str | None
                ) -> tuple[float, dict[tuple[str, int], int]]:
    """The query's (window_s, steps_since); ValueError saying what is wrong."""
    try:
        w = 60.0 if window is None else float(window)
    except ValueError:
        raise ValueError("`window_s` is a number of seconds.") from None
    if not 0 < w <= KEEP_S:  # NaN fails too
        raise ValueError(f"`window_s` must be in (0, {KEEP_S:g}] seconds.")
    since: dict[tuple[str, int], int] = {}
    if steps_since:
        if re.fullmatch(STEPS_SINCE, steps_since) is None:
            raise ValueError("`steps_since` is a comma-separated list of "
                             "pool/replica:step_index.")
        for item in steps_since.split(","):
            pool_replica, _, index = item.rpartition(":")
            pool, _, replica = pool_replica.rpartition("/")
            since[(pool, int(replica))] = int(index)
    return w, since


# -- the report ----------------------------------------------------------------------------
def report(state: ServerState, live: LiveStats, *, window_s: float = 60.0,
           steps_since: dict[tuple[str, int], int] | None = None,
           tenant: str | None = None, audit: bool = False) -> Stats:
    """The whole /v1/stats answer. `tenant`: show only that tenant (None: all);
    `audit`: each pool's KV books audited (`kv_pages.audit_problems`)."""
    now = live.clock()
    base = live.baseline(now - window_s)
    span = now - base.t if base is not None else 0.0
    pools = [_pool(state, live, p, now, window_s, base, span, steps_since or {}, audit)
             for p in (state.router.pools if state.router else [])]
    tenants = [_tenant(t, base, span) for t in _tenants(state)
               if tenant is None or t.name == tenant]
    batches = None
    if state.batches is not None:
        batches = [BatchProgress(**b) for b in state.batches.worker.progress_all()
                   if tenant is None or b["tenant"] == tenant]
    warming = sum(p.warmup_remaining for p in state.router.pools) if state.router else 0
    return Stats(time.time(), now - live.started, state.phase.value, round(span, 3) or window_s,
                 warming, pools, tenants, batches)


def _rate(now: float, then: float, span: float) -> float:
    return (now - then) / span if span > 0 else 0.0


def _pool(state: ServerState, live: LiveStats, pool: Pool, now: float, window_s: float,
          base: _Sample | None, span: float, steps_since: dict,
          audit: bool = False) -> PoolStats:
    stats = pool.stats(audit)
    cur = _counters(stats, state.metrics.app_rejections, pool)
    old = base.pools.get(pool.name) if base is not None else None
    old = old or {k: ({} if isinstance(v, dict) else 0) for k, v in cur.items()}

    def d(key: str) -> float:
        return cur[key] - old[key]

    refused = {r: _rate(n, old["refused"].get(r, 0), span)
               for r, n in sorted(cur["refused"].items()) if r != "shed"}
    shed = _rate(cur["refused"].get("shed", 0), old["refused"].get("shed", 0), span)
    busy = d("busy_s") / span / max(1, cur["replicas"]) if span > 0 else None
    real_share = d("real_tokens") / d("padded_tokens") if d("padded_tokens") else None
    useful = busy * real_share if busy is not None and real_share is not None else busy
    queries = d("prefix_queries")
    plans = {k: n - old["plans"].get(k, 0) for k, n in cur["plans"].items()}
    planned = sum(plans.values())
    replicas = [_replica(pool, i, s, live, now, base, span, steps_since.get((pool.name, i), -1))
                for i, s in enumerate(stats)]
    sched = pool.config.scheduler
    return PoolStats(
        name=pool.name, model=pool.model_name, adapters=sorted(pool.adapters.by_name),
        slo=Slo(sched.ttft_target_s or 1.0, sched.itl_target_s or 0.05),
        running=cur["running"], waiting=cur["waiting"],
        oldest_waiting_age_s=max((s.oldest_waiting_age_s for s in stats), default=0.0),
        kv_pages=_kv(stats),
        prefix_cache_hit_rate=d("prefix_hits") / queries if queries else None,
        ttft=live.recent("ttft", pool.name).since(now - window_s),
        itl=live.recent("itl", pool.name).since(now - window_s),
        output_tokens_per_s=_rate(cur["generation_tokens"], old["generation_tokens"], span),
        prompt_tokens_per_s=_rate(cur["prompt_tokens"], old["prompt_tokens"], span),
        refused_per_s=refused, shed_per_s=shed, busy_fraction=busy, useful_busy_fraction=useful,
        replicas=replicas, series=_series(live, pool.name, now, window_s),
        kv_tiers=_kv_tiers(stats, cur, old, span),
        kv_window=_kv_window(stats),
        speculative=_speculative(pool, cur, old, span),
        step_plans={k: round(n / planned, 4) for k, n in plans.items() if n} if planned else {})


def _replica(pool: Pool, i: int, s: Any, live: LiveStats, now: float, base: _Sample | None,
             span: float, since: int) -> ReplicaStats:
    engine = pool.engines[i]
    then = base.replicas.get((pool.name, i), 0.0) if base is not None else 0.0
    records = [r for r in list(engine.step_records)[-MAX_STEPS:] if r.index > since]
    t = engine.clock()  # step times are on the engine's clock
    steps = [Step(r.index, round(t - r.ended_at, 4), round(r.ended_at - r.started_at, 5),
                  len(r.decoded), sum(n for _, n in r.prefilled),
                  max(0, r.padded_tokens - r.real_tokens), len(r.preempted),
                  r.error is not None, r.why, round(r.budget_s, 5))
             for r in records]
    return ReplicaStats(i, s.alive, s.running, s.waiting, s.oldest_waiting_age_s, _kv([s]),
                        (s.busy_s - then) / span if span > 0 else None, steps, s.steps - 1,
                        s.running_capacity)


def _kv_window(stats: list) -> KvWindow | None:
    ws = [s.kv_window for s in stats if s.kv_window]
    if not ws:
        return None
    return KvWindow(window=ws[0]["window"], total=sum(w["pages"] for w in ws),
                    in_use=sum(w["pages_in_use"] for w in ws),
                    cached=sum(w["pages_cached"] for w in ws),
                    max_pages_per_seq=ws[0]["max_pages_per_seq"],
                    most_pages_held=max(w["most_pages_held"] for w in ws),
                    most_pages_held_ever=max(w["most_pages_held_ever"] for w in ws))


def _kv(stats: list) -> KvPages:
    return KvPages(sum(s.kv_pages_total for s in stats), sum(s.kv_pages_in_use for s in stats),
                   sum(s.kv_pages_cached for s in stats), sum(s.kv_pages_free for s in stats),
                   [problem for s in stats for problem in s.kv_audit])


def _series(live: LiveStats, pool: str, now: float, window_s: float) -> Series:
    rows = [s for s in live.samples if s.t >= now - window_s - 1.0 and pool in s.pools]
    out = Series([], [], [], [], [], [], [])
    for prev, s in zip(rows, rows[1:]):
        p, q, dt = s.pools[pool], prev.pools[pool], s.t - prev.t
        shed = p["refused"].get("shed", 0)
        out.ago_s.append(round(now - s.t, 3))
        out.running.append(p["running"])
        out.waiting.append(p["waiting"])
        out.kv_pages_in_use.append(p["kv_in_use"])
        out.output_tokens_per_s.append(
            round(_rate(p["generation_tokens"], q["generation_tokens"], dt), 2))
        out.refused_per_s.append(round(_rate(sum(p["refused"].values()) - shed,
                                             sum(q["refused"].values())
                                             - q["refused"].get("shed", 0), dt), 2))
        out.shed_per_s.append(round(_rate(shed, q["refused"].get("shed", 0), dt), 2))
    return out


def _tenant(t: Tenant, base: _Sample | None, span: float) -> TenantStats:
    cfg = t.config
    then = base.tenants.get(t.name, 0) if base is not None else 0
    per_min = (t.tokens - then) * 60.0 / span if span > 0 else 0.0
    return TenantStats(t.name, t.in_flight, cfg.max_concurrency, round(per_min, 1),
                       cfg.tokens_per_minute, cfg.priority)
