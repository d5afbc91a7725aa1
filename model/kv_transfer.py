"""KV pages between replicas: disaggregated prefill's copy out and the decode side's inbox.

A prefill replica computes a prompt and its runner's `export_pages` queues a copy of the
prompt's full pages (`ExportedPages`: the swap programs' gather, behind the steps already
launched). A decode replica of the same process takes them as they are: its runner puts
each gather's output onto its own pool's sharding and scatters it into fresh pages
(`ModelRunner._import`, run for the plan's `imports`). Across processes, the prefill
server calls `to_host` off the event loop and sends them on (app/kv_wire.py: a header
that names the model and the page layout, a CRC-32, the pages' bytes); the decode side
checks them and `deposit`s them in its replica's `Inbox`.

The inbox is the decode replica's disk tier as the KV tiers see it (model/kv_tiers.py,
scheduler/kv_tiers.py): a container of page keys whose `take` yields a page. A prompt
whose pages continue there is admitted as a tier hit: the pages are read into host slots
by the tier's worker thread and copied up into the device pool, and only the prompt's
last partial page is computed. A key names a page's whole prefix (`pages.chain_key`: the
parent's key, the cache salt and its tokens) and `take` checks the page's (parent, salt,
tokens) as the disk tier does, so a page deposited for one prompt serves only the same
prefix of the same tenant. A key the inbox lacks is read from the real disk tier below
it, if the pool has one (writes go straight there: model/kv_tiers.TierStore).
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

import numpy as np


class ExportedPages:
    """Pages gathered out of a pool, on the device until `to_host`: `parts` are the swap
    program's (k, v, n) outputs, `SWAP_BUCKET` pages each ([layers * bucket, ...],
    layer-major), the first n of them real."""

    def __init__(self, parts: list[tuple[Any, Any, int]], page_shape: tuple[int, ...],
                 dtype: Any) -> None:
        self.parts = parts
        self.page_shape = tuple(page_shape)  # (2, layers, page_size, kv heads, row)
        self.dtype = np.dtype(dtype)

    @property
    def num_pages(self) -> int:
        return sum(n for _, _, n in self.parts)

    @property
    def nbytes(self) -> int:
        return self.num_pages * int(np.prod(self.page_shape)) * self.dtype.itemsize

    def to_host(self) -> np.ndarray:
        """[n, K/V, layer, position, kv head, row] on the host (waits for the gathers)."""
        out = np.empty((self.num_pages, *self.page_shape), self.dtype)
        layers = self.page_shape[1]
        j = 0
        for k, v, n in self.parts:
            k = np.asarray(k).reshape(layers, -1, *self.page_shape[2:])
            v = np.asarray(v).reshape(layers, -1, *self.page_shape[2:])
            out[j:j + n, 0] = k[:, :n].swapaxes(0, 1)
            out[j:j + n, 1] = v[:, :n].swapaxes(0, 1)
            j += n
        return out


class Inbox:
    """Pages received for prompts about to be admitted, in front of the disk tier (or of
    nothing): what the KV tiers read as their disk. Thread-safe (the tier's reader runs
    in a worker thread)."""

    def __init__(self, disk: Any = None) -> None:
        self.disk = disk
        self._pages: dict[int, tuple[tuple, np.ndarray]] = {}  # key -> (meta, page)
        self._lock = threading.Lock()
        self.received_pages = 0
        self.taken_pages = 0
        self.dropped_pages = 0

    def deposit(self, entries: Iterable[tuple[int, tuple, np.ndarray]]) -> None:
        """Pages for a prompt, each (key, meta = (parent key, salt, tokens), page)."""
        with self._lock:
            for key, meta, page in entries:
                self._pages[key] = (meta, page)
                self.received_pages += 1

    def discard(self, keys: Iterable[int]) -> None:
        """The prompt these were for is done (or gone): drop what was not taken."""
        with self._lock:
            for key in keys:
                if self._pages.pop(key, None) is not None:
                    self.dropped_pages += 1

    @property
    def num_pages(self) -> int:
        return len(self._pages)

    def __contains__(self, key: int) -> bool:
        """Here or on the disk tier below (what the KV tiers ask)."""
        return key in self._pages or (self.disk is not None and key in self.disk)

    def take(self, key: int, meta: tuple) -> np.ndarray | None:
        """The page deposited under `key` if it holds `meta` (then it leaves the inbox)."""
        with self._lock:
            held = self._pages.get(key)
            if held is None or held[0] != meta:
                return None
            del self._pages[key]
            self.taken_pages += 1
            return held[1]

    def close(self) -> None:
        with self._lock:
            self._pages.clear()

    def stats(self) -> dict | None:
        """The disk tier's (None: no disk tier); the inbox's own are `inbox_stats`."""
        return self.disk.stats() if self.disk is not None else None

    def inbox_stats(self) -> dict:
        return {"pages": len(self._pages), "received_pages": self.received_pages,
                "taken_pages": self.taken_pages, "dropped_pages": self.dropped_pages}
