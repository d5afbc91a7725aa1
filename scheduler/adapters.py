"""LoRA adapter slots as a scheduled resource, like KV pages.

The runner holds `num_slots` adapters on the device at once; loading one into a slot is a
copy, never a compile. This keeps the books: which adapter each slot holds, how many
running sequences use it (a slot in use is pinned), and how many live sequences, queued
or running, still need an adapter that was unloaded (its weights go once none does).

Policy (used by `Scheduler._admit`): a sequence with an adapter is admitted only when the
adapter is resident, a slot is free, or a slot can be freed: the least recently used
among those no running sequence uses. A load into a slot that held another adapter is a
swap (counted). When every slot is pinned, the sequence waits; base-model sequences go
ahead, but no other adapter sequence is admitted past it in that iteration, so the slots
drain as their sequences finish and the waiting adapter gets one: none starves. Pure
Python; the engine drives it on the trio thread.
"""

from __future__ import annotations

from collections import Counter


class AdapterSlots:
    def __init__(self, num_slots: int) -> None:
        self.holder: list[str | None] = [None] * num_slots  # slot -> adapter name
        self.users: Counter[str] = Counter()  # running sequences holding each adapter
        self.live: Counter[str] = Counter()  # queued or running sequences per adapter
        self.retired: set[str] = set()  # unloaded; dropped once no live sequence needs it
        self._used_at = [0] * num_slots  # LRU clock per slot
        self._clock = 0
        self.loads = 0  # adapters copied into a slot
        self.swaps = 0  # ... replacing another adapter
        self.requests: Counter[str] = Counter()  # sequences submitted, per adapter
        self.tokens: Counter[str] = Counter()  # tokens generated, per adapter

    @property
    def num_slots(self) -> int:
        return len(self.holder)

    def slot_of(self, name: str) -> int | None:
        try:
            return self.holder.index(name)
        except ValueError:
            return None

    def _free_slot(self) -> int | None:
        """A slot to load into: an empty one, else the least recently used unpinned one."""
        empty = [s for s, h in enumerate(self.holder) if h is None]
        if empty:
            return empty[0]
        idle = [s for s, h in enumerate(self.holder) if self.users[h] == 0]
        return min(idle, key=self._used_at.__getitem__) if idle else None

    def available(self, name: str) -> bool:
        """Could a sequence of `name` start running now?"""
        return self.slot_of(name) is not None or self._free_slot() is not None

    def acquire(self, name: str) -> tuple[int, bool]:
        """Pin a slot holding `name` for one more running sequence: (slot, must the runner
        load it first). Call only when `available(name)`."""
        slot, load = self.slot_of(name), False
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                raise RuntimeError(f"no adapter slot for {name!r}: check available() first")
            self.swaps += self.holder[slot] is not None
            self.loads += 1
            self.holder[slot], load = name, True
        self.users[name] += 1
        self._clock += 1
        self._used_at[slot] = self._clock
        return slot, load

    def release(self, name: str) -> None:
        """A running sequence of `name` stopped running (finished or preempted)."""
        if self.users[name] > 0:
            self.users[name] -= 1

    # -- live sequences and unloading ------------------------------------------------------
    def added(self, name: str) -> None:
        self.live[name] += 1
        self.requests[name] += 1

    def ended(self, name: str) -> bool:
        """A sequence of `name` ended; True when `name` was retired and nothing needs its
        weights any more (the caller drops them from the runner)."""
        self.live[name] -= 1
        if self.live[name] <= 0:
            del self.live[name]
            return self._drop_if_retired(name)
        return False

    def retire(self, name: str) -> bool:
        """`name` was unloaded: no new sequence will ask for it. True when nothing needs
        its weights already."""
        self.retired.add(name)
        return self.live[name] <= 0 and self._drop_if_retired(name)

    def _drop_if_retired(self, name: str) -> bool:
        if name not in self.retired:
            return False
        self.retired.discard(name)
        slot = self.slot_of(name)
        if slot is not None:
            self.holder[slot] = None
        return True

    def stats(self) -> dict:
        """What `EngineStats.adapters` reports."""
        running = {n: c for n, c in self.users.items() if c > 0}
        return {"slots": self.num_slots, "resident": [h for h in self.holder if h],
                "running": running,
                "waiting": {n: c - running.get(n, 0) for n, c in self.live.items()
                            if c > running.get(n, 0)},
                "requests": dict(self.requests), "tokens": dict(self.tokens),
                "loads": self.loads, "swaps": self.swaps}
