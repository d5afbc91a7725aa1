"""The sliding-window layers' own pages: their KV memory bounded by the window.

A sliding layer (Gemma 3's five in six, model/config.py) attends only to the last `window`
keys. Where the runner gives those layers pages of their own (`StepLimits.window_pool`:
numbered apart from the global layers' pages, and far fewer), each running sequence keeps a
second page table, `Sequence.window_pages`, over the same positions as `kv_pages`. A page
goes back as soon as no query the sequence will still run can see it (page 0 takes its
place), and the next pages are taken as its chunks reach them (`prepare`, before each of
its chunks is planned). So a sequence holds at most `StepLimits.window_pages_per_seq`
sliding pages whatever its context, the runner sizes the sliding pool for as many
sequences as a step decodes, the scheduler runs no more than that, and an allocation here
never has to wait or preempt.

The prefix cache works here as on the global pages (scheduler/pages.py, one
`PageAllocator` for each numbering): a full sliding page is registered under the key of
the same positions when the step computing it is launched, and a page released past the
window goes to this allocator's LRU if it is registered. A prefix hit needs, beside the
global pages, the sliding pages of the window before its first computed position (`hits`):
the hit stops at the longest prefix whose window tail is still cached. A shared or cached
page is copied before it is written (`StepPlan.window_copies`).
"""

from __future__ import annotations

from typing import Iterable

from .pages import PageAllocator
from .request import Sequence


class WindowPages:
    """The sliding layers' page books: one `PageAllocator` and the window."""

    def __init__(self, num_pages: int, page_size: int, window: int, per_seq: int, *,
                 prefix_cache: bool = True) -> None:
        if window < 2:
            raise ValueError(f"{window=} must be >= 2")
        self.alloc = PageAllocator(num_pages, page_size, prefix_cache=prefix_cache)
        self.page_size = page_size
        self.window = window
        self.per_seq = per_seq  # the most pages one sequence holds (`StepLimits`)
        self.most_held = 0  # the most one sequence has held at once

    @property
    def max_seqs(self) -> int:
        """Sequences that can run at once, each holding its most."""
        return self.alloc.num_usable // self.per_seq

    def first_page(self, pos: int) -> int:
        """The first page a query at `pos` reads."""
        return max(0, pos - self.window + 1) // self.page_size

    # -- admission --------------------------------------------------------------------------
    def hits(self, seq: Sequence, num_hits: int) -> tuple[int, list[int]]:
        """Of the sequence's first `num_hits` pages (cached in the global layers), how
        many it may take as hits: the most whose window tail (the sliding pages its first
        computed position reads) is cached here too; with that tail's pages (no
        references taken). A whole prompt that hits recomputes its last position."""
        alloc, ps = self.alloc, self.page_size
        n = num_hits if alloc.prefix_cache else 0
        while n > 0:
            end = n * ps
            lo = self.first_page(end - 1 if end >= seq.num_tokens else end)
            tail = [alloc.lookup(seq, i) for i in range(lo, n)]
            missing = [i for i, p in zip(range(lo, n), tail) if p is None]
            if not missing:
                return n, tail
            # Every prefix ending past the last missing page reads it too.
            n = missing[-1]
        return 0, []

    def admit(self, seq: Sequence, num_hits: int, tail: list[int]) -> None:
        """The sequence starts with `num_hits` pages of prefix hits: its table holds the
        window tail found by `hits`."""
        self.alloc.acquire(tail)
        lo = num_hits - len(tail)
        seq.window_pages[:] = [0] * lo + tail
        seq.window_first = lo
        self._note(seq)

    # -- each chunk ---------------------------------------------------------------------------
    def prepare(self, seq: Sequence, start: int, n: int,
                copies: list[tuple[int, int]]) -> None:
        """Before a chunk writes positions ``[start, start + n)``: pages no query from
        `start` on reads go back, the page `start` is in is made private if it is shared or
        cached (its copy into `copies`), and pages up to the chunk's end are taken.
        Idempotent, so a decode chunk that grows into a verify calls it again."""
        alloc, ps, table = self.alloc, self.page_size, seq.window_pages
        lo = min(self.first_page(start), len(table))
        if lo > seq.window_first:
            gone = table[seq.window_first:lo]
            table[seq.window_first:lo] = [0] * len(gone)
            seq.window_first = lo
            alloc.release(gone)
        idx = start // ps
        if idx < len(table) and not alloc.is_writable(table[idx]):
            copies.append(alloc.copy_on_write(table, idx))
        need = (start + n - 1) // ps + 1 - len(table)
        if need > 0:
            table.extend(alloc.allocate(need))
        self._note(seq)

    def trim(self, seq: Sequence, keep: int) -> None:
        """Pages from `keep` on go back (a verify's rejected proposals)."""
        table = seq.window_pages
        if len(table) > keep:
            tail = table[max(keep, seq.window_first):]
            del table[keep:]
            seq.window_first = min(seq.window_first, len(table))
            self.alloc.release(tail)

    def free(self, seq: Sequence) -> None:
        """All of a sequence's sliding pages go back (finished, aborted or preempted)."""
        table = seq.window_pages
        self.alloc.release(table[seq.window_first:])
        table.clear()
        seq.window_first = 0

    # -- the prefix cache ------------------------------------------------------------------------
    def register(self, seq: Sequence, first: int, end: int) -> list[int]:
        """`PageAllocator.register` of the sliding pages the sequence still holds."""
        first = max(first, seq.window_first)
        if first >= end:
            return []
        return self.alloc.register(seq, first, end, table=seq.window_pages)

    def forget(self, pages: Iterable[int]) -> None:
        self.alloc.forget(pages)

    # -- books -----------------------------------------------------------------------------------
    def _note(self, seq: Sequence) -> None:
        held = len(seq.window_pages) - seq.window_first
        if held > self.most_held:
            self.most_held = held

    def audit(self, seqs: Iterable[Sequence]) -> list[str]:
        """The allocator's audit over the running sequences' sliding tables, and the
        window bound: no sequence holds more than `per_seq` pages, none before its
        window."""
        seqs = list(seqs)
        errors = self.alloc.audit([s.window_pages[s.window_first:] for s in seqs])
        for s in seqs:
            t = s.window_pages
            if any(t[:s.window_first]) or 0 in t[s.window_first:]:
                errors.append(f"seq {s.seq_id}: sliding table {t} (first held "
                              f"{s.window_first}) mixes released and held pages")
            if len(t) - s.window_first > self.per_seq:
                errors.append(f"seq {s.seq_id} holds {len(t) - s.window_first} sliding "
                              f"pages, more than {self.per_seq}")
        return errors

    def stats(self, seqs: Iterable[Sequence]) -> dict:
        """What /v1/stats shows of the sliding pages."""
        alloc = self.alloc
        held = [len(s.window_pages) - s.window_first for s in seqs]
        return {
            "window": self.window,
            "pages": alloc.num_usable,
            "pages_in_use": alloc.num_in_use,
            "pages_cached": alloc.num_cached,
            "max_pages_per_seq": self.per_seq,
            "max_tokens_per_seq": self.per_seq * self.page_size,
            "most_pages_held": max(held, default=0),
            "most_pages_held_ever": self.most_held,
        }
