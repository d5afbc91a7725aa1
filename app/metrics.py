"""Prometheus metrics, named as vLLM names them with a `sluice:` prefix.

Existing vLLM dashboards map over by swapping the prefix (vLLM's label is `model_name`;
ours is `model`, plus `pool` so two pools serving one model stay apart). A private
CollectorRegistry keeps tests and several servers in one process from colliding.

Two sources:
- Histograms (TTFT, inter-token latency, end-to-end, queue time) are observed by the
  stream handler, so they measure what the client saw, tokenization and guardrails
  included. Inter-token latency is the gap between token deliveries as the handler read
  them; tokens that arrived together (coalesced) count one gap.
- Gauges and counters are read from `engine.stats()` at scrape time by a custom
  collector: nothing polls the engines in the background, and a scrape always sees the
  engine's current state (e.g. `kv_pages_in_use` is 0 once every request is gone).
  Requests refused in app/ (tenant quota, stream bound, draining) are counted here and
  added to the engines' own refusals under `requests_rejected_total{reason}`.
(About 410 lines: every family is declared and filled in one scrape, pool by pool.)
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client import Counter as Counter_
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                   HistogramMetricFamily, Metric)

from scheduler.step_log import HOST_BUCKETS, PREDICTION_BUCKETS

from .stats import LiveStats, Observer

if TYPE_CHECKING:
    from .pools import Router

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ("model", "pool")
# vLLM's buckets, plus a few where CPU and SLO-bound figures land (0.3-0.9 s TTFT, 0.1-0.4 s
# ITL), so that histogram_quantile's estimates there are within ~10% rather than ~30%.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.3, 0.4, 0.5, 0.6,
                 0.7, 0.75, 0.8, 0.9, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.175, 0.2, 0.225, 0.25, 0.3,
                0.35, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.router: Router | None = None  # set once the pools are loaded
        self.batches = None  # app.batches.Batches, when batch jobs are on
        self.app_rejections: Counter[tuple[str, str, str]] = Counter()  # (model, pool, reason)
        self.live = LiveStats()  # the last minutes, for GET /v1/stats (app/stats.py)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry)

        self.ttft = hist("sluice:time_to_first_token_seconds",
                         "Request arrival to first token written, seconds.", _TTFT_BUCKETS)
        self.itl = hist("sluice:inter_token_latency_seconds",
                        "Gap between token deliveries of one stream, seconds.", _ITL_BUCKETS)
        self.e2e = hist("sluice:e2e_request_latency_seconds",
                        "Request arrival to its last byte, seconds.", _REQUEST_BUCKETS)
        self.queue = hist("sluice:request_queue_time_seconds",
                          "Time a request waited in the engine's queue, seconds.",
                          _REQUEST_BUCKETS)
        # Disaggregated prefill (app/disagg.py): pages sent by a prefill pool, received
        # by a decode pool, and how each decode pool's prompts went.
        self.transfer_bytes = Counter_("sluice:kv_transfer_bytes",
                                       "KV page bytes moved between servers (direction: "
                                       "sent by a prefill pool, received by a decode pool).",
                                       LABELS + ("direction",), registry=self.registry)
        self.transfer_s = Histogram("sluice:kv_transfer_seconds",
                                    "A prompt's pages moving: their copy out and encoding "
                                    "(sent), or the whole remote prefill less the prefill "
                                    "server's compute (received), seconds.",
                                    LABELS + ("direction",),
                                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2) + _REQUEST_BUCKETS,
                                    registry=self.registry)
        self.remote_prefill_s = hist("sluice:remote_prefill_seconds",
                                     "A decode pool's prompt at a prefill server, ask to pages "
                                     "in its inbox, seconds.", _TTFT_BUCKETS)
        self.remote_prefills = Counter_("sluice:remote_prefill_requests",
                                        "A decode pool's prompts sent to prefill servers, by "
                                        "outcome (ok, retried, refused, unreachable, failed, "
                                        "local: computed here after all failed).",
                                        LABELS + ("outcome",), registry=self.registry)
        self.registry.register(_EngineCollector(self))
        # process_resident_memory_bytes, CPU seconds, open fds: the server's own footprint.
        ProcessCollector(registry=self.registry)

    def latencies(self, model: str, pool: str) -> tuple[Observer, Observer]:
        """(TTFT, inter-token) observers of one pool: its histograms and its recent
        samples together."""
        return (Observer(self.ttft.labels(model, pool), self.live.recent("ttft", pool)),
                Observer(self.itl.labels(model, pool), self.live.recent("itl", pool)))

    def kv_transfer(self, model: str, pool: str, direction: str, nbytes: int,
                    seconds: float) -> None:
        self.transfer_bytes.labels(model, pool, direction).inc(nbytes)
        self.transfer_s.labels(model, pool, direction).observe(seconds)

    def remote_prefill(self, model: str, pool: str, outcome: str,
                       seconds: float | None = None) -> None:
        self.remote_prefills.labels(model, pool, outcome).inc()
        if seconds is not None:
            self.remote_prefill_s.labels(model, pool).observe(seconds)

    def reject(self, model: str, pool: str, reason: str) -> None:
        self.app_rejections[(model, pool, reason)] += 1

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Reads every engine's stats when Prometheus scrapes."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"sluice:{name}", doc, labels=LABELS + extra)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> CounterMetricFamily:
            return CounterMetricFamily(f"sluice:{name}", doc, labels=LABELS + extra)

        running = gauge("num_requests_running", "Sequences decoding or prefilling.")
        waiting = gauge("num_requests_waiting", "Requests queued for admission.")
        oldest = gauge("oldest_waiting_age_seconds", "Age of the oldest queued request.")
        usage = gauge("kv_cache_usage_perc", "Fraction of KV pages held by live sequences (0-1).")
        in_use = gauge("kv_pages_in_use", "KV pages held by live sequences (0 when idle).")
        total = gauge("kv_pages_total", "Usable KV pages (the null page excluded).")
        # Sliding-window layers' own pages (scheduler/window_pages.py; only pools with them).
        win_in_use = gauge("kv_window_pages_in_use", "Sliding layers' own KV pages held by "
                           "live sequences (each within its window's bound).")
        win_total = gauge("kv_window_pages_total", "Sliding layers' own usable KV pages.")
        busy = gauge("engine_busy_fraction", "Share of uptime spent in runner steps.")
        busy_s = counter("engine_busy_seconds", "Seconds spent in runner steps (rate() = busy).")
        queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        preempt = counter("num_preemptions", "Sequences preempted (recomputed later).")
        prompt = counter("prompt_tokens", "Prompt tokens processed.")
        gen = counter("generation_tokens", "Tokens generated.")
        rejected = counter("requests_rejected", "Requests refused, by reason.", ("reason",))
        real = counter("step_real_tokens", "Tokens computed in steps that belonged to requests.")
        padded = counter("step_padded_tokens",
                         "Tokens computed in steps, bucket padding included.")
        warming = gauge("warmup_remaining_shapes",
                        "Step shapes still compiling in the background (0: warm-up done).")
        ttft_target = gauge("ttft_target_seconds",
                            "The pool's TTFT target admission predicts against (0: off).")
        itl_target = gauge("itl_target_seconds",
                           "The pool's inter-token latency target (0: off).")
        plans = counter("steps", "Steps run, by the rule that sized their prompt chunks: "
                        "itl-target (within the ITL target), itl-derived (the decodes alone "
                        "fill the target: the learned costs' share), ttft (a prompt about to "
                        "miss the TTFT target), rare-question, prefill-only, decode-only, "
                        "itl-strict, unpaced.", ("plan",))
        ttft_factor = gauge("ttft_prediction_factor",
                            "How late first tokens come against admission's predictions "
                            "(recent measured / predicted TTFT, 90th percentile, 1-1.5); "
                            "the door judges newcomers' TTFT at the prediction times this.")
        prediction = HistogramMetricFamily(
            "sluice:step_time_prediction_ratio", "Measured / predicted step time (the "
            "step-cost model admission and the ITL target plan with).", labels=LABELS)
        host = HistogramMetricFamily(
            "sluice:step_host_seconds", "Host work per step around its computation: "
            "planning, packing, commit, detokenizing, delivery (overlapped with the next "
            "step's computation unless the pool's scheduler.overlap is off).",
            labels=LABELS)
        compute = counter("step_compute_seconds",
                          "Seconds the steps computed (busy seconds less host work).")
        idle = counter("step_idle_seconds",
                       "Seconds the computation stood idle between steps, waiting for host "
                       "work (overlapped scheduling hides the rest of it).")

        # vLLM's adapter gauge: the value is the time of the scrape, the labels say which
        # adapters run and wait (comma-separated) and how many slots there are.
        lora_info = GaugeMetricFamily(
            "sluice:lora_requests_info", "Running stats on LoRA adapters.",
            labels=LABELS + ("running_lora_adapters", "waiting_lora_adapters", "max_lora"))
        lora_requests = counter("lora_requests", "Requests submitted, by LoRA adapter.",
                                ("adapter",))
        lora_tokens = counter("lora_generation_tokens", "Tokens generated, by LoRA adapter.",
                              ("adapter",))
        lora_loads = counter("lora_slot_loads", "LoRA adapters copied into a device slot.")
        lora_swaps = counter("lora_slot_swaps",
                             "Slot loads that replaced another adapter (a swap).")
        lora_loaded = gauge("lora_adapters_loaded", "LoRA adapters registered (any slot).")
        # vLLM's cache geometry, which an endpoint picker's prefix scorer reads (deploy/,
        # docs/operations.md "Running a fleet on Kubernetes"): the value is 1, the labels say
        # the KV page size in tokens and how many pages the pool has (all replicas).
        # Each pool's role (app/disagg.py): join on it for per-role queue age and use.
        role_info = gauge("pool_role_info", "1 per pool; the label says its role: prefill, "
                          "decode or both.", ("role",))
        cache_info = GaugeMetricFamily(
            "sluice:cache_config_info", "KV cache geometry: block_size (tokens per page), "
            "num_gpu_blocks (usable pages, all replicas), enable_prefix_caching.",
            labels=LABELS + ("block_size", "num_gpu_blocks", "enable_prefix_caching"))

        # The KV tiers below the device pool (scheduler/kv_tiers.py; only pools with them).
        tier_pages = gauge("kv_tier_pages", "KV pages held per tier: device (cached or in "
                           "use), host, disk.", ("tier",))
        tier_bytes = gauge("kv_tier_bytes", "KV bytes held per tier.", ("tier",))
        tier_capacity = gauge("kv_tier_capacity_bytes", "KV bytes each tier may hold.",
                              ("tier",))
        tier_hits = counter("prefix_cache_hits_by_tier", "Prompt tokens served from the "
                            "prefix cache, by the tier they were found in (host and disk "
                            "pages are copied up first; remote: computed by a prefill "
                            "server).", ("tier",))
        tier_copies = counter("kv_tier_copy_bytes", "KV bytes copied between tiers: up "
                              "(host to device), down (device to host), disk_read, "
                              "disk_write (rate(): bytes/s).", ("direction",))
        tier_errors = counter("kv_tier_disk_errors", "Disk tier files skipped or writes "
                              "failed, by kind (corrupt, truncated, foreign, write, ...).",
                              ("kind",))
        tier_families = (tier_pages, tier_bytes, tier_capacity, tier_hits, tier_copies,
                         tier_errors)
        # Speculative decoding, with vLLM's names and meanings (scheduler/speculative.py).
        spec_drafts = counter("spec_decode_num_drafts", "Verifies run: a sequence's "
                              "proposed tokens checked in one step.")
        spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Proposed tokens verified.")
        spec_accepted = counter("spec_decode_num_accepted_tokens",
                                "Proposed tokens accepted (each a token without a step).")
        spec_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                               "Proposed tokens accepted, by their position in the "
                               "proposal (0: the first).", ("position",))
        spec_families = (spec_drafts, spec_draft_tokens, spec_accepted, spec_per_pos)

        router = self.metrics.router
        reasons: Counter[tuple[str, str, str]] = Counter(self.metrics.app_rejections)
        for pool in router.pools if router else []:
            stats = pool.stats()
            lv = [pool.model_name, pool.name]
            s_in_use = sum(s.kv_pages_in_use for s in stats)
            s_total = sum(s.kv_pages_total for s in stats)
            running.add_metric(lv, sum(s.running for s in stats))
            waiting.add_metric(lv, sum(s.waiting for s in stats))
            oldest.add_metric(lv, max((s.oldest_waiting_age_s for s in stats), default=0.0))
            usage.add_metric(lv, s_in_use / s_total if s_total else 0.0)
            in_use.add_metric(lv, s_in_use)
            total.add_metric(lv, s_total)
            busy.add_metric(lv, sum(s.busy_fraction for s in stats) / max(1, len(stats)))
            busy_s.add_metric(lv, sum(s.busy_s for s in stats))
            queries.add_metric(lv, sum(s.prefix_cache_queries_tokens for s in stats))
            hits.add_metric(lv, sum(s.prefix_cache_hits_tokens for s in stats))
            preempt.add_metric(lv, sum(s.preemptions for s in stats))
            prompt.add_metric(lv, sum(s.prompt_tokens for s in stats))
            gen.add_metric(lv, sum(s.generation_tokens for s in stats))
            real.add_metric(lv, sum(s.real_tokens for s in stats))
            padded.add_metric(lv, sum(s.padded_tokens for s in stats))
            warming.add_metric(lv, pool.warmup_remaining)
            ttft_target.add_metric(lv, pool.config.scheduler.ttft_target_s)
            itl_target.add_metric(lv, pool.config.scheduler.itl_target_s)
            ttft_factor.add_metric(lv, max((s.ttft_factor for s in stats), default=1.0))
            by_plan: Counter[str] = Counter()
            for s in stats:
                by_plan.update(s.step_plans)
            for plan, n in sorted(by_plan.items()):
                plans.add_metric(lv + [plan], n)
            _histogram(prediction, lv, PREDICTION_BUCKETS, [s.step_prediction for s in stats])
            _histogram(host, lv, HOST_BUCKETS, [s.step_host for s in stats])
            compute.add_metric(lv, sum(s.compute_s for s in stats))
            idle.add_metric(lv, sum(s.idle_s for s in stats))
            role_info.add_metric(lv + [pool.config.role], 1.0)
            cache_info.add_metric(lv + [str(_page_size(pool)), str(s_total),
                                        str(pool.config.scheduler.prefix_cache)], 1.0)
            for s in stats:
                for reason, n in s.rejections.items():
                    reasons[(pool.model_name, pool.name, reason)] += n
            if any(s.kv_window for s in stats):
                win_in_use.add_metric(lv, sum(s.kv_window.get("pages_in_use", 0) for s in stats))
                win_total.add_metric(lv, sum(s.kv_window.get("pages", 0) for s in stats))
            if any(s.kv_tiers for s in stats):
                _kv_tiers(stats, lv, tier_families)
            if pool.config.scheduler.speculative != "off":
                _speculative(stats, lv, spec_families)
            if pool.config.max_loras:
                _lora(stats, lv, pool.config.max_loras, len(pool.adapters.by_name),
                      (lora_info, lora_requests, lora_tokens, lora_loads, lora_swaps,
                       lora_loaded))
        for (model, pool_name, reason), n in sorted(reasons.items()):
            rejected.add_metric([model, pool_name, reason], n)
        if self.metrics.batches is not None:
            yield from _batch_metrics(self.metrics.batches.worker.stats())
        yield from (running, waiting, oldest, usage, in_use, total, busy, busy_s, queries,
                    hits, preempt, prompt, gen, rejected, real, padded, warming, ttft_target,
                    itl_target, plans, ttft_factor, prediction, host, compute, idle,
                    win_in_use, win_total, *tier_families, *spec_families, lora_info,
                    lora_requests, lora_tokens, lora_loads, lora_swaps, lora_loaded)
        yield cache_info
        yield role_info


def _page_size(pool) -> int:
    """Tokens per KV page, as the replicas' runners lay the cache out."""
    for engine in pool.engines:
        return engine.runner.page_size
    return pool.config.page_size


def _histogram(family: HistogramMetricFamily, lv: list[str], bounds: tuple[float, ...],
               per_replica: list[tuple[list[int], float]]) -> None:
    """One pool's histogram (`step_log.Histogram` snapshots), summed over its replicas."""
    counts = [0] * len(bounds)
    total = 0.0
    for c, s in per_replica:
        for i, n in enumerate(c):
            counts[i] += n
        total += s
    cumulative, buckets = 0, []
    for le, n in zip(bounds, counts):
        cumulative += n
        buckets.append(("+Inf" if le == float("inf") else str(le), cumulative))
    family.add_metric(lv, buckets, total)


def _lora(stats: list, lv: list[str], max_loras: int, loaded: int, families: tuple) -> None:
    """One pool's adapter metrics, summed over its replicas' `EngineStats.adapters`."""
    info, requests, tokens, loads, swaps, registered = families
    running: Counter[str] = Counter()
    waiting: Counter[str] = Counter()
    by_req: Counter[str] = Counter()
    by_tok: Counter[str] = Counter()
    for s in stats:
        a = s.adapters
        running.update(a.get("running", {}))
        waiting.update(a.get("waiting", {}))
        by_req.update(a.get("requests", {}))
        by_tok.update(a.get("tokens", {}))
    info.add_metric(lv + [",".join(sorted(running)), ",".join(sorted(waiting)),
                          str(max_loras)], time.time())
    for name in sorted(by_req):
        requests.add_metric(lv + [name], by_req[name])
        tokens.add_metric(lv + [name], by_tok[name])
    loads.add_metric(lv, sum(s.adapters.get("loads", 0) for s in stats))
    swaps.add_metric(lv, sum(s.adapters.get("swaps", 0) for s in stats))
    registered.add_metric(lv, loaded)



def _batch_metrics(st: dict) -> Iterator[Metric]:
    """Batch jobs, from the worker's books (no store query at scrape time)."""
    req = GaugeMetricFamily("sluice:batch_requests",
                            "Batch requests of unfinished batches, and finished since start, "
                            "by state.", labels=("state",))
    for state in ("pending", "running", "completed", "failed"):
        req.add_metric([state], st[state])
    yield req
    yield CounterMetricFamily("sluice:batch_tokens", "Tokens generated for batch requests "
                              "finished since start (in generation_tokens_total too).",
                              value=st["tokens"])
    yield GaugeMetricFamily("sluice:batch_oldest_pending_age_seconds",
                            "Age of the oldest batch with requests not yet finished.",
                            value=st["oldest_pending_age_s"])
    yield GaugeMetricFamily("sluice:batches_at_risk", "Unfinished batches whose measured pace "
                            "would miss their completion window.", value=st["at_risk"])
    yield GaugeMetricFamily("sluice:batches_active", "Batches not yet ended.",
                            value=st["active"])


def _speculative(stats, lv: list[str], families) -> None:
    """A pool's speculative decoding, summed over its replicas."""
    drafts, draft_tokens, accepted, per_pos = families
    specs = [s.speculative for s in stats if s.speculative]
    drafts.add_metric(lv, sum(x["drafts"] for x in specs))
    draft_tokens.add_metric(lv, sum(x["draft_tokens"] for x in specs))
    accepted.add_metric(lv, sum(x["accepted_tokens"] for x in specs))
    width = max((len(x["accepted_per_position"]) for x in specs), default=0)
    for i in range(width):
        per_pos.add_metric(lv + [str(i)], sum(x["accepted_per_position"][i] for x in specs
                                             if i < len(x["accepted_per_position"])))


def _kv_tiers(stats, lv: list[str], families) -> None:
    """A pool's KV tiers, summed over its replicas."""
    pages, nbytes, capacity, hits, copies, errors = families
    tiers = [s.kv_tiers for s in stats if s.kv_tiers]
    page_bytes = tiers[0]["page_bytes"]
    device = sum(s.kv_pages_in_use + s.kv_pages_cached for s in stats)
    disks = [t["disk"] for t in tiers if t.get("disk")]
    held = {"device": (device, device * page_bytes,
                       sum(s.kv_pages_total for s in stats) * page_bytes),
            "host": (sum(t["host_pages"] for t in tiers), sum(t["host_bytes"] for t in tiers),
                     sum(t["host_capacity_bytes"] for t in tiers))}
    if disks:
        held["disk"] = (sum(d["pages"] for d in disks), sum(d["bytes"] for d in disks),
                        sum(d["capacity_bytes"] for d in disks))
    for tier, (n, b, cap) in held.items():
        pages.add_metric(lv + [tier], n)
        nbytes.add_metric(lv + [tier], b)
        capacity.add_metric(lv + [tier], cap)
    lower = {k: sum(t["hit_tokens"].get(k, 0) for t in tiers)
             for k in ("host", "disk", "remote")}
    all_hits = sum(s.prefix_cache_hits_tokens for s in stats if s.kv_tiers)
    hits.add_metric(lv + ["device"], max(0, all_hits - sum(lower.values())))
    for tier, n in lower.items():
        hits.add_metric(lv + [tier], n)
    for direction, key in (("up", "copy_up_bytes"), ("down", "copy_down_bytes")):
        copies.add_metric(lv + [direction], sum(t[key] for t in tiers))
    if disks:
        copies.add_metric(lv + ["disk_read"], sum(d["read_bytes"] for d in disks))
        copies.add_metric(lv + ["disk_write"], sum(d["write_bytes"] for d in disks))
        kinds: Counter[str] = Counter()
        for d in disks:
            kinds.update(d["errors"])
        for kind, n in sorted(kinds.items()):
            errors.add_metric(lv + [kind], n)
