"""The KV cache's tiers below the device pool: host RAM and local disk (the books).

The prefix cache (scheduler/pages.py) keeps full prompt pages on the device until the pool
needs them back. With tiers on, eviction moves a cached page down instead of dropping it,
and a prefix hit continues below the device:

- **host**: `host_slots` pages of a preallocated host buffer (model/kv_tiers.py holds the
  bytes). A device page evicted from the prefix cache is copied into a host slot (a
  *swap-out*, `StepPlan.swap_out`, run by the runner before the step that may overwrite
  the page) unless its key is there already. A later prompt whose pages continue in the
  host tier gets fresh device pages for them and a *swap-in* (`StepPlan.swap_in`, run
  before the step's chunks) instead of a prefill: copying a page up costs a memcpy, or a
  PCIe transfer on a GPU, where recomputing it costs its share of a prompt's step. The
  host tier keeps a copy after a swap-in (it is inclusive: the device page evicted again
  needs no copy down).
- **disk**: every page that enters the host tier is also written to a directory
  (model/kv_disk.py, asynchronous, files named by the page's key and checked by a
  checksum and the model's fingerprint on read), which survives a restart. A prompt whose
  pages continue on disk waits (others go ahead) while a worker thread reads them into
  host slots (`take_loads`, `loaded`, run by the engine); then it is admitted as a host
  hit. A file that fails its checks is dropped and those pages are computed.

Keys are the prefix cache's: page i's key hashes page i-1's key, the cache salt (tenant,
adapter) and its tokens, with a stable hash (`pages.chain_key`), so a key means the same
in the next process and one tenant's pages are never another's hit; every hit is
confirmed against the page's (parent, salt, tokens), here and on disk.

Copy-up or recompute: `worth` compares the measured seconds per prompt token of prefill
with the copy's bytes at the tier's measured rate (priors until measured).

Everything here runs on the engine's thread; the runner only follows the plan's lists.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Container, Iterator

Meta = tuple  # (parent key, salt, token ids): what a page holds

# Copy rates assumed until measured (bytes/s): host memory to the device pool, disk to host.
_PRIOR_HOST_BPS = 2e9
_PRIOR_DISK_BPS = 2e8
_RATE_ALPHA = 0.2  # weight of each new measurement


@dataclass(slots=True)
class LoadJob:
    """Pages a worker thread reads from disk into host slots (`KVTiers.take_loads`)."""

    slots: list[int]
    keys: list[int]
    metas: list[Meta]
    ok: list[bool] = field(default_factory=list)  # filled by the reader, one per page
    remote: list[bool] = field(default_factory=list)  # ... sent by a prefill replica


class KVTiers:
    """Books of the host tier (which slot holds which key, LRU) and the disk tier's index
    (`disk`: any container of keys, thread-safe; None: no disk tier)."""

    def __init__(self, host_slots: int, page_bytes: int, *,
                 disk: Container[int] | None = None, page_size: int = 16) -> None:
        if host_slots < 1:
            raise ValueError(f"{host_slots=} must be >= 1 (no host tier: no tiers)")
        self.host_slots = host_slots
        self.page_bytes = page_bytes
        self.page_size = page_size
        self.disk = disk
        self._free: deque[int] = deque(range(host_slots))
        self._lru: OrderedDict[int, None] = OrderedDict()  # resident slots, oldest first
        self._slot_of_key: dict[int, int] = {}
        self._key_of: list[int | None] = [None] * host_slots
        self._meta: list[Meta | None] = [None] * host_slots
        self._loading: dict[int, int] = {}  # key -> slot being read from disk
        self._jobs: list[LoadJob] = []  # loads asked for, not yet started
        self._from_disk: set[int] = set()  # slots read from disk, not hit since
        self._remote: set[int] = set()  # ... of them, pages a prefill replica sent
        # Slots a copy up of the plan being built reads: never reused in the same plan
        # (its copies down would land there first; `PageAllocator.take_swaps` unpins).
        self.pinned: set[int] = set()
        # Slots with a copy down planned and not yet known done (until its step is
        # committed): a disk read never takes one, its thread would race the runner.
        self._unsettled: dict[int, int] = {}
        # Counters (tokens and bytes), for /metrics.
        self.hit_tokens = {"host": 0, "disk": 0, "remote": 0}
        self.copy_up_bytes = 0  # host -> device
        self.copy_down_bytes = 0  # device -> host
        self.disk_read_bytes = 0
        self.disk_failed_pages = 0
        self.rate = {"host": _PRIOR_HOST_BPS, "disk": _PRIOR_DISK_BPS}  # measured, bytes/s

    # -- counts -----------------------------------------------------------------------------
    @property
    def num_host_pages(self) -> int:
        return len(self._lru)

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    @property
    def num_unsettled(self) -> int:
        """Host slots with a copy down whose step has not been committed yet."""
        return len(self._unsettled)

    # -- moving down ------------------------------------------------------------------------
    def demote(self, key: int, meta: Meta) -> int | None:
        """A cached device page is evicted: the host slot its contents go to, or None when
        none is needed (the key is already in the host tier, or being read into it)."""
        slot = self._slot_of_key.get(key)
        if slot is not None or key in self._loading:
            if slot in self._lru:
                self._lru.move_to_end(slot)
            return None
        slot = self._take_slot()
        if slot is None:
            return None  # every slot is being loaded: nothing to evict
        self._set(slot, key, meta)
        self._lru[slot] = None
        self._unsettled[slot] = self._unsettled.get(slot, 0) + 1
        self.copy_down_bytes += self.page_bytes
        return slot

    def settled(self, slots) -> None:
        """The steps carrying these copies down are done (committed or failed)."""
        unsettled = self._unsettled
        for slot in slots:
            n = unsettled.get(slot, 0) - 1
            if n > 0:
                unsettled[slot] = n
            else:
                unsettled.pop(slot, None)

    def forget(self, keys) -> None:
        """The step that was to compute (or copy down) these pages failed: the host tier
        must not offer them."""
        for key in keys:
            slot = self._slot_of_key.get(key)
            if slot is not None and slot in self._lru:
                self._unset(slot)
                del self._lru[slot]
                self._free.append(slot)

    # -- hits -------------------------------------------------------------------------------
    def match(self, metas: Iterator[tuple[int, Meta]]) -> list[int]:
        """Host slots holding the pages `metas` yields ((key, meta), in order) up to the
        first miss; each is touched (most recently used)."""
        out = []
        for key, meta in metas:
            slot = self._slot_of_key.get(key)
            if slot is None or slot not in self._lru or self._meta[slot] != meta:
                break
            self._lru.move_to_end(slot)
            out.append(slot)
        return out

    def has(self, key: int) -> bool:
        """Is the page in a tier below the device (or on its way up from disk)?"""
        return (key in self._slot_of_key or key in self._loading
                or (self.disk is not None and key in self.disk))

    def count_hits(self, slots: list[int]) -> None:
        """Hits on these host slots, in tokens, by the tier they came from (remote: sent
        by a prefill replica)."""
        for slot in slots:
            tier = ("remote" if slot in self._remote else "disk" if slot in self._from_disk
                    else "host")
            self._from_disk.discard(slot)
            self._remote.discard(slot)
            self.hit_tokens[tier] += self.page_size

    def on_disk(self, metas: Iterator[tuple[int, Meta]]) -> tuple[list[tuple[int, Meta]], bool]:
        """The run of pages `metas` yields that the disk tier has (not in the host tier),
        and whether one of them is being read already."""
        run, busy = [], False
        if self.disk is None:
            return run, busy
        for key, meta in metas:
            if key in self._loading:
                busy = True
                break
            if key in self._slot_of_key or key not in self.disk:
                break
            run.append((key, meta))
        return run, busy

    def worth(self, num_pages: int, tier: str, prefill_token_s: float | None) -> bool:
        """Copy these pages up rather than compute them? Measured prefill cost per token
        against the bytes at the tier's measured rate (copy until prefill is measured)."""
        if num_pages <= 0:
            return False
        if not prefill_token_s:
            return True
        copy_s = num_pages * self.page_bytes / self.rate[tier]
        return copy_s < num_pages * self.page_size * prefill_token_s

    def note_rate(self, tier: str, nbytes: int, seconds: float) -> None:
        """A copy's measured throughput into the tier's rate."""
        if nbytes > 0 and seconds > 0:
            r = self.rate[tier]
            self.rate[tier] = r + _RATE_ALPHA * (nbytes / seconds - r)

    # -- reading from disk ------------------------------------------------------------------
    def request_load(self, run: list[tuple[int, Meta]], keep: list[int] = ()) -> int:
        """Reserve host slots for a run of disk pages and queue their read (`take_loads`);
        returns how many pages will be read (fewer, or none, when slots run short). The
        slots in `keep` (the host hits of the same prompt) and those read from disk and
        not hit since are never taken for it: two prompts cannot evict each other's pages
        back and forth; nor one whose copy down may not have landed yet."""
        job = LoadJob([], [], [])
        spare = {*keep, *self._from_disk, *self._unsettled}
        for key, meta in run:
            slot = self._take_slot(spare)
            if slot is None:
                break
            self._key_of[slot], self._meta[slot] = key, meta
            self._loading[key] = slot
            job.slots.append(slot)
            job.keys.append(key)
            job.metas.append(meta)
        if job.slots:
            self._jobs.append(job)
        return len(job.slots)

    def take_loads(self) -> list[LoadJob]:
        """The loads asked for since the last call (the engine runs each in a thread)."""
        jobs, self._jobs = self._jobs, []
        return jobs

    def loaded(self, job: LoadJob, seconds: float = 0.0) -> None:
        """A load is done: pages read intact join the host tier, the others' slots are
        freed (the disk store has dropped and logged them)."""
        good = 0
        for i, (slot, key) in enumerate(zip(job.slots, job.keys)):
            del self._loading[key]
            if i < len(job.ok) and job.ok[i]:
                self._slot_of_key[key] = slot
                self._lru[slot] = None
                self._from_disk.add(slot)
                if i < len(job.remote) and job.remote[i]:
                    self._remote.add(slot)
                good += 1
            else:
                self._key_of[slot] = self._meta[slot] = None
                self._free.append(slot)
                self.disk_failed_pages += 1
        self.disk_read_bytes += good * self.page_bytes
        if good:
            self.note_rate("disk", good * self.page_bytes, seconds)

    # -- internals --------------------------------------------------------------------------
    def _take_slot(self, spare: Container[int] = ()) -> int | None:
        """A free slot, else the least recently used one neither pinned nor in `spare`."""
        if self._free:
            return self._free.popleft()
        pinned = self.pinned
        for slot in self._lru:
            if slot not in spare and slot not in pinned:
                del self._lru[slot]
                self._unset(slot)
                return slot
        return None

    def _set(self, slot: int, key: int, meta: Meta) -> None:
        self._key_of[slot], self._meta[slot] = key, meta
        self._slot_of_key[key] = slot

    def _unset(self, slot: int) -> None:
        self._from_disk.discard(slot)
        self._remote.discard(slot)
        key = self._key_of[slot]
        if key is not None and self._slot_of_key.get(key) == slot:
            del self._slot_of_key[key]
        self._key_of[slot] = self._meta[slot] = None

    def audit(self) -> list[str]:
        """Each slot free, resident (in the LRU, under its key) or loading, exactly once."""
        problems = []
        free, lru, loading = set(self._free), set(self._lru), set(self._loading.values())
        if len(free) != len(self._free):
            problems.append("a host slot is free twice")
        if free & lru or free & loading or lru & loading:
            problems.append("a host slot is in two states")
        if len(free) + len(lru) + len(loading) != self.host_slots:
            problems.append(f"host slots: {len(free)} free + {len(lru)} resident + "
                            f"{len(loading)} loading != {self.host_slots}")
        for slot in lru:
            key = self._key_of[slot]
            if key is None or self._slot_of_key.get(key) != slot:
                problems.append(f"resident host slot {slot} is not found under its key")
        if len(self._slot_of_key) != len(lru):
            problems.append(f"{len(self._slot_of_key)} host keys for {len(lru)} resident slots")
        return problems

    def stats(self) -> dict:
        disk = self.disk.stats() if hasattr(self.disk, "stats") else None
        return {"host_pages": len(self._lru), "host_slots": self.host_slots,
                "host_bytes": len(self._lru) * self.page_bytes,
                "host_capacity_bytes": self.host_slots * self.page_bytes,
                "page_bytes": self.page_bytes, "disk": disk,
                "loading_pages": len(self._loading),
                "hit_tokens": dict(self.hit_tokens),
                "copy_up_bytes": self.copy_up_bytes, "copy_down_bytes": self.copy_down_bytes,
                "disk_read_bytes": self.disk_read_bytes,
                "disk_failed_pages": self.disk_failed_pages,
                "rate_bps": {k: round(v) for k, v in self.rate.items()}}
