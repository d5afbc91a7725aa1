"""A step between `ModelRunner.launch` and `ModelRunner.collect`, and when it was ready.

JAX dispatches asynchronously: a compiled step called from Python returns as soon as it
is queued, and the device runs the programs in the order they were queued (each step
takes the KV pool the one before it returned). Overlapped scheduling (scheduler/engine.py)
uses that: step N+1 is packed and queued while step N computes, its pending tokens read
on the device from N's sampler output (`ModelRunner._prev_tokens`), and N's result is
collected after.

To say how long a step computed and how long the computation stood idle before it, the
runner needs the moment each step's output became ready, not the moment somebody asked
for it. `ReadyTimes` is one daemon thread that waits on each launched step's output in
launch order (blocking in XLA, without the GIL) and notes the time.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import jax


@dataclass(slots=True)
class Ticket:
    """When one launched step's output was ready (`at`, perf_counter seconds)."""

    done: threading.Event = field(default_factory=threading.Event)
    at: float = 0.0
    error: BaseException | None = None

    def wait(self) -> float:
        """Block until the output is ready; returns the seconds spent blocked."""
        t = time.perf_counter()
        self.done.wait()
        if self.error is not None:
            raise self.error
        return time.perf_counter() - t


class ReadyTimes:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def watch(self, arrays: Any) -> Ticket:
        """A ticket that is done once every array of `arrays` is computed."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sluice-ready",
                                            daemon=True)
            self._thread.start()
        ticket = Ticket()
        self._queue.put((arrays, ticket))
        return ticket

    def close(self) -> None:
        """Stop the thread once the steps already handed to it are computed, and wait for
        that (a step or two): a daemon thread still inside `block_until_ready` when the
        interpreter exits is ended by a forced unwind through C++ frames, and the process
        aborted ("FATAL: exception not rethrown", exit -6) after a second SIGTERM."""
        if self._thread is not None:
            self._queue.put((None, None))
            self._thread.join(timeout=30)
            self._thread = None

    def _run(self) -> None:
        while True:
            arrays, ticket = self._queue.get()
            if ticket is None:
                return
            try:
                jax.block_until_ready(arrays)
            except BaseException as exc:  # noqa: BLE001 - handed to the collector
                ticket.error = exc
            ticket.at = time.perf_counter()
            ticket.done.set()


@dataclass(slots=True)
class Launched:
    """What `collect` needs of a launched step."""

    layout: Any  # packing.StepLayout
    bucket: Any  # packing.Bucket
    logits: Any  # device [sample rows, vocab]
    packed: Any  # the sampler's device output (None: nothing sampled)
    scores: Any  # prompt scoring's device output (None: nothing scored)
    ticket: Ticket
    t0: float  # launch began (perf_counter)
    t_dispatch: float  # packing done, programs being queued
    swap_mark: int = 0  # the KV tiers' copies down queued up to its launch (`settle`)
    swap_in_s: float = 0.0  # seconds its copies up took (`StepResult.swap_in_seconds`)
