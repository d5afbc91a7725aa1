"""What the outside world (app/) hands the engine and gets back.

A submission is a `GenerateRequest`; the engine answers with a `RequestHandle` whose
`events` channel yields `TokenEvent`s then exactly one `FinishEvent` or `ErrorEvent`.
`submit` never blocks: a full queue raises `Overloaded` at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .protocol import SamplingParams


@dataclass(slots=True)
class GenerateRequest:
    prompt_ids: Sequence[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()  # stop strings (never included in the output text)
    stop_token_ids: Sequence[int] = ()  # extra stop tokens beside the model's eos
    ignore_eos: bool = False
    tenant: str = "anonymous"
    priority: int = 0  # smaller is more urgent (vLLM's convention); app clamps per tenant
    weight: float = 1.0  # the tenant's fair-share weight
    tenant_max_running: int | None = None  # running at once (TenantConfig.max_running)
    cache_salt: str = ""  # prefix-cache isolation (tenant and adapter, unless shared)
    request_id: str | None = None  # a uuid4 hex is assigned when None
    deadline_s: float | None = None  # longest queue wait before shedding; None: the pool's
    batch: bool = False  # background batch job: runs only in idle capacity
    adapter: str | None = None  # LoRA adapter to run under (None: the base model)
    # Structured output: the sequence's grammar state (model/grammar.GrammarConstraint:
    # `fill(row)`, `accept(token) -> bool`, `finished`, `error`); None: free text.
    constraint: Any = None
    index: int = 0  # which of a request's `n` choices this is (its events carry it)
    # Score the prompt: each prompt token's logprob (after the first) with this many top
    # alternatives, delivered with the first token event. None: off. The prompt is then
    # computed whole (prefix-cache hits would leave positions unscored).
    prompt_logprobs: int | None = None
    # Disaggregated prefill (app/disagg.py): when it ends, the prompt's full KV pages from
    # this page index on leave with its FinishEvent (`kv`), for a decode replica's pool.
    # None: nothing exported.
    export_pages_from: int | None = None


@dataclass(frozen=True, slots=True)
class TokenEvent:
    text: str  # final text (held back while it could still be part of a stop string)
    token_ids: tuple[int, ...]
    logprobs: tuple[Any, ...] = ()  # per token: SampledToken-like (token_id, logprob, top_logprobs)
    index: int = 0  # the choice (GenerateRequest.index)
    # With the first token, if asked (GenerateRequest.prompt_logprobs): per prompt token
    # after the first, a SampledToken-like (its id, logprob, top alternatives).
    prompt_logprobs: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True)
class FinishEvent:
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    ttft_s: float | None
    queue_s: float | None
    e2e_s: float
    index: int = 0
    predicted_ttft_s: float | None = None  # the door's prediction, when it made one
    # The prompt's pages asked for by `GenerateRequest.export_pages_from` (the runner's
    # `export_pages`), or None.
    kv: Any = None


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    message: str
    # "server_error" | "shed" (waited past its deadline) | "overloaded" | "engine_dead" (its
    # replica stopped: retry, another may serve) | "stopped" (the server is shutting down)
    kind: str = "server_error"
    retry_after_s: float | None = None
    index: int = 0


@dataclass(frozen=True, slots=True)
class RequestHandle:
    """What `submit` returns. `events` is a bounded `trio.MemoryReceiveChannel` yielding
    TokenEvents then exactly one FinishEvent or ErrorEvent, then end of channel (None when
    the caller passed its own channel: the choices of one request share a stream, each
    event tagged with its `index`, the end of channel after the last one's end). (Typed
    loosely so this module stays free of trio.)"""

    request_id: str
    events: Any


class Overloaded(Exception):
    """Raised by `submit` when the request cannot be queued; answer 429 with Retry-After."""

    def __init__(self, reason: str, retry_after_s: float, message: str = "") -> None:
        super().__init__(message or f"overloaded: {reason}")
        self.reason = reason  # "queue_full" | "queue_tokens" | "tenant_limit" | "too_long" | ...
        self.retry_after_s = retry_after_s


class EngineDead(Exception):
    """Raised by `submit` once the engine loop has failed for good."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int
    waiting: int
    oldest_waiting_age_s: float
    kv_pages_total: int  # usable pages (null page excluded)
    kv_pages_in_use: int  # referenced by live sequences
    kv_pages_cached: int  # unreferenced, kept for prefix hits (evictable)
    kv_pages_free: int
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    preemptions: int
    rejections: dict[str, int]
    steps: int
    busy_s: float  # wall time spent inside runner steps
    uptime_s: float
    real_tokens: int  # tokens computed that belonged to a request
    padded_tokens: int  # tokens computed including bucket padding
    prompt_tokens: int
    generation_tokens: int
    alive: bool
    # LoRA adapters (scheduler/adapters.py): slots, resident, running / waiting sequences
    # and requests / tokens by adapter, slot loads and swaps.
    adapters: dict = field(default_factory=dict)
    # Measured / predicted step time: counts per step_log.PREDICTION_BUCKETS, and the sum.
    step_prediction: tuple[list[int], float] = field(default_factory=lambda: ([], 0.0))
    # Host seconds per step around the computation: counts per step_log.HOST_BUCKETS, sum.
    step_host: tuple[list[int], float] = field(default_factory=lambda: ([], 0.0))
    running_capacity: int = 0  # sequences that may run at once now (fewer under an ITL target)
    compute_s: float = 0.0  # seconds the steps computed (busy_s less host work)
    idle_s: float = 0.0  # seconds the computation stood idle between steps (host work it waited for)
    # How late first tokens came against the door's predictions (`Admission.ttft_factor`).
    ttft_factor: float = 1.0
    # What `PageAllocator.audit` found wrong in the KV books against the live page
    # tables, when the read asked for it (`Engine.stats(audit=True)`; empty: consistent).
    kv_audit: list[str] = field(default_factory=list)
    # Steps planned so far by the rule that sized their prompt chunks (`Batch.why`,
    # `policy.STEP_PLANS`): the ITL target, the derived budget, a TTFT about to be missed.
    step_plans: dict[str, int] = field(default_factory=dict)
    # The KV tiers below the device pool (scheduler/kv_tiers.py `KVTiers.stats`; empty:
    # none): pages and bytes per tier, hits per tier, bytes copied up and down.
    kv_tiers: dict = field(default_factory=dict)
    # Speculative decoding (scheduler/speculative.py `Speculation.spec_stats`): the mode,
    # verifies, proposals verified and accepted (per position), acceptance.
    speculative: dict = field(default_factory=dict)
    # The sliding layers' own pages (scheduler/window_pages.py `WindowPages.stats`; empty:
    # none): the window, pages in use and cached, the most one sequence holds and may hold.
    kv_window: dict = field(default_factory=dict)

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / self.uptime_s if self.uptime_s > 0 else 0.0

    @property
    def kv_usage(self) -> float:
        return self.kv_pages_in_use / self.kv_pages_total if self.kv_pages_total else 0.0
