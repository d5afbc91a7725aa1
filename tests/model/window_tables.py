"""Sliding page tables for tests that build a runner's chunks by hand.

Where a runner gives its sliding layers pages of their own (`ModelRunner.window_pool`,
scheduler/window_pages.py), every chunk carries a second table. These tests have no
scheduler to keep one, so each sequence gets a ring of the window pool's pages, enough
for a window and the largest prefill bucket: a position's page is its turn of the ring,
and pages before the window of the chunk's first query are 0, as the scheduler leaves
released pages.
"""

from __future__ import annotations


def window_table(runner, seq: int, start: int, end: int) -> list[int]:
    """Sequence `seq`'s sliding table for a chunk of positions ``[start, end)`` (empty
    where the runner has no sliding pages of its own)."""
    if not runner.window_pool:
        return []
    ps = runner.page_size
    ring = (runner.pool.window + runner.prefill_buckets[-1]) // ps + 3
    if (seq + 1) * ring >= runner.window_pool:
        raise ValueError(f"seq {seq}: the window pool ({runner.window_pool} pages) holds "
                         f"no ring of {ring} pages for it")
    first = max(0, start - runner.pool.window + 1) // ps
    return [0 if i < first else 1 + seq * ring + i % ring
            for i in range(-(-end // ps))]
