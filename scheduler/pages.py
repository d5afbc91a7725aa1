"""The KV page pool's host-side books: free list, reference counts, prefix cache.

The device holds one preallocated pool of `num_pages` pages of `page_size` positions;
page 0 is the null page that padding writes to, so it is never handed out. This module
decides which page holds what; the runner only follows the page tables it is given.

Every usable page is in exactly one of three states; `audit` checks it (the property
tests after every operation, /v1/stats on the live pool):

- free: ``ref == 0``, not cached, in `_free`;
- cached: ``ref == 0`` but its contents are registered under a prefix key, in `_lru`
  (least recently released first). Kept for future prefix hits, evicted only when the
  free list is empty, so an idle pool fills up with reusable prompts;
- in use: ``ref > 0``; ``ref`` is the number of page tables holding it (a prefix hit
  makes one page appear in several tables).

Prefix keys chain: page i's key hashes (key of page i-1, salt, its page_size token ids)
with a stable hash (`chain_key`: the same in every process, as the disk tier needs), so a
key names the whole prefix up to the end of the page, not just one page's tokens.
The salt is the request's `cache_salt` (the app puts tenant and adapter there, or "" when
the operator lets tenants share), so one tenant's prompt is never another's hit. A hit is
confirmed by comparing parent key, salt and token ids, so a hash collision cannot serve
wrong K/V. Only full pages are registered; a partial last page is private.

Registered pages and pages with ``ref > 1`` are immutable: a sequence that must write into
one (its whole prompt was a hit, so the last position is recomputed into the last page)
first gets a private copy; the (src, dst) pair goes into `StepPlan.copies`, which the
runner executes before any chunk of that step. Pages are registered when the step that
computes them is launched (any step that reads them runs after it); if that step fails,
`forget` takes them back out.

With tiers below the device (scheduler/kv_tiers.py, `tiers`), evicting a cached page
moves it down: the page's (page, host slot, key, meta) joins `swap_out`, which the policy
moves into the next `StepPlan` (the runner copies it out before that step writes
anything), and `take_up` gives a prompt fresh pages for the pages it found in the host
tier, each (host slot, page) into `swap_in`. Pages another replica of the process computed
(disaggregated prefill) are `adopt`ed: fresh pages cached under their keys at once, held
until the next plan takes them as `imports` (written before its chunks), then cached
pages like any other.

(About 480 lines: allocation, the prefix cache, its hand-over to the tiers below and
the audit share the three-state books above and are kept together.)
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any, Container, Iterable, Iterator

from .request import Phase, Sequence

if TYPE_CHECKING:
    from .kv_tiers import KVTiers

_ROOT_KEY = 0  # parent key of a sequence's first page


def chain_key(parent: int, salt: str, tokens: tuple[int, ...]) -> int:
    """A page's prefix key: a stable 64-bit hash of its parent's key, the salt and its
    token ids (Python's `hash` of a str differs between processes; the disk tier's
    files must mean the same after a restart)."""
    raw = salt.encode()
    h = hashlib.blake2b(struct.pack("<QI", parent, len(raw)), digest_size=8)
    h.update(raw)
    h.update(array("i", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, *, prefix_cache: bool = True) -> None:
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be >= 2 (page 0 is the null page)")
        if page_size < 1:
            raise ValueError(f"{page_size=} must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_cache = prefix_cache
        self.ref = [0] * num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced
        self._key_of: list[int | None] = [None] * num_pages
        self._meta: list[tuple | None] = [None] * num_pages  # (parent_key, salt, tokens)
        self._page_of_key: dict[int, int] = {}
        self.query_tokens = 0  # prefix-cache lookups, in tokens
        self.hit_tokens = 0
        # Tiers below the device (None: evicted pages are dropped), and the copies down
        # and up planned since the policy last took them (`take_swaps`).
        self.tiers: KVTiers | None = None
        self.swap_out: list[tuple[int, int, int, tuple]] = []  # (page, slot, key, meta)
        self.swap_in: list[tuple[int, int]] = []  # (host slot, page)
        self.imports: list[tuple[list[int], Any]] = []  # pages another replica computed

    # -- counts ---------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_available(self) -> int:
        """Pages an allocation can get now: free ones, then evicted cached ones."""
        return len(self._free) + len(self._lru)

    @property
    def num_in_use(self) -> int:
        return self.num_pages - 1 - len(self._free) - len(self._lru)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- allocation -----------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """`n` private pages (ref 1). Takes free pages first and evicts the least recently
        released cached pages only when the free list runs dry."""
        if n > self.num_available:
            raise RuntimeError(f"allocate({n}) with only {self.num_available} pages available")
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._lru.popitem(last=False)
                self._evict_cached(page)
            self.ref[page] = 1
            out.append(page)
        return out

    def acquire(self, pages: Iterable[int]) -> None:
        """Take a reference on pages found by `match` (a cached page leaves the LRU)."""
        ref = self.ref
        for page in pages:
            if ref[page] == 0:
                del self._lru[page]
            ref[page] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference on each page. Walks the table backwards so a sequence's tail
        pages enter the LRU before its head: eviction then trims long prefixes from the end
        and keeps the widely shared beginnings (system prompts) longest."""
        ref = self.ref
        for page in reversed(pages):
            r = ref[page] - 1
            if r < 0 or page == 0:
                raise AssertionError(f"double free of page {page}")
            ref[page] = r
            if r == 0:
                if self._key_of[page] is not None:
                    self._lru[page] = None
                else:
                    self._free.append(page)

    def free(self, seq: Sequence) -> None:
        """Return all of a sequence's pages (finished, aborted or preempted)."""
        self.release(seq.kv_pages)
        seq.kv_pages.clear()

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend the page table (in place) to cover positions ``[0, num_tokens)``."""
        need = self.pages_for(num_tokens) - len(seq.kv_pages)
        if need > 0:
            seq.kv_pages.extend(self.allocate(need))

    def evict(self, n: int) -> int:
        """Drop up to `n` cached pages to the free list (oldest first); returns how many."""
        done = 0
        while done < n and self._lru:
            page, _ = self._lru.popitem(last=False)
            self._evict_cached(page)
            self._free.append(page)
            done += 1
        return done

    # -- copy-on-write --------------------------------------------------------------------
    def is_writable(self, page: int) -> bool:
        return self.ref[page] == 1 and self._key_of[page] is None

    def copy_on_write(self, table: list[int], index: int) -> tuple[int, int] | None:
        """Make ``table[index]`` private before it is written. Returns (src, dst) for the
        runner to copy, or None when the page already was private. The new page is taken
        before the old one is released, so they differ; if the old page becomes
        evictable and is reused in the same step, the copy still reads it first
        (copies run before chunks)."""
        src = table[index]
        if self.is_writable(src):
            return None
        dst = self.allocate(1)[0]
        table[index] = dst
        self.release([src])
        return (src, dst)

    # -- prefix cache ---------------------------------------------------------------------
    def page_key(self, seq: Sequence, i: int) -> int:
        """Key of the sequence's page i (must be full), memoised on ``seq.page_keys``."""
        keys = seq.page_keys
        ps = self.page_size
        while len(keys) <= i:
            j = len(keys)
            parent = keys[j - 1] if j else _ROOT_KEY
            keys.append(chain_key(parent, seq.cache_salt,
                                  tuple(seq.token_ids[j * ps:(j + 1) * ps])))
        return keys[i]

    def page_meta(self, seq: Sequence, i: int) -> tuple:
        """What the sequence's page i holds: (parent key, salt, token ids)."""
        ps = self.page_size
        return (seq.page_keys[i - 1] if i else _ROOT_KEY, seq.cache_salt,
                tuple(seq.token_ids[i * ps:(i + 1) * ps]))

    def metas_from(self, seq: Sequence, first: int) -> Iterator[tuple[int, tuple]]:
        """(key, meta) of the sequence's full prompt pages from page `first` on."""
        for i in range(first, seq.num_tokens // self.page_size):
            yield self.page_key(seq, i), self.page_meta(seq, i)

    # -- the tiers below --------------------------------------------------------------------
    def _evict_cached(self, page: int) -> None:
        """A cached page leaves the device: down a tier if there is one, then uncached."""
        tiers = self.tiers
        if tiers is not None:
            key, meta = self._key_of[page], self._meta[page]
            slot = tiers.demote(key, meta)
            if slot is not None:
                self.swap_out.append((page, slot, key, meta))
        self._uncache(page)

    def take_up(self, seq: Sequence, slots: list[int]) -> list[int]:
        """Give the sequence fresh pages for its next ``len(slots)`` full pages, found in
        the host tier at `slots`: each (slot, page) into `swap_in`, run before any chunk
        reads them, and the page cached under its key at once (immutable, as any hit).
        Returns the new pages (the caller appends nothing: they are in ``seq.kv_pages``)."""
        first = len(seq.kv_pages)
        self.tiers.pinned.update(slots)  # the evictions `allocate` may make copy down
        new = self.allocate(len(slots))  # into other slots than these
        for i, (slot, page) in enumerate(zip(slots, new), first):
            key = self.page_key(seq, i)
            if key not in self._page_of_key:  # (a later page may still be on the device)
                self._key_of[page] = key
                self._meta[page] = self.page_meta(seq, i)
                self._page_of_key[key] = page
            self.swap_in.append((slot, page))
        seq.kv_pages.extend(new)
        self.tiers.copy_up_bytes += len(slots) * self.tiers.page_bytes
        return new

    def cached_entries(self) -> list[tuple[int, int, tuple]]:
        """Every page the prefix cache holds, (page, key, meta), least recently used
        first (the unreferenced ones in LRU order, then those in use)."""
        held = [p for p in range(1, self.num_pages)
                if self.ref[p] and self._key_of[p] is not None]
        return [(p, self._key_of[p], self._meta[p]) for p in (*self._lru, *held)]

    def adopt(self, seq: Sequence, first: int, data: Any) -> int:
        """Pages another replica computed for `seq`'s prompt, pages ``[first, first +
        data.num_pages)`` (an `export_pages` result): fresh pages of this pool, cached
        under their keys now and written by the next plan's `imports` before any of its
        chunks (held until that plan is built: nothing evicts them before they are
        written). Returns the pages taken (0: no room, or no prefix cache); one whose
        prefix is cached already is written but not cached, and freed."""
        n = data.num_pages
        if not self.prefix_cache or n <= 0 or n > self.num_available:
            return 0
        ids = self.allocate(n)
        self.register(seq, first, first + n, [0] * first + ids)
        self.imports.append((ids, data))
        return n

    def take_imports(self) -> list[tuple[list[int], Any]]:
        """The pages adopted since the last call, for the next `StepPlan` (their hold is
        let go: from the plan on they are cached pages like any other)."""
        out, self.imports = self.imports, []
        for ids, _ in out:
            self.release(ids)
        return out

    def take_swaps(self) -> tuple[list, list]:
        """The copies down and up planned since the last call, for the next `StepPlan`."""
        out, inn = self.swap_out, self.swap_in
        self.swap_out, self.swap_in = [], []
        if self.tiers is not None:
            self.tiers.pinned.clear()
        return out, inn

    def match(self, seq: Sequence) -> list[int]:
        """The longest run of cached pages that holds a prefix of ``seq.token_ids``.
        Takes no references (see `acquire`) so admission can still say no."""
        if not self.prefix_cache:
            return []
        hits: list[int] = []
        for i in range(len(seq.token_ids) // self.page_size):
            page = self.lookup(seq, i)
            if page is None:
                break
            hits.append(page)
        return hits

    def lookup(self, seq: Sequence, i: int) -> int | None:
        """The cached page holding the sequence's (full) page i, or None."""
        page = self._page_of_key.get(self.page_key(seq, i))
        if page is None:
            return None
        ps = self.page_size
        parent = seq.page_keys[i - 1] if i else _ROOT_KEY
        meta = self._meta[page]
        if (meta[0] != parent or meta[1] != seq.cache_salt
                or meta[2] != tuple(seq.token_ids[i * ps:(i + 1) * ps])):
            return None  # a hash collision: never serve someone else's K/V
        return page

    def expected_hits(self, seq: Sequence, promised: Container[int] = ()) -> int:
        """Tokens of `seq`'s prompt that are likely to be cached when it runs: its leading
        full pages whose keys are in the cache now (any tier) or among `promised` (pages a
        sequence queued or running ahead of it will have computed). An estimate for admission: no
        references taken, no collision check."""
        if not self.prefix_cache:
            return 0
        n = 0
        tiers = self.tiers
        for i in range(seq.num_prompt_tokens // self.page_size):
            key = self.page_key(seq, i)
            if (key not in self._page_of_key and key not in promised
                    and (tiers is None or not tiers.has(key))):
                break
            n += 1
        return n * self.page_size

    def prefix_in_flight(self, seq: Sequence, num_hits: int,
                         running: Iterable[Sequence]) -> bool:
        """Is a running prefill about to compute the page this sequence misses first?

        Many requests sharing a long system prompt often arrive together. Admitted at once,
        each would compute the shared prefix itself; held back until the first one has
        computed it, they all hit the cache and the step budget goes to new work. The
        wait is short: prefills in progress get their chunks before anyone is admitted.
        """
        ps = self.page_size
        end = (num_hits + 1) * ps  # the first missing page, if it is a full one
        if not self.prefix_cache or seq.num_tokens < end:
            return False
        key = None
        for other in running:
            if (other.phase is Phase.PREFILL and other.num_computed_tokens < end
                    and other.num_tokens >= end and other.cache_salt == seq.cache_salt):
                if key is None:
                    key = self.page_key(seq, num_hits)
                if self.page_key(other, num_hits) == key:
                    return True
        return False

    def register(self, seq: Sequence, first: int, end: int,
                 table: list[int] | None = None) -> list[int]:
        """Offer pages ``[first, end)`` of the sequence (full, and computed by a step
        launched: any step that reads them runs after it) to the cache; returns the pages
        newly cached. A page whose prefix is already cached in another page stays private
        (two sequences computed the same prompt at once); it goes straight back to the
        free list when released. `table`: another of the sequence's tables than
        `kv_pages` (scheduler/window_pages.py)."""
        if not self.prefix_cache:
            return []
        ps = self.page_size
        table = seq.kv_pages if table is None else table
        added = []
        for i in range(first, end):
            page = table[i]
            if self._key_of[page] is not None:
                continue  # already cached (a prefix hit)
            key = self.page_key(seq, i)
            if key in self._page_of_key:
                continue
            parent = seq.page_keys[i - 1] if i else _ROOT_KEY
            self._key_of[page] = key
            self._meta[page] = (parent, seq.cache_salt, tuple(seq.token_ids[i * ps:(i + 1) * ps]))
            self._page_of_key[key] = page
            added.append(page)
        return added

    def forget(self, pages: Iterable[int]) -> None:
        """Take pages out of the cache (the step that was to compute them failed): one
        nobody holds goes back to the free list."""
        for page in pages:
            if self._key_of[page] is None:
                continue
            self._uncache(page)
            if self.ref[page] == 0:
                del self._lru[page]
                self._free.append(page)

    def _uncache(self, page: int) -> None:
        key = self._key_of[page]
        if key is not None:
            del self._page_of_key[key]
            self._key_of[page] = None
            self._meta[page] = None

    def is_cached(self, page: int) -> bool:
        return self._key_of[page] is not None

    # -- the audit: for /v1/stats, the soak and the tests ------------------------------------
    def audit(self, tables: Iterable[list[int]], *, limit: int = 10) -> list[str]:
        """Recompute the books from scratch and say where they disagree (empty: consistent).

        `tables` are the page tables of every live sequence. Checked: each reference count
        equals the page's references in the tables; every usable page is in exactly one
        state (free, cached, in use), so free + cached + in use == usable and nothing
        leaked; the null page is never handed out; the prefix cache's two indexes agree,
        and each cached page's key is the hash of what its metadata says it holds (a full
        page). O(num_pages + pages in the tables), a fraction of a millisecond for the
        default pool: cheap enough for every stats read. At most `limit` problems are
        listed (then a count of the rest)."""
        problems: list[str] = []
        n = self.num_pages
        counts = [0] * n
        for table in tables:
            for page in table:
                if 0 < page < n:
                    counts[page] += 1
                else:
                    problems.append(f"page {page} in a page table is out of range")
        wrong = [p for p in range(n) if counts[p] != self.ref[p]]
        if wrong:
            p = wrong[0]
            problems.append(f"{len(wrong)} reference counts differ from the page tables "
                            f"(page {p}: ref {self.ref[p]}, referenced {counts[p]} times)")
        if self.ref[0] or self._key_of[0] is not None or 0 in self._lru:
            problems.append("the null page is handed out")
        # Which list each page is in (1 free, 2 cached): one at most, matching its state.
        seen: list[int | None] = [None] * n
        for state, pages in ((1, self._free), (2, self._lru)):
            for page in pages:
                if not 0 < page < n:
                    problems.append(f"page {page} in the {_STATE[state]} list is out of range")
                    continue
                if seen[page] is not None:
                    problems.append(f"page {page} is both {_STATE[seen[page]]} and "
                                    f"{_STATE[state]}")
                seen[page] = state
                if self.ref[page] or counts[page]:
                    problems.append(f"page {page} is {_STATE[state]} but referenced")
                if (self._key_of[page] is not None) != (state == 2):
                    problems.append(f"page {page} is {_STATE[state]} but "
                                    f"{'keyed' if state == 1 else 'has no key'}")
        for page in range(1, n):
            if self.ref[page] == 0 and seen[page] is None:
                problems.append(f"page {page} leaked: unreferenced, neither free nor cached")
        in_use = sum(1 for p in range(1, n) if self.ref[p] > 0)
        if in_use + len(self._free) + len(self._lru) != n - 1:
            problems.append(f"in use {in_use} + free {len(self._free)} + cached "
                            f"{len(self._lru)} != {n - 1} usable pages")
        # The prefix cache: key -> page and page -> key agree, and each key names its page's
        # contents (parent key, salt, page_size tokens), as `match` trusts it to.
        for key, page in self._page_of_key.items():
            if not 0 < page < n or self._key_of[page] != key:
                problems.append(f"prefix-cache key of page {page} disagrees with its page")
        keyed = 0
        for page in range(n):
            key, meta = self._key_of[page], self._meta[page]
            if key is None:
                if meta is not None:
                    problems.append(f"page {page} has cache metadata but no key")
                continue
            keyed += 1
            if self._page_of_key.get(key) != page:
                problems.append(f"cached page {page} is not found under its key")
            if (meta is None or len(meta[2]) != self.page_size
                    or chain_key(meta[0], meta[1], meta[2]) != key):
                problems.append(f"cached page {page}: its key does not name its contents")
        if keyed != len(self._page_of_key):
            problems.append(f"{keyed} pages keyed, {len(self._page_of_key)} keys cached")
        if self.tiers is not None:
            problems += self.tiers.audit()
        if len(problems) > limit:
            problems[limit:] = [f"... and {len(problems) - limit} more"]
        return problems

    def check(self, tables: Iterable[list[int]]) -> None:
        """Assert the invariants against every live page table (the tests' `audit`)."""
        problems = self.audit(tables)
        assert not problems, "; ".join(problems)


_STATE = ("in use", "free", "cached")
