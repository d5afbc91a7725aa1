"""The waiting queue: priority classes, per-tenant FIFOs, weighted fair share over tokens.

Admission order, most important rule first:

1. Priority class: interactive before ``batch=True``, then smaller `priority` first. Strict:
   a lower class is considered only when no tenant of a higher class can start. Batch
   work goes further and waits while *any* interactive request waits (it runs only in
   idle capacity).
2. Within a class, the tenant that has been served the fewest weighted tokens goes next
   (a virtual token counter per tenant, as in VTC, "Fairness in Serving Large Language
   Models", OSDI'24). It is deficit round robin over tokens generalised to jobs whose
   length is unknown at admission: a tenant is charged its prompt tokens when a request is
   admitted (cache hits are free) and one token per decode step as it generates,
   divided by its weight. A tenant with a script that floods the queue only moves its
   own counter; everyone else's requests go ahead of its backlog until the counters meet.
3. Within a tenant, FIFO; a preempted sequence returns to the front of its tenant's line.
   (A sequence that chooses to wait for a shared prefix being computed lets the ones
   behind it go first.)

A tenant that was idle does not bank credit: when it becomes active again its counter is
lifted to the smallest counter among the active tenants (waiting or running), so it gets
its share from now on, not a burst to repay the past.

Per-tenant concurrency limits (`GenerateRequest.tenant_max_running`) are checked here too:
a tenant at its limit is skipped, and the next tenant of the same class gets the slot.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Collection, Iterator

from .request import Phase, Sequence


class FairQueue:
    def __init__(self) -> None:
        # class key -> tenant -> FIFO; empty FIFOs and classes are removed at once.
        self._classes: dict[tuple[int, int], dict[str, deque[Sequence]]] = {}
        self._class_order: list[tuple[int, int]] = []  # sorted keys of _classes
        self._served: dict[str, float] = {}  # tenant -> weighted tokens charged
        self._waiting_of: dict[str, int] = {}
        self._running_of: dict[str, int] = {}
        self._deadlines: list[tuple[float, int, Sequence]] = []  # lazy-deletion heap
        self.num_waiting = 0
        self.num_tokens = 0  # tokens of waiting sequences (the queue's token bound)
        self.num_interactive = 0
        self.num_batch_tokens = 0  # of those tokens, batch jobs'
        self.num_uncached = 0  # interactive sequences' `uncached_tokens`: their prefill work

    def __len__(self) -> int:
        return self.num_waiting

    def __iter__(self) -> Iterator[Sequence]:
        for key in self._class_order:
            for fifo in self._classes[key].values():
                yield from fifo

    # -- entering and leaving --------------------------------------------------------------
    def push(self, seq: Sequence, *, front: bool = False) -> None:
        """Queue a sequence (a new one at the back; a preempted one at the front)."""
        key = seq.class_key
        tenants = self._classes.get(key)
        if tenants is None:
            tenants = self._classes[key] = {}
            self._class_order.append(key)
            self._class_order.sort()
        fifo = tenants.get(seq.tenant)
        if fifo is None:
            fifo = tenants[seq.tenant] = deque()
        if front:
            fifo.appendleft(seq)
        else:
            fifo.append(seq)
            if seq.admitted_at is None:
                heapq.heappush(self._deadlines, (seq.deadline_at, seq.arrival_order, seq))
        self._count(seq, +1)

    def remove(self, seq: Sequence) -> bool:
        """Take a sequence out wherever it is (abort, shed). O(its tenant's FIFO)."""
        key = seq.class_key
        tenants = self._classes.get(key)
        fifo = tenants.get(seq.tenant) if tenants else None
        if fifo is None:
            return False
        try:
            fifo.remove(seq)
        except ValueError:
            return False
        self._after_removal(key, tenants, seq.tenant, fifo)
        self._count(seq, -1)
        return True

    def admit(self, seq: Sequence) -> None:
        """Move `seq`, which `peek` just returned, from waiting to running."""
        # Running first, so the tenant never looks idle in between (that resets credit).
        self._running_of[seq.tenant] = self._running_of.get(seq.tenant, 0) + 1
        key = seq.class_key
        tenants = self._classes[key]
        fifo = tenants[seq.tenant]
        if fifo[0] is seq:
            fifo.popleft()
        else:
            fifo.remove(seq)  # it was behind sequences that chose to wait
        self._after_removal(key, tenants, seq.tenant, fifo)
        self._count(seq, -1)

    def _after_removal(self, key, tenants, tenant, fifo) -> None:
        if not fifo:
            del tenants[tenant]
            if not tenants:
                del self._classes[key]
                self._class_order.remove(key)

    def _count(self, seq: Sequence, d: int) -> None:
        self.num_waiting += d
        self.num_tokens += d * len(seq.token_ids)
        if not seq.batch:
            self.num_interactive += d
            self.num_uncached += d * seq.uncached_tokens
        else:
            self.num_batch_tokens += d * len(seq.token_ids)
        t = seq.tenant
        n = self._waiting_of.get(t, 0)
        if d > 0 and n == 0 and not self._running_of.get(t):
            self._lift(t)
        if n + d:
            self._waiting_of[t] = n + d
        else:
            del self._waiting_of[t]
            if t not in self._running_of:
                self._served.pop(t, None)  # idle now: see `stopped`

    def _lift(self, tenant: str) -> None:
        active = [self._served.get(t, 0.0) for t in (*self._waiting_of, *self._running_of)
                  if t != tenant]
        if active:
            self._served[tenant] = max(self._served.get(tenant, 0.0), min(active))

    # -- choosing ------------------------------------------------------------------------
    def peek(self, skip: Collection[Sequence] = ()) -> Sequence | None:
        """The next sequence to admit, or None when nobody may start (empty, tenants at
        their limits, or only batch work while interactive requests wait). Sequences in
        `skip` chose to wait this time; the one behind them in their line is offered."""
        for key in self._class_order:
            if key[0] and self.num_interactive:
                return None  # batch classes sort last; they wait for the queue to clear
            best, best_served = None, 0.0
            for tenant, fifo in self._classes[key].items():
                head = fifo[0]
                if skip and head in skip:
                    head = next((s for s in fifo if s not in skip), None)
                    if head is None:
                        continue
                if head.max_running is not None and \
                        self._running_of.get(tenant, 0) >= head.max_running:
                    continue
                served = self._served.get(tenant, 0.0)
                if best is None or served < best_served:
                    best, best_served = head, served
            if best is not None:
                return best
        return None

    # -- accounting the scheduler reports ------------------------------------------------
    def charge(self, seq: Sequence, upto: int) -> None:
        """Charge the tenant for the sequence's positions up to `upto` not charged before
        (a preempted sequence's recompute is on the house)."""
        d = upto - seq.num_charged_tokens
        if d > 0:
            seq.num_charged_tokens = upto
            self._served[seq.tenant] = self._served.get(seq.tenant, 0.0) + d / seq.weight

    def stopped(self, seq: Sequence) -> None:
        """A running sequence finished or was preempted."""
        n = self._running_of[seq.tenant] - 1
        if n:
            self._running_of[seq.tenant] = n
        else:
            del self._running_of[seq.tenant]
            if seq.tenant not in self._waiting_of:
                # Forget idle tenants so the table does not grow with every tenant ever
                # seen; the lift on return would have reset their credit anyway.
                self._served.pop(seq.tenant, None)

    # -- deadlines -----------------------------------------------------------------------
    def expired(self, now: float) -> list[Sequence]:
        """Remove and return sequences that waited past their deadline without ever
        starting (a preempted sequence already streamed tokens: it is never shed)."""
        out = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, seq = heapq.heappop(heap)
            if seq.phase is Phase.QUEUED and seq.admitted_at is None and self.remove(seq):
                out.append(seq)
        return out

    def next_deadline(self) -> float | None:
        return self._deadlines[0][0] if self._deadlines else None

    def oldest_queued_at(self) -> float | None:
        return min((s.queued_at for s in self), default=None)
