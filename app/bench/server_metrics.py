"""What the server says about itself during a run, when it is Sluice.

The target is Sluice when its ``GET /metrics`` has ``sluice:`` series; any other server
gets ``"server": null`` in the report. Counters are read as deltas between a scrape just
before the measured phase and one just after it, so a server that has served other runs
already reports only this one. Gauges that change during the run (KV use) are sampled
every ``interval`` seconds on a connection of their own, so sampling never waits behind
the load's connection pool.

Sums run over every label set (pools, replicas); ``engine_busy_fraction_run`` divides the
busy seconds by the wall time and the number of ``engine_busy_seconds`` series, i.e. one
per pool (a pool's replicas are summed into one series, so with replicas it can exceed 1).
Every ``sluice:*_total`` counter's delta is also kept raw under ``counters_delta``, so
new engine counters show up in reports without a change here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "sluice:"


@dataclass
class Scrape:
    """One /metrics answer: counter totals and gauges, summed over label sets."""

    counters: dict[str, float] = field(default_factory=dict)  # sample name -> sum
    gauges: dict[str, list[float]] = field(default_factory=dict)  # name -> one per series
    series: dict[str, int] = field(default_factory=dict)  # sample name -> label sets
    rejected: dict[str, float] = field(default_factory=dict)  # reason -> refusals
    # histogram family -> (cumulative count per upper bound, sum), summed over label sets
    histograms: dict[str, tuple[dict[float, float], float]] = field(default_factory=dict)


def parse(text: str) -> Scrape:
    """Sluice's series from Prometheus text. A sample named ``*_total`` is a counter
    whether its family says so or is untyped (a ``# TYPE`` line without the suffix)."""
    s = Scrape()
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith(PREFIX):
            continue
        for sample in fam.samples:
            if fam.type in ("counter", "unknown") and sample.name.endswith("_total"):
                s.counters[sample.name] = s.counters.get(sample.name, 0.0) + sample.value
                s.series[sample.name] = s.series.get(sample.name, 0) + 1
                if sample.name == PREFIX + "requests_rejected_total":
                    reason = sample.labels.get("reason", "")
                    s.rejected[reason] = s.rejected.get(reason, 0.0) + sample.value
            elif fam.type == "gauge":
                s.gauges.setdefault(sample.name, []).append(sample.value)
            elif fam.type == "histogram":
                buckets, total = s.histograms.get(fam.name, ({}, 0.0))
                if sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + sample.value
                elif sample.name.endswith("_sum"):
                    total += sample.value
                s.histograms[fam.name] = (buckets, total)
    return s


def histogram_delta(first: Scrape, last: Scrape, name: str) -> dict[str, float] | None:
    """p50, p95 (linear within buckets, as Prometheus' histogram_quantile) and mean of a
    histogram's observations between two scrapes; None when there were none."""
    b1, s1 = last.histograms.get(PREFIX + name, ({}, 0.0))
    b0, s0 = first.histograms.get(PREFIX + name, ({}, 0.0))
    bounds = sorted(b1)
    cum = [b1[le] - b0.get(le, 0.0) for le in bounds]
    if not cum or cum[-1] <= 0:
        return None
    count = cum[-1]

    def quantile(q: float) -> float:
        rank = q * count
        lower, below = 0.0, 0.0
        for le, c in zip(bounds, cum):
            if c >= rank:
                if le == float("inf"):
                    return lower
                return lower + (le - lower) * ((rank - below) / (c - below) if c > below else 1)
            lower, below = le, c
        return lower

    return {"p50": quantile(0.5), "p95": quantile(0.95), "mean": (s1 - s0) / count,
            "count": count}


async def scrape(http: httpx.AsyncClient) -> Scrape | None:
    """The server's metrics, or None when it has no Sluice metrics (or no /metrics)."""
    try:
        r = await http.get("/metrics")
    except httpx.HTTPError:
        return None
    if r.status_code != 200 or PREFIX not in r.text:
        return None
    try:
        return parse(r.text)
    except ValueError:
        return None


class Sampler:
    """Baseline scrape, periodic gauge samples, final scrape; `summary` derives the rest."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.first: Scrape | None = None
        self.last: Scrape | None = None
        self.kv_usage: list[float] = []
        self.began = 0.0
        self.wall_s = 0.0

    async def begin(self) -> bool:
        self.first = await scrape(self.http)
        self.began = time.perf_counter()
        return self.first is not None

    async def poll(self, interval_s: float) -> None:
        """Sample KV use until cancelled (only if `begin` found a Sluice server)."""
        while self.first is not None:
            await trio.sleep(interval_s)
            s = await scrape(self.http)
            if s is not None:
                self._note(s)

    async def end(self) -> None:
        self.wall_s = time.perf_counter() - self.began
        if self.first is not None:
            self.last = await scrape(self.http)
            if self.last is not None:
                self._note(self.last)

    def _note(self, s: Scrape) -> None:
        usage = s.gauges.get(PREFIX + "kv_cache_usage_perc")
        if usage:
            self.kv_usage.append(max(usage))  # the most loaded pool

    def summary(self) -> dict[str, object] | None:
        if self.first is None or self.last is None:
            return None
        a, b = self.first.counters, self.last.counters
        delta = {k: v - a.get(k, 0.0) for k, v in sorted(b.items())}

        def d(name: str) -> float:
            return delta.get(f"{PREFIX}{name}_total", 0.0)

        queries, hits = d("prefix_cache_queries"), d("prefix_cache_hits")
        busy_series = self.last.series.get(f"{PREFIX}engine_busy_seconds_total", 0)
        busy_gauge = self.last.gauges.get(PREFIX + "engine_busy_fraction")
        rejected = {k: v - self.first.rejected.get(k, 0.0)
                    for k, v in sorted(self.last.rejected.items())}
        kv = self.kv_usage
        busy_run = (d("engine_busy_seconds") / self.wall_s / busy_series
                    if busy_series and self.wall_s > 0 else None)
        real, padded = d("step_real_tokens"), d("step_padded_tokens")
        real_fraction = real / padded if padded else None
        host = histogram_delta(self.first, self.last, "step_host_seconds")
        compute, idle = d("step_compute_seconds"), d("step_idle_seconds")
        return {
            "prefix_cache_hit_rate": hits / queries if queries else None,
            "prefix_cache_hit_tokens": hits,
            "prefix_cache_query_tokens": queries,
            "kv_cache_usage": {"mean": sum(kv) / len(kv) if kv else None,
                               "max": max(kv) if kv else None, "samples": len(kv)},
            "engine_busy_fraction": (sum(busy_gauge) / len(busy_gauge)) if busy_gauge else None,
            "engine_busy_fraction_run": busy_run,
            # Useful-busy: time in steps x the share of computed tokens that were real.
            "real_token_fraction": real_fraction,
            "useful_busy_fraction": (busy_run * real_fraction
                                     if busy_run is not None and real_fraction else None),
            # Measured / predicted step time (the step-cost model the ITL target plans with).
            "step_time_prediction_ratio": histogram_delta(self.first, self.last,
                                                          "step_time_prediction_ratio"),
            # Host work per step around its computation, and the share of the engine's
            # time the computation stood idle between steps, waiting for host work (with
            # overlapped scheduling, only what did not fit beside the step before).
            "step_host_seconds": host,
            "step_compute_seconds": compute,
            "step_idle_seconds": idle,
            "device_idle_between_steps": (idle / (idle + compute)
                                          if idle + compute > 0 else None),
            "preemptions": d("num_preemptions"),
            "prompt_tokens": d("prompt_tokens"),
            "generation_tokens": d("generation_tokens"),
            "rejected": rejected,
            "counters_delta": {k[len(PREFIX):]: v for k, v in delta.items()},
        }
