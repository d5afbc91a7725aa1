"""Typed settings: msgspec frozen Structs decoded from TOML presets.

`load_settings(path)` decodes a TOML file into `Settings`; a bad file fails at start with
the file, the key and what was expected (msgspec's path, e.g. ``$.pools[0].page_size``),
raised as `ConfigError` so the CLI can print one line instead of a traceback.

`load_settings()` with no path reads ``config/default.toml``: one pool serving the embedded
SmolLM2 model, no tenants (every request is the anonymous tenant), no guardrails.
`Settings()` equals it (a test checks): the preset writes the defaults out, with comments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec


class SchedulerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-replica iteration policy."""

    mode: Literal["continuous", "static"] = "continuous"
    static_batch_size: int = 8  # static mode: gather up to N, run all to completion
    # Per-step caps. The sequence cap comes from the inter-token-latency target: more
    # sequences per step make every step (and so every token gap) longer.
    max_step_tokens: int = 272  # decode tokens + prefill tokens: 16 + a 256-token chunk
    max_running: int = 16  # sequences decoding at once (also capped by the decode buckets)
    max_waiting: int = 64  # bounded queue: requests
    max_waiting_tokens: int = 2_000_000  # bounded queue: prompt tokens waiting
    queue_deadline_s: float = 30.0  # shed a request that waited longer than this
    # Refuse (429) at submit when the predicted time to first token (expected queue wait
    # plus the prompt's own prefill) exceeds this, the TTFT SLO: admitted requests then
    # start in time instead of late. Nothing ahead: always admitted. A prompt too long to
    # meet it alone is judged on the queue wait. 0: off (queue bounds only).
    ttft_target_s: float = 1.0
    # With running slots free, refuse only past ttft_target_s * ttft_slack. 1: a strict
    # door, every admitted request expected within the target (clients that retry a 429
    # as told: the openai SDK, a router). Above 1, for load generators that count a 429
    # as a failure: prompts that arrived together are admitted late rather than refused
    # (a refused client that comes back finds the same work ahead).
    ttft_slack: float = 1.0
    # A request whose prefix (a new system prompt) a running prefill is still computing
    # cannot start before that prefix is in. False: judged on the target like any other,
    # so refused with a Retry-After of when the prefix is expected in and admitted then,
    # its prefix cached (the first burst after a start: every admitted request within
    # the target). True: admitted behind that prefill whenever no replica would serve it
    # sooner, for load generators that count a 429 as a failed request (GuideLLM's).
    queue_prefix_followers: bool = False
    # The door judges a predicted TTFT times how late first tokens have come against
    # their predictions (the p90 of the last 64, within 1-1.5) once 16 are known; before
    # that, times this: a fresh server's predictions rest on warm-up figures and came
    # ~2x early in a first burst (docs/benchmarks.md, "The defaults"). 1: trust them.
    ttft_factor_uncalibrated: float = 1.5
    prefix_cache: bool = True
    kv_reserve_pages: int = 8  # admission keeps this many pages free for running decodes
    # The inter-token latency target (0: ITL planning off). A step that carries prompt
    # tokens beside running decodes is the gap between two tokens of every stream in it,
    # so its prompt chunks are sized to a budget: this target where the decodes alone
    # leave room under it (the seed's 50 ms), else what the learned step costs allow,
    # decode-only step time * (1 + prefill_slowdown) (on a 2-core CPU 16 streams' decodes
    # alone take ~50 ms: prompts must still move). A prompt that would miss ttft_target_s
    # at that pace gets the bigger chunks its first token needs (`Scheduler._ttft_chunk`);
    # one that cannot make the target at any pace (a long document) keeps the budget's.
    # Each step's plan says which rule sized it (/v1/stats, the dashboard, the metric
    # sluice_steps_total{plan}). scheduler/step_cost.py.
    itl_target_s: float = 0.05
    # True: every step is held to itl_target_s, the running set included: a request joins
    # only while a step of all running decodes and a reserved prompt chunk still fits, the
    # least urgent decodes are preempted when their contexts grow past it, and a request
    # that cannot then meet ttft_target_s is refused at once (429, reason "itl_target").
    # The number of streams follows from the target (docs/operations.md, "The ITL target").
    itl_strict: bool = False
    # Overlapped scheduling: plan and launch step N+1 while step N computes, its sampled
    # tokens fed to N+1 on the device; N's tokens are committed and delivered while N+1
    # runs. Host work then leaves the computation idle only where it is longer than a
    # step. Outputs are token for token those without it. A step holding a sequence that
    # needs its last token on the host (structured output, penalties) is waited for.
    overlap: bool = True
    # The ITL budget's share for prompts where the decodes alone fill the target: a step
    # carrying prefill may take decode-only step time * (1 + this); at least
    # min_prefill_tokens a step, so long prompts move.
    prefill_slowdown: float = 0.4
    min_prefill_tokens: int = 16
    short_prefill_tokens: int = 256  # a prompt of at most this many uncached tokens: whole
    # ... or, beside running decodes, spread over as many chunks (each at least a long
    # prompt's) as ttft_target_s leaves room for, to keep the streams' token gaps short.
    split_short_prefill: bool = True
    # ... but only once such prompts arrive often enough that prefilling each whole would
    # stall more than this share of a stream's token gaps (arrivals a second, over the
    # last 10 s, times the streams' recent mean gap). Rarer, a whole prefill's one long gap
    # stays out of the p95 the ITL SLO is stated in, and the prompt gets its first token
    # sooner. 0: spread whenever decodes run.
    short_prefill_stall_share: float = 0.04
    # Batch jobs run in idle capacity (scheduler/background.py): beside interactive decodes
    # a step may grow by at most this fraction for batch work, and batch sequences are
    # admitted only while this fraction of the KV pages stays free.
    batch_slowdown: float = 0.1
    batch_kv_reserve: float = 0.2
    # Speculative decoding (scheduler/speculative.py): "ngram" proposes the tokens that
    # followed the last `ngram_max`..`ngram_min` tokens' latest earlier occurrence in the
    # prompt and output (prompt lookup), verified in spare decode rows of the same step;
    # output is token for token what plain decoding gives. Per sequence, k follows its
    # acceptance, up to num_speculative_tokens; a step proposes only where the step-cost
    # model says the tokens per second go up within the ITL target, never beside a prompt
    # chunk. "off": never.
    # "draft": a smaller model of the same tokenizer (`draft_model`, a model source as
    # `model` takes) guesses greedily, with its own KV pool (a quarter of
    # kv_cache_bytes) and the pool's compiled shapes (model/draft.py).
    speculative: Literal["off", "ngram", "draft"] = "ngram"
    num_speculative_tokens: Annotated[int, msgspec.Meta(ge=1, le=16)] = 4
    draft_model: str | None = None
    ngram_min: Annotated[int, msgspec.Meta(ge=1)] = 2
    ngram_max: Annotated[int, msgspec.Meta(ge=1)] = 4

    @property
    def strict_itl_s(self) -> float:
        """The ITL target every step is held to, the running set included (`itl_strict`),
        or 0: the target then sizes prompt chunks only."""
        return self.itl_target_s if self.itl_strict else 0.0


Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0)]


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The HTTP face: where to listen and how much one process admits."""

    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000  # 0: an ephemeral port
    # A chat request is text; 4 MiB is far past any context we serve and still refuses
    # someone streaming gigabytes at the JSON decoder.
    max_body_bytes: Positive = 4 * 1024 * 1024
    # SIGINT/SIGTERM: stop admitting, give running streams this long, then end them.
    drain_grace_s: Seconds = 30.0
    # A client that stops reading (its socket buffers full, no byte acknowledged) is cut
    # after this long: the connection is closed, its request aborted, its pages freed.
    # Linux's TCP_USER_TIMEOUT on the listening sockets (app/server.py); 0: never.
    client_stall_s: Seconds = 60.0
    # Requests admitted at once (streaming or not), across all pools. Past saturation trio
    # serves every task in turn, so an unbounded number of streams slows everyone's token
    # gaps; beyond this bound a request gets 429 instead.
    max_streams: Positive = 512
    # SSE: put every token that piled up while the client was slow into one write (one
    # write costs ~100 us of CPU in hypercorn/h11 whatever its size).
    sse_coalesce: bool = True
    # Extra wait before each write to let more tokens pile up (0: write as soon as a token
    # is there). Trades a little inter-token latency for CPU under heavy load.
    sse_flush_interval_s: Seconds = 0.0
    # SHA-256 of the key that may load and unload LoRA adapters at run time
    # (POST /v1/load_lora_adapter, /v1/unload_lora_adapter). None: those endpoints are off.
    admin_api_key_sha256: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")] | None = None
    # The web console: the chat page at / and the live dashboard at /dashboard (static
    # files in app/static; their API calls carry the key). False: neither is served.
    console: bool = True
    # One line per finished request on the "sluice.requests" logger (id, tenant, model,
    # outcome, token counts, latency). "metadata": never any prompt or output text;
    # "hash": plus a SHA-256 prefix of each (match a complaint to a request without
    # keeping the text); "truncate": plus their first 64 characters; "off": no line.
    log_requests: Literal["off", "metadata", "hash", "truncate"] = "metadata"
    # Requests (streams included) one client IP may have in flight at once; more get 429
    # (app/limits.py). 0: no limit. Behind a proxy every client shares its IP: keep 0.
    max_connections_per_ip: NonNegative = 0
    # The listen queue: connections the kernel completes before the server accepts them.
    # A flood of new connections past it waits for a SYN retry (1 s, then 3 s) before the
    # door can even say no. The kernel caps it at net.core.somaxconn (4096 on current Linux).
    listen_backlog: Positive = 4096
    # Linux: the nice value of every thread but the event loop's (the model's compute
    # threads), so that accepting, parsing and refusing are not starved while steps hold
    # every core (app/priority.py). 0: leave them be.
    compute_nice: Annotated[int, msgspec.Meta(ge=0, le=19)] = 10


class AdapterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A LoRA adapter in the PEFT layout, served on its pool's base model as `name`."""

    name: Annotated[str, msgspec.Meta(min_length=1)]
    path: str  # a directory with adapter_config.json and adapter_model.safetensors


class PoolConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One model served by `replicas` engines, each with its own runner and KV pool."""

    name: str = "default"
    # "embedded", a .gguf path, a Hugging Face directory, an orbax directory, or
    # "random:<preset>" (random weights of real shapes, for tests and benchmarks).
    model: str = "embedded"
    # Names clients put in "model"; the first one is what responses report.
    served_model_names: Annotated[list[str], msgspec.Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: ["smollm2-135m-instruct"]
    )
    replicas: Positive = 1
    max_context: Positive | None = None  # None: the model's own limit
    # Used when a request names no max_tokens (None: whatever context is left).
    default_max_tokens: Positive | None = None
    page_size: Positive = 16
    kv_cache_bytes: Positive = 512 * 1024 * 1024
    # Compiled step shapes: a step of d decoding sequences and p prompt tokens runs in the
    # smallest compiled shape that holds it. Compiled: each decode bucket alone, and each
    # prefill bucket beside each of `mixed_decode_buckets` decodes (0: prompt-only steps).
    # Each shape costs ~2 s of compile and ~27 MB of host memory on the CPU; the
    # padding a coarser set costs is measured in docs/history/benchmarks-log.md. Steady state never
    # compiles.
    decode_buckets: Annotated[list[Positive], msgspec.Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: [1, 4, 8, 16]
    )
    # Prompt tokens in a step, padded up to one of these (each a multiple of 16, the
    # attention's query block); up to `max_prefill_seqs` prompts' chunks share a step.
    prefill_buckets: Annotated[list[Positive], msgspec.Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: [16, 32, 64, 96, 128, 256]
    )
    mixed_decode_buckets: Annotated[list[NonNegative], msgspec.Meta(min_length=1)] = (
        msgspec.field(default_factory=lambda: [4, 16]))
    max_prefill_seqs: Positive = 4
    # "background": serve once the few shapes a first request needs are compiled (seconds)
    # and compile the rest in a background thread; a step uses the smallest ready shape.
    # "full": compile every shape before serving (minutes on a 2-core CPU).
    warmup: Literal["background", "full"] = "background"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: f32 on CPU, bf16 on GPU
    # CPU only: "int8" keeps the layers' projections and the lm_head as int8 weights in
    # 32-value blocks, multiplied by the native kernel in every shape (model/quant.py);
    # their f32 copies are not kept. "auto": int8 on the CPU (f32 dtype) where the kernel
    # builds, else none; "none": the weights as loaded (f32 on the CPU). "q4_1": the
    # projections in llama.cpp's Q4_1 blocks (a Q4_1 GGUF's own; others quantized at
    # load) times activations rounded to int8 per block of 32, the lm_head int8: half the
    # weight bytes and integer products (CPUs with AVX2; docs/history/benchmarks-log.md has its
    # accuracy against f32).
    quantization: Literal["auto", "none", "int8", "q4_1"] = "auto"
    # What the KV pool stores: "auto" the model's dtype (f32 on the CPU, bf16 on GPUs);
    # "bfloat16" on the CPU keeps bf16 bit patterns that the native attention kernels
    # widen as they read: twice the tokens in `kv_cache_bytes`, half the bytes a step
    # reads; "int8" (CPU) int8 rows with a scale each, 1.9x bf16's tokens (docs/
    # operations.md, "KV cache dtype").
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "int8"] = "auto"
    # Attention backend (pallas_kernels): auto = "pallas" on a GPU, "cpu" elsewhere.
    attention: Literal["auto", "cpu", "pallas", "pallas_interpret", "dense"] = "auto"
    scheduler: SchedulerConfig = SchedulerConfig()
    # Prompt-length routing: a request goes to a pool serving its model whose range holds
    # the prompt (e.g. a long-context pool with min_prompt_tokens = 8192).
    min_prompt_tokens: NonNegative = 0
    max_prompt_tokens: Positive | None = None
    # LoRA adapters (docs/operations.md, "Adapters"): `max_loras` device slots (0: no
    # adapters, and steps carry no LoRA code), each holding one adapter of rank up to
    # `max_lora_rank` for all seven projections; host memory keeps up to `max_cpu_loras`
    # more ready to copy in (None: as many as there are slots; the rest are re-read from
    # disk when needed). Adapters listed here load at start; more at run time.
    max_loras: NonNegative = 0
    max_lora_rank: Positive = 16
    max_cpu_loras: NonNegative | None = None
    adapters: list[AdapterConfig] = []
    # Devices (docs/operations.md, "Devices and tensor parallelism"): each replica runs on
    # `tensor_parallel` devices (weights and KV pool split over them, model/tp.py), replica
    # i on the i-th group of `devices` (JAX device ids; exactly replicas x tensor_parallel
    # of them). None: JAX's default device for tensor_parallel = 1, else groups from
    # device 0 on, wrapping around. Two pools' explicit `devices` may not overlap.
    devices: list[NonNegative] | None = None
    tensor_parallel: Positive = 1
    # The KV cache's tiers below the device pool (docs/operations.md, "KV tiers"): prefix
    # pages evicted from the pool move to a host buffer of `kv_host_bytes` (0: off; at
    # least 32 pages) and from there to files under `kv_disk_dir` (None: no disk tier; up
    # to `kv_disk_bytes`, kept across restarts), and a prompt that continues there copies
    # them back up instead of computing them.
    kv_host_bytes: NonNegative = 0
    kv_disk_dir: str | None = None
    kv_disk_bytes: NonNegative = 4 * 1024 * 1024 * 1024
    # Disaggregated prefill and decode (docs/operations.md, "Prefill and decode apart"):
    # a "prefill" pool computes prompts for decode pools (in other servers: POST
    # /internal/prefill, the prompt's KV pages back; in this one, named "pool:NAME");
    # a "decode" pool sends every prompt with at least `remote_prefill_min_tokens` tokens
    # it has not cached to one of `prefill_urls` (least loaded first; another, then its
    # own replica, when one fails), takes the pages into its pool and streams the answer.
    # "both": prefill and decode here, as one replica does. A prefill pool in the same
    # server as a decode pool of its model takes no client requests.
    role: Literal["both", "prefill", "decode"] = "both"
    prefill_urls: list[str] = []
    remote_prefill_min_tokens: NonNegative = 256
    # Seconds a prefill server may take to answer before its request is retried elsewhere.
    remote_prefill_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    # Sliding-window layers (Gemma 3) on KV pages of their own, freed past the window
    # (docs/operations.md, "Sliding windows"): the global layers get the memory they
    # leave. false: every layer on the one pool, as with the KV tiers (which need it).
    window_pages: bool = True

    def __post_init__(self) -> None:
        if self.devices is not None:
            need = self.replicas * self.tensor_parallel
            if len(self.devices) != need:
                raise ValueError(f"pools[{self.name}].devices: {len(self.devices)} devices "
                                 f"for replicas x tensor_parallel = {need}")
            if len(set(self.devices)) != len(self.devices):
                raise ValueError(f"pools[{self.name}].devices has duplicates: {self.devices}")
        if self.adapters and not self.max_loras:
            raise ValueError(f"pool {self.name!r} lists adapters but max_loras is 0: give it "
                             "at least one adapter slot")
        names = [a.name for a in self.adapters]
        clash = sorted({n for n in names if names.count(n) > 1 or n in self.served_model_names})
        if clash:
            raise ValueError(f"adapter names must be unique and differ from the served model "
                             f"names: {', '.join(clash)}")
        if self.role == "decode" and not self.prefill_urls:
            raise ValueError(f"pools[{self.name}].role = \"decode\" needs prefill_urls (the "
                             "prefill servers' base URLs)")
        if self.prefill_urls and self.role != "decode":
            raise ValueError(f"pools[{self.name}].prefill_urls is for role = \"decode\"")
        if bad := [u for u in self.prefill_urls
                   if not u.startswith(("http://", "https://", "pool:"))]:
            raise ValueError(f"pools[{self.name}].prefill_urls: not an http(s) URL or "
                             f"pool:NAME: {bad[0]}")
        odd = [b for b in self.prefill_buckets if b % 16]
        if odd:
            raise ValueError(f"prefill_buckets must be multiples of 16 (the attention's "
                             f"query block): {odd}")
        # Every step's decodes fit beside a prompt chunk. With speculative decoding,
        # decode buckets past the streams (max_running) hold verify rows, which never
        # share a step with a prompt chunk (scheduler/speculative.py).
        streams = (min(self.scheduler.max_running, max(self.decode_buckets))
                   if self.scheduler.speculative != "off" else max(self.decode_buckets))
        if max(self.mixed_decode_buckets) < streams or (
                max(self.mixed_decode_buckets) not in self.decode_buckets):
            raise ValueError(f"mixed_decode_buckets {self.mixed_decode_buckets} must include "
                             f"the largest decode bucket ({max(self.decode_buckets)}): the "
                             "largest shape holds every step (with speculative decoding: "
                             f"a decode bucket of at least max_running, {streams})")
        if len(set(self.served_model_names)) != len(self.served_model_names):
            raise ValueError(f"served_model_names has duplicates: {self.served_model_names}")
        if (self.scheduler.speculative == "draft") != bool(self.scheduler.draft_model):
            raise ValueError(f"pools[{self.name}].scheduler: speculative = \"draft\" and "
                             "draft_model go together (the draft model's source)")
        if self.kv_disk_dir and not self.kv_host_bytes:
            raise ValueError(f"pools[{self.name}].kv_disk_dir needs kv_host_bytes > 0: pages "
                             "read from disk land in the host tier")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < self.min_prompt_tokens:
            raise ValueError(
                f"max_prompt_tokens ({self.max_prompt_tokens}) must be >= "
                f"min_prompt_tokens ({self.min_prompt_tokens})"
            )


class TenantConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A client identified by its API key. Only the key's SHA-256 is stored.

    Make one with ``printf %s "$KEY" | sha256sum``.
    """

    name: str
    api_key_sha256: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
    # Priority class: the most urgent priority this tenant's requests may ask for (smaller
    # is more urgent, as in vLLM); a request's own `priority` can only be less urgent.
    priority: int = 0
    max_concurrency: Positive | None = None  # requests in flight at once; None: no limit
    # Token-rate quota (prompt + max_tokens charged at admission, the unused part
    # refunded at the end); None: no limit. The bucket holds one minute's worth.
    tokens_per_minute: Positive | None = None
    weight: Annotated[float, msgspec.Meta(gt=0)] = 1.0  # fair share inside the engine
    # Sequences of this tenant running at once in a replica; more wait in its queue (still
    # admitted, unlike past max_concurrency: 429). None: no limit.
    max_running: Positive | None = None
    # How long its requests may wait in a queue before being shed; None: the pool's
    # `queue_deadline_s` (a tenant sending background work may wait longer).
    queue_deadline_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    share_prefix_cache: bool = False  # let prefix-cache hits cross into other tenants
    # LoRA adapters this tenant may ask for by name (None: any; []: only base models).
    adapters: list[str] | None = None
    # Batch jobs: prompt + max_tokens not yet run, over all its batches (None: the
    # [batches] max_pending_tokens).
    max_batch_tokens: Positive | None = None


class GuardrailConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Optional check sidecars (off when the URL is None).

    Each gets a JSON POST and answers ``{"allowed": bool, "reason": str}``. A check that
    errs or outlives its budget lets the text through when fail-open, refuses it when
    fail-closed.
    """

    input_url: str | None = None
    input_budget_ms: Annotated[float, msgspec.Meta(gt=0)] = 200.0
    input_fail_open: bool = True
    output_url: str | None = None
    output_budget_ms: Annotated[float, msgspec.Meta(gt=0)] = 200.0
    output_fail_open: bool = True
    # Streamed text is checked (and held back) a window of this many characters at a time.
    output_window_chars: Positive = 256


class BatchConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Batch jobs (`/v1/files` + `/v1/batches`, docs/operations.md "Batch jobs"): stored in
    SQLite under `data_dir`, run in idle capacity, each by its deadline."""

    enabled: bool = True
    # Where the store lives (None: $SLUICE_DATA_DIR, else ~/.local/share/sluice). One
    # server per directory: a second one refuses to start.
    data_dir: str | None = None
    max_file_bytes: Positive = 200 * 1024 * 1024  # an uploaded JSONL file
    max_requests: Positive = 50_000  # lines in one batch
    # Prompt + max_tokens of a tenant's requests not yet run, over all its batches (a
    # tenant's own `max_batch_tokens` wins).
    max_pending_tokens: Positive = 50_000_000
    # Batch requests handed to each replica's engine at once (the rest wait in the store).
    max_in_flight: Positive = 16
    max_window_s: Annotated[float, msgspec.Meta(gt=0)] = 30 * 86400.0
    # The same store keeps `/v1/responses` answers (`store`, `previous_response_id`,
    # `GET /v1/responses/{id}`) this long, as OpenAI does (30 days).
    response_retention_s: Annotated[float, msgspec.Meta(gt=0)] = 30 * 86400.0


class Settings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    server: ServerConfig = ServerConfig()
    pools: Annotated[list[PoolConfig], msgspec.Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: [PoolConfig()]
    )
    tenants: list[TenantConfig] = []
    guardrails: GuardrailConfig = GuardrailConfig()
    batches: BatchConfig = BatchConfig()

    def __post_init__(self) -> None:
        for what, names in (
            ("pool name", [p.name for p in self.pools]),
            ("tenant name", [t.name for t in self.tenants]),
            ("tenant api_key_sha256", [t.api_key_sha256 for t in self.tenants]),
        ):
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"duplicate {what}: {', '.join(dup)}")
        by_name = {p.name: p for p in self.pools}
        for p in self.pools:
            for u in p.prefill_urls:
                if not u.startswith("pool:"):
                    continue
                other = by_name.get(u[len("pool:"):])
                if other is None or other.role != "prefill" or other.model != p.model:
                    raise ValueError(f"pools[{p.name}].prefill_urls: {u} is not a pool of "
                                     f"role \"prefill\" serving {p.model}")
        pinned = [p for p in self.pools if p.devices is not None]
        for i, a in enumerate(pinned):
            for b in pinned[i + 1:]:
                if shared := sorted(set(a.devices) & set(b.devices)):
                    raise ValueError(f"pools[{b.name}].devices overlaps pools[{a.name}].devices "
                                     f"(device {', '.join(map(str, shared))}): pinned pools "
                                     "get devices of their own")


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the key."""


DEFAULT_PRESET = Path(__file__).with_name("default.toml")


def load_settings(path: str | Path | None = None) -> Settings:
    """Decode a TOML preset; `None` reads the packaged default.toml."""
    path = DEFAULT_PRESET if path is None else path
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e.strerror or e}") from None
    try:
        return msgspec.toml.decode(data, type=Settings)
    except msgspec.ValidationError as e:
        # msgspec says "<what was expected> - at `$.pools[0].page_size`": put the key first.
        what, sep, where = str(e).rpartition(" - at ")
        key = where.strip("`") if sep else "$"
        raise ConfigError(f"{path}: {key}: {what if sep else e}") from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
