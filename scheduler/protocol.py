"""The narrow waist between policy and compute.

The scheduler decides *what* runs each iteration and describes it as a `StepPlan`; a
`Runner` (the JAX model runner in `model/runner.py`, or a deterministic fake in the tests)
decides *how*. Nothing here imports JAX or trio, so the whole policy is testable on a
laptop with a fake runner whose outputs can be worked out by hand.

Invariants a runner may rely on:
- every chunk's `page_table` covers positions ``[0, start_pos + len(token_ids))``;
  page ids are in ``[1, num_pages)`` (page 0 is the null page that padding writes to);
- the pages a chunk writes (positions ``start_pos ..``) are owned by that sequence alone
  (shared prefix pages are never written: copy-on-write happens through `copies`);
- `copies` run before any chunk of the same plan reads or writes the pool;
- `adapter_loads` fill their adapter slots before the step, and a chunk's `adapter_slot`
  holds its adapter for as long as the sequence runs;
- a `pending` chunk (overlapped scheduling) is a decode of the token its sequence sampled
  in the step launched just before this one: the runner takes that token from where its
  sampler left it (on the device), not from `token_ids`;
- a chunk with `draft` k > 0 (speculative decoding, scheduler/speculative.py) is the
  sequence's last known token followed by k proposed ones: the runner computes each of
  its k + 1 positions as a decode row (all within `max_decode_seqs`, with `sample`) and
  samples at every one as if the proposals before it were the sequence's own tokens:
  the row of proposal i draws with key ``num_generated + i`` and counts the proposals
  before it for penalties, and its `constraint` is the grammar after them (`after`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings, as the OpenAI API names them.

    `temperature == 0` means greedy. `seed` makes sampling reproducible per request,
    whatever else shares the batch: the runner derives the key for the n-th generated
    token from (seed, n) alone.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    top_logprobs: int = 0  # 0..20
    # (token id, bias) added to the logits before sampling (OpenAI's `logit_bias`;
    # -100 bans a token, +100 all but forces it). Logprobs stay the model's own.
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass(slots=True)
class SeqChunk:
    """One sequence's share of a step: new tokens to run through the model."""

    seq_id: int  # stable small integer for the sequence's lifetime (not the request uuid)
    token_ids: Sequence[int]  # tokens whose K/V this step computes and writes (len >= 1)
    start_pos: int  # position of token_ids[0]; tokens before it are already in the pool
    page_table: Sequence[int]  # page ids covering [0, start_pos + len(token_ids))
    sample: bool  # True when the chunk ends at the last known token: sample the next one
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_generated: int = 0  # tokens generated so far (keys the seeded PRNG stream)
    # Tokens that penalties count (generated tokens; the prompt counts for repetition_penalty).
    penalty_token_ids: Sequence[int] = ()
    prompt_token_ids: Sequence[int] = ()
    adapter_slot: int = -1  # the LoRA adapter slot its tokens run under; -1: the base model
    # Structured output (model/grammar.py): writes the tokens allowed next into a bitmask
    # row (`fill`) when the chunk samples; None: any token.
    constraint: Any = None
    # Prompt logprobs (completions' `echo` with `logprobs`): per token of `token_ids`, the
    # prompt token that follows it (-1: none to score). Empty: nothing to score. The
    # runner answers with each scored token's logprob and top `score_top` alternatives.
    score_targets: Sequence[int] = ()
    score_top: int = 0
    # Overlapped scheduling: the chunk's one token is the one this sequence sampled in the
    # step launched just before (not known on the host yet; `token_ids` holds -1). Only a
    # one-token decode chunk is ever pending.
    pending: bool = False
    # Speculative decoding: the last `draft` tokens of `token_ids` are proposals, not yet
    # the sequence's; each of the chunk's positions samples (`StepResult.drafted`).
    draft: int = 0
    # The sliding layers' page table where their pages are numbered apart
    # (`StepLimits.window_pool`, scheduler/window_pages.py): same positions as
    # `page_table`, page 0 where a page fell out of the window and went back.
    window_table: Sequence[int] = ()


@dataclass(slots=True)
class StepPlan:
    """Everything one iteration asks of the runner.

    Decode chunks (one token) come first, then prefill chunks. The scheduler keeps
    ``len(chunks)`` and the token total within the runner's `StepLimits`.
    """

    chunks: list[SeqChunk]
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src_page, dst_page)
    # The KV tiers (scheduler/kv_tiers.py), run in this order before `copies`: device pages
    # copied down to host slots (page, slot, key, meta: what the slot then holds, for
    # the disk tier), and host slots copied up into device pages (slot, page).
    swap_out: list[tuple[int, int, int, tuple]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Pages another replica computed (disaggregated prefill, app/disagg.py), written into
    # fresh pages of this pool between the copies down and up: (pages, the exporting
    # runner's `export_pages` result, whose pages go to `pages` in order).
    imports: list[tuple[list[int], Any]] = field(default_factory=list)
    adapter_loads: list[tuple[int, str]] = field(default_factory=list)  # (slot, adapter)
    # (src, dst) copies of the sliding layers' own pages (`SeqChunk.window_table`), run
    # beside `copies`.
    window_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class StepResult:
    """What came back: one sampled token per chunk whose `sample` was True, keyed by seq_id."""

    sampled: dict[int, SampledToken]
    padded_tokens: int = 0  # tokens computed including bucket padding
    real_tokens: int = 0  # tokens that belonged to a chunk
    device_seconds: float = 0.0  # time spent inside the runner for this step
    shape: tuple[int, int] | None = None  # the compiled (decode rows, prefill tokens) it ran in
    host_seconds: float = 0.0  # of device_seconds, the runner's own host work (packing, unpacking)
    logits: dict[int, object] | None = None  # seq_id -> [vocab] floats, only when asked (tests)
    # seq_id -> per token of a chunk with `score_targets`: the logprob of its target (a
    # SampledToken: the target's id, logprob, top alternatives), None where it had none.
    prompt_logprobs: dict[int, list] = field(default_factory=dict)
    # seq_id -> why its row could not be sampled (the model's logits were NaN or infinite):
    # that request fails alone; it has no entry in `sampled`.
    failed: dict[int, str] = field(default_factory=dict)
    # Seconds the computation stood idle between the previous step's end and this step's
    # start (0: not measured). Overlapped scheduling exists to bring it to zero.
    idle_seconds: float = 0.0
    # Seconds `collect` (or `step`) blocked waiting for the computation to finish (0: not
    # measured): the rest of an iteration is host work.
    wait_seconds: float = 0.0
    # Seconds the runner spent copying this plan's `swap_in` pages up from host slots
    # (0: none): the KV tiers' measured copy rate (scheduler/kv_tiers.py `worth`).
    swap_in_seconds: float = 0.0
    # seq_id -> the tokens sampled at each position of a chunk with `draft` k: k + 1 of
    # them in order (fewer where a row failed; `sampled` holds the first).
    drafted: dict[int, list] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StepLimits:
    """What the runner can take in one step (derived from its compiled buckets)."""

    max_decode_seqs: int  # decode chunks (1 token each) per step
    max_prefill_seqs: int  # prefill chunks per step
    max_prefill_chunk: int  # tokens in one prefill chunk
    max_prefill_tokens: int  # all prefill tokens in one step
    # The compiled (decode rows, prefill tokens) shapes a step runs in, the smallest that
    # holds it (empty: not known); each prefill chunk is padded to whole `block_q` blocks.
    shapes: tuple[tuple[int, int], ...] = ()
    block_q: int = 1
    # Sliding-window layers with pages of their own (scheduler/window_pages.py): their
    # window in keys and their pool's pages, the null page included; 0: none (every
    # layer reads the one numbering of `page_table`).
    window: int = 0
    window_pool: int = 0

    def window_pages_per_seq(self, page_size: int) -> int:
        """The most sliding pages a running sequence holds at once: the window before
        its chunk's first query, the chunk (a prompt chunk, or a decode row's proposals),
        a page boundary each side, and one more while a shared page is copied."""
        chunk = max(self.max_prefill_chunk, self.max_decode_seqs)
        return (self.window + chunk - 2) // page_size + 3


class RunnerLost(RuntimeError):
    """The runner can never step again: a process of its multi-host replica is gone
    (model/multihost.py). The engine dies at once instead of counting failed steps."""


class Runner(Protocol):
    """What the scheduler needs from a model runner. A runner that can be lost between
    steps (a multi-host replica) also has `lost: str | None` (why; None while whole),
    which the engine polls while idle."""

    page_size: int
    num_pages: int  # including the null page 0
    max_context: int  # positions the model supports
    eos_token_ids: frozenset[int]
    adapter_slots: int  # LoRA adapters it can hold at once (0: none)
    # (decode rows, prefill tokens, seconds) of its compiled shapes' timed warm-up runs,
    # appended as they compile: the step-cost model's estimates before any real step.
    warmup_times: list[tuple[int, int, float]]

    @property
    def limits(self) -> StepLimits: ...

    def step(self, plan: StepPlan) -> StepResult:
        """Run one step. Called from a worker thread, one at a time."""
        ...

    # A runner that can overlap (scheduler/engine.py) also has the two halves of `step`:
    # `launch(plan)` packs the plan and starts its computation without waiting for it
    # (returns a handle), `collect(handle)` waits for that step and returns its
    # StepResult. Steps are collected in launch order, at most one launched ahead; a
    # plan launched while another is uncollected may hold `pending` chunks.

    def drop_adapter(self, name: str) -> None:
        """Forget an adapter no live sequence uses any more (it was unloaded)."""
        ...

    # A runner that serves disaggregated prefill (app/disagg.py) also has
    # `export_pages(pages) -> Any`: those pool pages' contents, queued behind the steps
    # launched so far (so it reads what they wrote) and ahead of any that may overwrite
    # them; the result's `to_host()` waits for the copy and returns them
    # ([n, K/V, layer, position, kv head, row]). Called on the engine's thread.


class IncrementalDecoder(Protocol):
    def push(self, token_id: int) -> str:
        """Feed one token; return text that is now final (never half a UTF-8 character)."""
        ...

    def flush(self) -> str:
        """End of stream: whatever is still held back."""
        ...


class Detokenizer(Protocol):
    def incremental(self, prompt_ids: Sequence[int]) -> IncrementalDecoder: ...
