"""Page allocator and prefix cache: unit tests, then a hypothesis state machine that
interleaves allocate, share (prefix hit), compute/append, copy-on-write, free and evict,
with a shadow of every page's contents to catch writes into shared pages."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (RuleBasedStateMachine, invariant, precondition, rule)

from scheduler.api import GenerateRequest
from scheduler.pages import PageAllocator
from scheduler.request import Sequence


def make_seq(tokens, salt="", seq_id=0) -> Sequence:
    req = GenerateRequest(prompt_ids=list(tokens), max_tokens=1, cache_salt=salt)
    return Sequence(req, request_id=f"r{seq_id}", seq_id=seq_id, arrived_at=0.0,
                    deadline_at=math.inf)


def compute_all(alloc: PageAllocator, seq: Sequence) -> None:
    alloc.grow(seq, seq.num_tokens)
    before = seq.num_computed_tokens
    seq.num_computed_tokens = seq.num_tokens
    alloc.register(seq, before // alloc.page_size, seq.num_tokens // alloc.page_size)


def test_null_page_never_allocated_and_lru_eviction_order():
    alloc = PageAllocator(5, 2)
    a = make_seq([1, 2, 3, 4])
    compute_all(alloc, a)
    assert 0 not in a.kv_pages and alloc.num_in_use == 2
    pages = list(a.kv_pages)
    alloc.free(a)
    # Both pages stay cached; the tail page is released first, so it is evicted first.
    assert alloc.num_cached == 2 and alloc.num_free == 2 and alloc.num_available == 4
    got = alloc.allocate(3)
    assert pages[1] in got and pages[0] not in got
    assert alloc.is_cached(pages[0])
    alloc.check([got])


def test_prefix_hit_shares_pages_and_salt_isolates():
    alloc = PageAllocator(32, 4)
    a = make_seq(range(10), salt="tenant-a")
    compute_all(alloc, a)
    b = make_seq([*range(8), 99, 98, 97], salt="tenant-a")
    hits = alloc.match(b)
    assert hits == a.kv_pages[:2]  # two full pages; the partial third is private
    c = make_seq([*range(8), 99], salt="tenant-b")
    assert alloc.match(c) == []
    d = make_seq([0, 1, 2, 3, 4, 5, 6, 0], salt="tenant-a")  # diverges inside page 1
    assert alloc.match(d) == a.kv_pages[:1]


def test_adopted_pages_are_held_until_a_plan_takes_them_then_cached():
    """Pages another replica computed (disaggregated prefill): cached under the prompt's
    keys at once (a hit for its request), never evicted before the plan that writes them
    is built, then cached pages like any other; one already cached here is written but
    freed."""
    from types import SimpleNamespace

    alloc = PageAllocator(9, 4)
    a = make_seq(range(10))  # pages 0-1 full
    data = SimpleNamespace(num_pages=2)
    assert alloc.adopt(a, 0, data) == 2
    b = make_seq([*range(8), 50])
    assert len(alloc.match(b)) == 2  # hits right away
    ids = alloc.imports[0][0]
    assert alloc.num_in_use == 2 and alloc.num_available == 6  # held: not evictable
    with pytest.raises(RuntimeError):
        alloc.allocate(7)
    (taken,) = alloc.take_imports()
    assert taken == (ids, data) and alloc.imports == []
    assert alloc.num_in_use == 0 and alloc.num_cached == 2
    alloc.check([])
    # The same prefix again, from page 1 on: page 1 is cached already, so its new copy
    # is written and freed; page 2 is new.
    c = make_seq(range(13))
    assert alloc.adopt(c, 1, SimpleNamespace(num_pages=2)) == 2
    alloc.take_imports()
    assert alloc.num_cached == 3 and alloc.num_in_use == 0
    alloc.check([])
    assert alloc.adopt(c, 0, SimpleNamespace(num_pages=9)) == 0  # no room: nothing taken
    assert alloc.imports == []


def test_hash_collision_is_not_a_hit(monkeypatch):
    alloc = PageAllocator(16, 2)
    a = make_seq([1, 2])
    compute_all(alloc, a)
    b = make_seq([3, 4])
    b.page_keys.append(a.page_keys[0])  # pretend both prefixes hash alike
    assert alloc.match(b) == []


def test_copy_on_write_of_shared_and_cached_pages():
    alloc = PageAllocator(16, 2)
    a = make_seq([1, 2, 3, 4])
    compute_all(alloc, a)
    b = make_seq([1, 2, 3, 4])
    hits = alloc.match(b)
    alloc.acquire(hits)
    b.kv_pages.extend(hits)
    assert alloc.ref[hits[1]] == 2
    src, dst = alloc.copy_on_write(b.kv_pages, 1)
    assert src == hits[1] and dst not in a.kv_pages and b.kv_pages[1] == dst
    assert alloc.ref[src] == 1 and alloc.ref[dst] == 1
    assert alloc.copy_on_write(b.kv_pages, 1) is None  # private now
    alloc.free(a)
    # A cached page with a single owner is still immutable: it stands for its key.
    c = make_seq([1, 2, 3, 4])
    hits = alloc.match(c)
    alloc.acquire(hits)
    c.kv_pages.extend(hits)
    assert alloc.ref[hits[1]] == 1 and alloc.copy_on_write(c.kv_pages, 1) is not None
    alloc.check([b.kv_pages, c.kv_pages])


def test_double_free_is_caught():
    alloc = PageAllocator(4, 2)
    pages = alloc.allocate(2)
    alloc.release(pages)
    with pytest.raises(AssertionError):
        alloc.release(pages)


def test_allocate_beyond_capacity_raises():
    alloc = PageAllocator(4, 2)
    with pytest.raises(RuntimeError):
        alloc.allocate(4)


def test_audit_is_clean_through_alloc_share_copy_free_and_evict():
    alloc = PageAllocator(16, 2)
    assert alloc.audit([]) == []
    a = make_seq([1, 2, 3, 4, 5])
    compute_all(alloc, a)
    b = make_seq([1, 2, 3, 4, 9], seq_id=1)
    hits = alloc.match(b)
    alloc.acquire(hits)
    b.kv_pages.extend(hits)
    alloc.grow(b, b.num_tokens)
    alloc.copy_on_write(b.kv_pages, 1)
    assert alloc.audit([a.kv_pages, b.kv_pages]) == []
    alloc.free(a)
    assert alloc.num_cached and alloc.audit([b.kv_pages]) == []
    alloc.free(b)
    assert alloc.evict(1) == 1 and alloc.audit([]) == []
    assert alloc.num_in_use == 0 and alloc.num_free + alloc.num_cached == alloc.num_usable


def _shared() -> tuple[PageAllocator, Sequence, Sequence]:
    """Two live sequences sharing a cached page, one cached page nobody holds."""
    alloc = PageAllocator(16, 2)
    a, b = make_seq([1, 2, 3, 4]), make_seq([1, 2, 5, 6], seq_id=1)
    compute_all(alloc, a)
    hits = alloc.match(b)
    alloc.acquire(hits)
    b.kv_pages.extend(hits)
    alloc.grow(b, b.num_tokens)
    c = make_seq([7, 8], seq_id=2)
    compute_all(alloc, c)
    alloc.free(c)
    assert alloc.audit([a.kv_pages, b.kv_pages]) == []
    return alloc, a, b


def test_audit_finds_a_corrupted_reference_count():
    alloc, a, b = _shared()
    alloc.ref[a.kv_pages[0]] = 1  # a lost reference: the page would be freed too soon
    problems = alloc.audit([a.kv_pages, b.kv_pages])
    assert any("reference counts differ" in p for p in problems), problems
    with pytest.raises(AssertionError, match="reference counts"):
        alloc.check([a.kv_pages, b.kv_pages])


def test_audit_finds_a_leak_and_a_page_in_two_states():
    alloc, a, b = _shared()
    alloc.free(b)
    assert alloc.audit([a.kv_pages]) == []
    alloc._free.pop()  # a freed page that never came back to the free list
    assert any("leaked" in p for p in alloc.audit([a.kv_pages]))
    alloc, a, b = _shared()
    cached = next(iter(alloc._lru))
    alloc._free.append(cached)
    problems = alloc.audit([a.kv_pages, b.kv_pages])
    assert f"page {cached} is both free and cached" in problems, problems
    # The live tables are the truth: a table the books do not know about is found too.
    alloc, a, b = _shared()
    assert alloc.audit([a.kv_pages]) != []


def test_audit_finds_an_inconsistent_prefix_cache():
    alloc, a, b = _shared()
    page = a.kv_pages[0]
    parent, salt, tokens = alloc._meta[page]
    alloc._meta[page] = (parent, salt, (9, 9))  # the key no longer names the contents
    problems = alloc.audit([a.kv_pages, b.kv_pages])
    assert problems == [f"cached page {page}: its key does not name its contents"], problems
    alloc, a, b = _shared()
    key = alloc._key_of[a.kv_pages[1]]
    del alloc._page_of_key[key]  # a page keyed but unreachable through the cache
    assert alloc.audit([a.kv_pages, b.kv_pages])


def test_audit_lists_at_most_limit_problems():
    alloc = PageAllocator(40, 2)
    alloc.ref[1:30] = [5] * 29
    problems = alloc.audit([], limit=3)
    assert len(problems) == 4 and problems[-1].startswith("... and ")


PS = 2
NUM_PAGES = 20
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=9)  # tiny alphabet: many hits


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(NUM_PAGES, PS)
        self.seqs: list[Sequence] = []
        self.shadow: list[list[int | None]] = [[None] * PS for _ in range(NUM_PAGES)]
        self.n = 0

    # -- rules -------------------------------------------------------------------------
    @rule(tokens=tokens_st, salt=st.sampled_from(["", "x"]))
    def allocate(self, tokens, salt):
        self._start(make_seq(tokens, salt, self._id()))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def share(self, data):
        """A new sequence whose prompt extends a live one's: prefix hits."""
        base = data.draw(st.sampled_from(self.seqs))
        extra = data.draw(st.lists(st.integers(0, 2), max_size=3))
        self._start(make_seq([*base.token_ids, *extra], base.cache_salt, self._id()))

    def _start(self, seq):
        a = self.alloc
        hits = a.match(seq)
        for i, p in enumerate(hits):  # a hit must hold exactly our tokens
            assert self.shadow[p] == seq.token_ids[i * PS:(i + 1) * PS]
        full_hit = len(hits) * PS == seq.num_tokens
        need = a.pages_for(seq.num_tokens) - len(hits) + full_hit
        if need > a.num_available - sum(a.ref[p] == 0 for p in hits):
            return  # admission says no
        a.acquire(hits)
        seq.kv_pages.extend(hits)
        seq.num_computed_tokens = seq.num_tokens - 1 if full_hit else len(hits) * PS
        if full_hit:
            self._copy(a.copy_on_write(seq.kv_pages, len(hits) - 1))
        a.grow(seq, seq.num_tokens)
        self.seqs.append(seq)

    @precondition(lambda self: any(s.num_uncomputed_tokens for s in self.seqs))
    @rule(data=st.data())
    def compute(self, data):
        """A step computes the next n uncomputed tokens (written into the pool)."""
        seq = data.draw(st.sampled_from([s for s in self.seqs if s.num_uncomputed_tokens]))
        n = data.draw(st.integers(1, seq.num_uncomputed_tokens))
        a = self.alloc
        start = seq.num_computed_tokens
        for pos in range(start, start + n):
            page = seq.kv_pages[pos // PS]
            assert a.is_writable(page), "a shared or cached page is about to be written"
            self.shadow[page][pos % PS] = seq.token_ids[pos]
        seq.num_computed_tokens = start + n
        a.register(seq, start // PS, (start + n) // PS)

    @precondition(lambda self: any(not s.num_uncomputed_tokens for s in self.seqs))
    @rule(data=st.data(), tok=st.integers(0, 2))
    def append(self, data, tok):
        """Decode: a sampled token is appended; its slot needs a page."""
        seq = data.draw(st.sampled_from([s for s in self.seqs if not s.num_uncomputed_tokens]))
        a = self.alloc
        if a.pages_for(seq.num_tokens + 1) > len(seq.kv_pages) and a.num_available < 1:
            return
        seq.token_ids.append(tok)
        a.grow(seq, seq.num_tokens)

    @precondition(lambda self: any(s.kv_pages for s in self.seqs))
    @rule(data=st.data())
    def copy_on_write(self, data):
        seq = data.draw(st.sampled_from([s for s in self.seqs if s.kv_pages]))
        i = data.draw(st.integers(0, len(seq.kv_pages) - 1))
        if self.alloc.num_available >= 1:
            self._copy(self.alloc.copy_on_write(seq.kv_pages, i))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.seqs))
        self.seqs.remove(seq)
        self.alloc.free(seq)

    @rule(n=st.integers(0, 5))
    def evict(self, n):
        before = self.alloc.num_cached
        assert self.alloc.evict(n) == min(n, before)

    # -- helpers -------------------------------------------------------------------------
    def _copy(self, pair):
        if pair is not None:
            src, dst = pair
            self.shadow[dst] = list(self.shadow[src])

    def _id(self):
        self.n += 1
        return self.n

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def books_balance(self):
        self.alloc.check([s.kv_pages for s in self.seqs])

    @invariant()
    def computed_tokens_intact(self):
        """Nobody overwrote a position a live sequence has computed."""
        for s in self.seqs:
            for pos in range(s.num_computed_tokens):
                assert self.shadow[s.kv_pages[pos // PS]][pos % PS] == s.token_ids[pos]

    def teardown(self):
        for s in self.seqs:
            self.alloc.free(s)
        self.alloc.check([])
        a = self.alloc
        assert a.num_in_use == 0 and a.num_free + a.num_cached == NUM_PAGES - 1


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestAllocator = AllocatorMachine.TestCase
