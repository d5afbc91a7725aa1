"""The JSON of GET /v1/stats (app/stats.py builds it): msgspec Structs, so /openapi.json
describes exactly what is sent."""

from __future__ import annotations

import msgspec


class Percentiles(msgspec.Struct):
    """Over the window; null when nothing was observed."""

    p50: float | None
    p95: float | None
    mean: float | None  # equals /metrics' sum / count over the same requests
    count: int


class Slo(msgspec.Struct):
    """The lines the dashboard draws: the pool's scheduler targets (1 s / 50 ms when off)."""

    ttft_s: float
    itl_s: float


class KvPages(msgspec.Struct):
    total: int
    in_use: int  # held by live sequences
    cached: int  # unreferenced, kept for prefix hits (evictable)
    free: int
    # With `?audit=1`: the allocator's audit of its books against the live page tables
    # (reference counts, free + cached + in use == total, the prefix cache's keys): empty
    # when consistent (always empty without it).
    audit_problems: list[str] = []


class KvWindow(msgspec.Struct):
    """The sliding-window layers' own pages (models such as Gemma 3 whose sliding layers
    keep only their window; scheduler/window_pages.py), summed over replicas: a
    sequence's sliding pages are bounded by its window, whatever its context."""

    window: int  # keys a sliding layer attends to
    total: int  # sliding pages (each holds page_size positions of every sliding layer)
    in_use: int
    cached: int  # window tails kept for prefix hits
    max_pages_per_seq: int  # the bound: the window, one chunk, a page each side
    most_pages_held: int  # by one running sequence now
    most_pages_held_ever: int


class KvTiers(msgspec.Struct):
    """The KV tiers below the device pool (pools with `kv_host_bytes`; docs/operations.md,
    "KV tiers"): pages held, and over the window, where prefix hits came from and the
    bytes copied between tiers."""

    host_pages: int
    host_slots: int
    disk_pages: int | None  # None: no disk tier
    disk_bytes: int | None
    disk_capacity_bytes: int | None
    hit_rate_by_tier: dict[str, float]  # device / host / disk: share of looked-up tokens
    copy_up_bytes_per_s: float  # host -> device
    copy_down_bytes_per_s: float  # device -> host
    disk_read_bytes_per_s: float
    disk_write_bytes_per_s: float
    disk_errors: dict[str, int]  # files skipped or writes failed, by kind (since start)


class Speculative(msgspec.Struct):
    """Speculative decoding (pools with `scheduler.speculative`; scheduler/speculative.py),
    over the window: proposals verified and accepted."""

    mode: str  # the proposer ("ngram")
    drafts_per_s: float  # verifies a second
    draft_tokens_per_s: float  # proposed tokens verified a second
    acceptance_rate: float | None  # accepted / verified proposals (None: none verified)
    mean_accepted_length: float | None  # tokens a verify yielded, its own included
    acceptance_by_position: list[float]  # share of verifies accepting position i


class Step(msgspec.Struct):
    """One engine step: what it carried and how long it took."""

    index: int
    ago_s: float  # seconds between the step's end and this report
    duration_s: float
    decode_rows: int
    prefill_tokens: int
    padding_tokens: int  # computed for bucket padding, not for a request
    preempted: int
    error: bool
    # Which rule sized its prompt chunks (scheduler/policy.py, `STEP_PLANS`: "itl-target",
    # "itl-derived", "ttft", ...) and the ITL budget it was planned within (0: none).
    plan: str = ""
    budget_s: float = 0.0


class Series(msgspec.Struct):
    """Once a second over the window, oldest first (`ago_s` counts back from now)."""

    ago_s: list[float]
    running: list[int]
    waiting: list[int]
    kv_pages_in_use: list[int]
    output_tokens_per_s: list[float]
    refused_per_s: list[float]  # 429s at the door, all reasons
    shed_per_s: list[float]


class ReplicaStats(msgspec.Struct):
    replica: int
    alive: bool
    running: int
    waiting: int
    oldest_waiting_age_s: float
    kv_pages: KvPages
    busy_fraction: float | None  # over the window: time inside steps / wall time
    steps: list[Step]  # newest last; only those after `steps_since`, at most 240
    last_step_index: int
    running_capacity: int = 0  # may run at once now (max_running, or fewer: the ITL target)


class PoolStats(msgspec.Struct):
    name: str
    model: str
    adapters: list[str]
    slo: Slo
    running: int
    waiting: int
    oldest_waiting_age_s: float
    kv_pages: KvPages
    prefix_cache_hit_rate: float | None  # prompt tokens served from cache / looked up
    ttft: Percentiles  # seconds, as the clients saw them
    itl: Percentiles
    output_tokens_per_s: float
    prompt_tokens_per_s: float
    refused_per_s: dict[str, float]  # 429s at the door, by reason
    shed_per_s: float  # admitted, then dropped after waiting past the queue deadline
    busy_fraction: float | None
    useful_busy_fraction: float | None  # busy x the share of computed tokens that were real
    replicas: list[ReplicaStats]
    series: Series
    # The share of the window's steps by the rule that sized their prompt chunks: where
    # the ITL target held, where the decodes alone filled it (the derived budget), where
    # a prompt about to miss the TTFT target took bigger chunks (scheduler/policy.py).
    step_plans: dict[str, float] = msgspec.field(default_factory=dict)
    kv_tiers: KvTiers | None = None  # None: the pool keeps no tiers below the device
    # None: no sliding layers with pages of their own
    kv_window: KvWindow | None = None
    speculative: Speculative | None = None  # None: speculative decoding off


class TenantStats(msgspec.Struct):
    name: str
    in_flight: int
    max_concurrency: int | None
    tokens_per_min: float  # prompt + generated tokens of requests ended in the window
    quota_tokens_per_min: int | None
    priority: int


class BatchProgress(msgspec.Struct):
    id: str
    tenant: str
    total: int
    completed: int
    failed: int
    running: int
    priority_level: int
    at_risk: bool
    expires_in_s: float


class Stats(msgspec.Struct):
    """GET /v1/stats: the server's live state per pool and replica (the console's source)."""

    time: float  # unix seconds
    uptime_s: float
    phase: str
    window_s: float  # rates and percentiles are over this many seconds (or since start)
    warmup_remaining: int
    pools: list[PoolStats]
    tenants: list[TenantStats]
    batches: list[BatchProgress] | None  # null when batch jobs are off
