"""The KV tiers' bytes: a preallocated host buffer of pages and the disk store under it.

The scheduler keeps the books (scheduler/kv_tiers.py: which host slot holds which page's
key); this holds what the slots hold and does the copies a `StepPlan` asks for, at the
runner's launch, in plan order, before the step's page copies and chunks:

1. `swap_out` (device page -> host slot): a gather program copies the pages out of the
   pool into a new device array, queued behind the steps already launched (so it reads
   what they wrote) and ahead of the step that may overwrite them; the host copy is
   made when that step is collected (`settle`: by then the gather has run), and each
   page copied down is offered to the disk tier (written by its own thread);
2. `swap_in` (host slot -> device page): the slots' bytes go to the device in one
   scatter program per `SWAP_BUCKET` pages (a slot whose copy down has not settled yet
   is settled first).

Reads of a slot happen at launch and writes to it at collect, both in launch order, so a
slot the books reuse in the next plan is read before it is rewritten.

The host buffer is `np.zeros`, so the OS commits its memory only as pages are written:
`kv_host_bytes` is a ceiling, not the server's resident size at start.

A disk read (`load`) runs in a worker thread of the engine's while the steps go on; it
fills slots the books reserved for it and nobody else touches until `KVTiers.loaded`.
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from typing import Any

import numpy as np

from .kv_disk import DiskStore
from .kv_transfer import Inbox

SWAP_BUCKET = 32  # pages per call of the swap programs (fixed shapes: one compile each)


def model_fingerprint(config: Any, *, weights: str, kv_dtype: Any, page_shape: tuple,
                      sample: list[np.ndarray]) -> str:
    """A short name for "these weights, this KV layout": the disk tier's folder and each
    file's header. `sample` is a few of the weights' first values (random test models of
    the same shapes differ there), `weights` their format."""
    h = hashlib.blake2b(digest_size=10)
    h.update(repr((config, weights, np.dtype(kv_dtype).str, tuple(page_shape))).encode())
    for a in sample:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


class TierStore:
    """Host slots of KV pages ([slot, K/V, layer, position, kv head, row]) and the disk
    store below them (None: host only)."""

    def __init__(self, host_slots: int, page_shape: tuple[int, ...], dtype: Any, *,
                 disk: DiskStore | None = None, inbox: bool = False) -> None:
        self.host_slots = host_slots
        self.page_shape = tuple(page_shape)
        self.dtype = np.dtype(dtype)
        self.page_bytes = int(np.prod(page_shape)) * self.dtype.itemsize
        self.host = np.zeros((host_slots, *page_shape), self.dtype)
        self.disk = disk
        # A decode replica's pages from prefill replicas (model/kv_transfer.py), read
        # before the disk tier; `source` is what the tiers read below the host slots.
        self.inbox = Inbox(disk) if inbox else None
        self.source = self.inbox if inbox else disk
        # Copies down not settled yet: (mark, slots, k, v, (key, meta) per slot), launch order.
        self._pending: deque[tuple[int, list[int], Any, Any, list]] = deque()
        self._mark = 0
        self._lock = threading.Lock()  # collect (a worker thread) and launch may meet here

    # -- copies down ------------------------------------------------------------------------
    def queued(self, slots: list[int], k: Any, v: Any, entries: list) -> None:
        """A gather's device output for `slots` (layer-major rows: [layers * n, ...])."""
        with self._lock:
            self._mark += 1
            self._pending.append((self._mark, slots, k, v, entries))

    @property
    def mark(self) -> int:
        """The last copy down queued: `settle(upto=mark)` once its step is collected."""
        return self._mark

    def settle(self, upto: int | None = None, slots: set[int] | None = None) -> None:
        """Make the host copies of the gathers queued up to `upto` (None: all), or of
        those that write one of `slots`, and the ones before them."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                mark, out, k, v, entries = self._pending[0]
                if upto is not None and mark > upto and (
                        slots is None or not self._writes_any(slots)):
                    return
                self._pending.popleft()
            self._store(out, k, v, entries)

    def _writes_any(self, slots: set[int]) -> bool:
        return any(not slots.isdisjoint(p[1]) for p in self._pending)

    def _store(self, out: list[int], k: Any, v: Any, entries: list) -> None:
        n = len(out)
        k = np.asarray(k)  # waits for the gather
        v = np.asarray(v)
        layers = self.page_shape[1]
        k = k.reshape(layers, -1, *k.shape[1:])
        v = v.reshape(layers, -1, *v.shape[1:])
        host = self.host
        for j in range(n):
            slot = out[j]
            host[slot, 0] = k[:, j]
            host[slot, 1] = v[:, j]
            if self.disk is not None:
                key, meta = entries[j]
                self.disk.put(key, meta, host[slot])

    def persist(self, k: Any, v: Any, entries: list) -> None:
        """Pages gathered from the pool straight to the disk tier (at shutdown: the
        device's cached prefixes), each (key, meta) of `entries`; waits for the writer
        when its queue is full rather than drop them."""
        disk = self.disk
        layers = self.page_shape[1]
        k = np.asarray(k).reshape(layers, -1, *self.page_shape[2:])
        v = np.asarray(v).reshape(layers, -1, *self.page_shape[2:])
        for j, (key, meta) in enumerate(entries):
            if disk.stats()["queued"] >= disk.max_queue:
                disk.flush()
            disk.put(key, meta, np.stack([k[:, j], v[:, j]]))

    # -- copies up --------------------------------------------------------------------------
    def gather(self, slots: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The slots' K and V as the scatter program's inputs ([layers * SWAP_BUCKET, ...],
        layer-major; unused entries zero)."""
        self.settle(upto=-1, slots=set(slots))
        data = self.host[slots]  # a copy: [n, 2, layers, ...]
        pad = SWAP_BUCKET - len(slots)
        if pad:
            data = np.concatenate([data, np.zeros((pad, *self.page_shape), self.dtype)])
        data = data.swapaxes(0, 2)  # [layers, 2, n, ...]
        layers = self.page_shape[1]
        k = np.ascontiguousarray(data[:, 0]).reshape(layers * SWAP_BUCKET, *self.page_shape[2:])
        v = np.ascontiguousarray(data[:, 1]).reshape(layers * SWAP_BUCKET, *self.page_shape[2:])
        return k, v

    # -- reads from disk (a worker thread) ---------------------------------------------------
    def load(self, job) -> None:
        """Read a `scheduler.kv_tiers.LoadJob`'s pages from the inbox (pages a prefill
        replica sent) or disk into their slots; sets `job.ok` (a page the disk store
        rejects is False, and logged there) and `job.remote` (it came from the inbox)."""
        ok, remote = [], []
        for slot, key, meta in zip(job.slots, job.keys, job.metas):
            page = self.inbox.take(key, meta) if self.inbox is not None else None
            remote.append(page is not None)
            if page is None and self.disk is not None:
                page = self.disk.get(key, meta)
            if page is not None:
                self.host[slot] = page
            ok.append(page is not None)
        job.ok, job.remote = ok, remote

    def close(self) -> None:
        self.settle()
        if self.inbox is not None:
            self.inbox.close()
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> dict:
        return {"host_slots": self.host_slots, "page_bytes": self.page_bytes,
                "disk": self.disk.stats() if self.disk is not None else None}
