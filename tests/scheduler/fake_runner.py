"""A deterministic stand-in for the model runner, and a detokenizer to go with it.

`FakeRunner` keeps a fake KV pool: every chunk writes its token ids into the slots its
page table names, and a sampled token is computed from the context *read back from the
pool* through the page table. A wrong page table, a missing copy-on-write, a shared page
that got overwritten or a bad prefix-cache hit therefore changes the output, and the
tests compare outputs against `reference()`, which applies the same rule to a plain
list. The default rule is a position-weighted sum of the context, modulo the vocabulary:
computable by hand, and sensitive to every token and its position.

It also checks the `StepPlan` invariants the real runner relies on (page ids in range,
page tables covering the chunk, limits, no chunk writing a page another chunk reads) and
records every plan as plain tuples (page tables are live lists in the engine).

Overlapped scheduling: `launch` computes the step at once and `collect` hands its result
back. A `pending` chunk's token is the one the fake sampled for that sequence in the step
launched just before (anything else fails the step), so an engine that fed a wrong or
stale token would make the outputs differ from `reference()`.

KV tiers: with `host_slots`, the fake keeps host slots of page contents (and with `disk`
a dict of files by key, their meta beside them) and runs a plan's `swap_out` and
`swap_in` before its copies, as the real runner does: a page copied up from the wrong
slot, or a slot reused before it was read, changes the output too.

Sliding-window pages: with `limits.window_pool`, the fake keeps a second pool for the
sliding layers' own pages (scheduler/window_pages.py): each chunk writes its tokens there
too, through its `window_table`, the plan's `window_copies` run on it, and every sampling
query checks that the sliding pool holds, for each key of its window, the token the
global pool holds: a page released too early, reused while still seen, or a wrong window
tail taken as a prefix hit fails the step.

LoRA adapters: the fake holds `adapter_slots` slots, filled by the plan's
`adapter_loads`; a chunk's tokens run under the adapter its slot holds *now*, which adds
`adapter_offset(name)` to the rule's token. A sequence whose slot was given to another
adapter, or never loaded, thus produces other tokens than `reference(..., adapter=...)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from scheduler.protocol import SampledToken, StepLimits, StepPlan, StepResult


def sum_rule(vocab: int) -> Callable[[Sequence[int]], int]:
    def rule(ctx: Sequence[int]) -> int:
        return sum((i % 7 + 1) * t for i, t in enumerate(ctx)) % vocab
    return rule


def succ_rule(vocab: int) -> Callable[[Sequence[int]], int]:
    """Next token = last token + 1: for tests that need a hand-written token stream."""
    def rule(ctx: Sequence[int]) -> int:
        return (ctx[-1] + 1) % vocab
    return rule


def adapter_offset(name: str | None) -> int:
    return 0 if name is None else 1 + sum(map(ord, name)) % 97


@dataclass(frozen=True)
class ChunkRecord:
    seq_id: int
    start_pos: int
    token_ids: tuple[int, ...]
    page_table: tuple[int, ...]
    sample: bool
    num_generated: int
    adapter_slot: int = -1
    pending: bool = False  # its token came from the step before (resolved here)
    draft: int = 0  # a speculative verify: its last `draft` tokens are proposals
    window_table: tuple[int, ...] = ()


@dataclass(frozen=True)
class PlanRecord:
    chunks: tuple[ChunkRecord, ...]
    copies: tuple[tuple[int, int], ...]
    adapter_loads: tuple[tuple[int, str], ...] = ()
    window_copies: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def decodes(self) -> tuple[ChunkRecord, ...]:
        return tuple(c for c in self.chunks if len(c.token_ids) == 1 and c.sample)


class FakeTierStore:
    """The fake's host slots and disk (`FakeRunner(host_slots=...)`)."""

    def __init__(self, host_slots: int, page_size: int, disk: bool) -> None:
        self.host_slots = host_slots
        self.page_bytes = page_size
        self.host: list[list[int | None] | None] = [None] * host_slots
        self.disk: dict[int, tuple] | None = {} if disk else None  # key -> (meta, page)
        self.loads = 0

    def load(self, job) -> None:
        ok = []
        for slot, key, meta in zip(job.slots, job.keys, job.metas):
            found = self.disk.get(key) if self.disk is not None else None
            good = found is not None and found[0] == meta
            if good:
                self.host[slot] = list(found[1])
            ok.append(good)
        job.ok = ok
        self.loads += 1


class FakeRunner:
    def __init__(
        self,
        *,
        page_size: int = 4,
        num_pages: int = 256,
        max_context: int = 4096,
        vocab: int = 1000,
        eos: Sequence[int] = (),
        limits: StepLimits = StepLimits(max_decode_seqs=16, max_prefill_seqs=4,
                                        max_prefill_chunk=64, max_prefill_tokens=128),
        rule: Callable[[Sequence[int]], int] | None = None,
        adapter_slots: int = 0,
        host_slots: int = 0,
        disk: bool = False,
    ) -> None:
        self.kv_store = FakeTierStore(host_slots, page_size, disk) if host_slots else None
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_context = max_context
        self.vocab = vocab
        self.eos_token_ids = frozenset(eos)
        self._limits = limits
        self.rule = rule or sum_rule(vocab)
        self.pool: list[list[int | None]] = [[None] * page_size for _ in range(num_pages)]
        self.window_pool: list[list[int | None]] = [
            [None] * page_size for _ in range(limits.window_pool)]
        self.plans: list[PlanRecord] = []
        self.fail_next = 0  # raise in the next N steps
        self.on_step: Callable[[StepPlan], None] | None = None  # runs in the worker thread
        self.adapter_slots = adapter_slots
        self.warmup_times: list[tuple[int, int, float]] = []  # tests may fill it
        self.device_seconds = 0.0  # what each step reports as its time (0: none)
        self.slots: list[str | None] = [None] * adapter_slots  # what each slot holds
        self.dropped: list[str] = []  # adapters the engine said nothing needs any more
        self.registered: set[str] | None = None  # None: any name loads (scheduler tests)
        self.can_overlap = True  # what the engine asks before it overlaps steps
        self._last_sampled: dict[int, int] = {}  # the last launched step's tokens

    def add_adapter(self, adapter) -> None:
        """Register an adapter (anything with `.name`); once any is, loading an unknown
        one into a slot fails the step, as the real runner's does."""
        if self.registered is None:
            self.registered = set()
        self.registered.add(adapter.name)

    def drop_adapter(self, name: str) -> None:
        self.dropped.append(name)
        if self.registered is not None:
            self.registered.discard(name)

    @property
    def limits(self) -> StepLimits:
        return self._limits

    def reference(self, prompt: Sequence[int], n: int, adapter: str | None = None
                  ) -> list[int]:
        """What an unbatched, unpaged run generates: n tokens after `prompt`."""
        ctx = list(prompt)
        out = []
        for _ in range(n):
            t = (self.rule(ctx) + adapter_offset(adapter)) % self.vocab
            out.append(t)
            ctx.append(t)
        return out

    def launch(self, plan: StepPlan) -> StepResult:
        return self.step(plan)

    def collect(self, handle: StepResult) -> StepResult:
        return handle

    def step(self, plan: StepPlan) -> StepResult:
        last, self._last_sampled = self._last_sampled, {}
        for c in plan.chunks:
            if c.pending:
                assert len(c.token_ids) == 1 and c.seq_id in last, \
                    f"seq {c.seq_id}: pending token not sampled by the step before"
        rec = PlanRecord(
            chunks=tuple(ChunkRecord(c.seq_id, c.start_pos,
                                     (last[c.seq_id],) if c.pending else tuple(c.token_ids),
                                     tuple(c.page_table), c.sample, c.num_generated,
                                     c.adapter_slot, c.pending, c.draft,
                                     tuple(c.window_table))
                         for c in plan.chunks),
            copies=tuple(plan.copies), adapter_loads=tuple(plan.adapter_loads),
            window_copies=tuple(plan.window_copies))
        self.plans.append(rec)
        if self.on_step is not None:
            self.on_step(plan)
        if self.fail_next > 0:
            self.fail_next -= 1
            raise RuntimeError("injected runner failure")
        self._check(rec)
        ps = self.page_size
        store = self.kv_store
        for page, slot, key, meta in plan.swap_out:
            store.host[slot] = list(self.pool[page])
            if store.disk is not None:
                store.disk[key] = (meta, list(self.pool[page]))
        for slot, page in plan.swap_in:
            assert store.host[slot] is not None, f"host slot {slot} copied up, never filled"
            self.pool[page] = list(store.host[slot])
        for src, dst in rec.copies:
            self.pool[dst] = list(self.pool[src])
        wpool, window = self.window_pool, self._limits.window
        for src, dst in rec.window_copies:
            wpool[dst] = list(wpool[src])
        for slot, name in rec.adapter_loads:
            assert 0 <= slot < self.adapter_slots, (slot, self.adapter_slots)
            if self.registered is not None and name not in self.registered:
                raise KeyError(f"adapter {name!r} is not loaded")
            self.slots[slot] = name
        sampled, drafted = {}, {}
        for c in rec.chunks:
            for i, t in enumerate(c.token_ids):
                pos = c.start_pos + i
                self.pool[c.page_table[pos // ps]][pos % ps] = t
                if wpool:
                    wpool[c.window_table[pos // ps]][pos % ps] = t
            if c.sample:
                end = c.start_pos + len(c.token_ids)
                adapter = None
                if c.adapter_slot >= 0:
                    adapter = self.slots[c.adapter_slot]
                    assert adapter is not None, f"seq {c.seq_id}: slot {c.adapter_slot} empty"
                toks = []
                # A verify samples at each position, from the pool as written so far.
                for last in range(end - c.draft, end + 1):
                    ctx = [self.pool[c.page_table[p // ps]][p % ps] for p in range(last)]
                    assert None not in ctx, f"seq {c.seq_id} reads a slot never written"
                    for p in range(max(0, last - window), last if wpool else 0):
                        page = c.window_table[p // ps]
                        assert page and wpool[page][p % ps] == ctx[p], (
                            f"seq {c.seq_id}: sliding page {page} holds "
                            f"{wpool[page][p % ps]} at {p}, not {ctx[p]}")
                    token = (self.rule(ctx) + adapter_offset(adapter)) % self.vocab
                    toks.append(SampledToken(token_id=token, logprob=-1.0 - len(toks)))
                sampled[c.seq_id] = toks[0]
                if c.draft:
                    drafted[c.seq_id] = toks
        self._last_sampled = {k: t.token_id for k, t in sampled.items()}
        real = rec.num_tokens
        # Prompt scoring: a made-up logprob that says which position and target it is.
        scores = {c.seq_id: [None if t < 0 else SampledToken(t, -(pos + t / 1000))
                             for pos, t in enumerate(c.score_targets, c.start_pos)]
                  for c in plan.chunks if c.score_targets}
        return StepResult(sampled=sampled, real_tokens=real, prompt_logprobs=scores,
                          padded_tokens=-(-real // 8) * 8, device_seconds=self.device_seconds,
                          drafted=drafted)

    def _check(self, rec: PlanRecord) -> None:
        lim, ps = self._limits, self.page_size
        decodes = [c for c in rec.chunks if (len(c.token_ids) == 1 or c.draft) and c.sample
                   and c.num_generated > 0 and c.start_pos > 0]
        prefills = [c for c in rec.chunks if c not in decodes]
        rows = sum(1 + c.draft for c in decodes)
        assert rows <= lim.max_decode_seqs, (rows, lim)
        assert len(prefills) <= lim.max_prefill_seqs + max(
            0, lim.max_decode_seqs - len(decodes)), (len(prefills), lim)
        assert all(len(c.token_ids) <= lim.max_prefill_chunk for c in prefills)
        assert len({c.seq_id for c in rec.chunks}) == len(rec.chunks), "seq twice in a step"
        dsts = [d for _, d in rec.copies]
        assert len(set(dsts)) == len(dsts)
        for c in rec.chunks:
            end = c.start_pos + len(c.token_ids)
            assert len(c.token_ids) >= 1
            assert len(c.page_table) * ps >= end, "page table does not cover the chunk"
            assert end <= self.max_context
            assert all(0 < p < self.num_pages for p in c.page_table), c.page_table
            if self.window_pool:
                wt = c.window_table
                assert len(wt) == len(c.page_table) or len(wt) * ps >= end, wt
                assert all(0 <= p < len(self.window_pool) for p in wt), wt
                assert all(wt[p // ps] for p in range(c.start_pos, end)), (c, wt)
            written = {c.page_table[p // ps] for p in range(c.start_pos, end)}
            for other in rec.chunks:
                if other is not c:
                    shared = written & set(other.page_table)
                    assert not shared, f"seq {c.seq_id} writes pages {shared} seq " \
                                       f"{other.seq_id} also maps"


class FakeDecoder:
    def __init__(self, text_of: Callable[[int], str]) -> None:
        self.text_of = text_of

    def push(self, token_id: int) -> str:
        return self.text_of(token_id)

    def flush(self) -> str:
        return ""


def letter(t: int) -> str:
    return chr(ord("a") + t % 26)


class FakeDetokenizer:
    """Token t is one letter by default (``a`` + t mod 26); pass `text_of` to change it."""

    def __init__(self, text_of: Callable[[int], str] = letter) -> None:
        self.text_of = text_of

    def incremental(self, prompt_ids: Sequence[int]) -> FakeDecoder:
        return FakeDecoder(self.text_of)

    def text(self, token_ids: Sequence[int]) -> str:
        return "".join(self.text_of(t) for t in token_ids)
