"""The event loop before the computation: on Linux, every thread of the process but the one
that runs trio (which accepts connections, parses HTTP, answers at the door and writes the
streams) runs at a lower CPU priority, a higher nice value (`server.compute_nice`).

Why: on a CPU the model's steps keep every core busy (XLA's threads, the native kernels',
the engine's step workers), and the event loop got only its share of a core beside them,
so a flood of new connections waited seconds to be told no (docs/benchmarks.md, "A door
that says no in milliseconds"). With the compute threads niced, the event loop takes a
core whenever it has work, and the computation has every cycle it leaves: its own work
is a few ms a step. On a GPU the compute threads mostly wait; nothing changes there.

Threads are found in /proc/self/task, once a second (XLA and the kernels start theirs
lazily); raising one's own threads' nice value needs no privilege. Threads a niced thread
starts inherit its value.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import trio

log = logging.getLogger("sluice.server")


def _threads() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def renice_others(nice: int, keep: int, done: set[int]) -> int:
    """Give every thread of this process but `keep` (and those in `done`) the nice value
    `nice`; adds them to `done` and returns how many changed."""
    changed = 0
    for tid in _threads() - done - {keep}:
        done.add(tid)
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                changed += 1
        except OSError:  # it ended meanwhile
            pass
    return changed


async def keep_compute_below(nice: int, interval_s: float = 1.0) -> None:
    """Run for the server's life: the calling (event loop) thread keeps its priority, every
    other thread gets `nice`. 0, or not Linux: nothing."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    keep = threading.get_native_id()
    done: set[int] = set()
    first = True
    while True:
        changed = renice_others(nice, keep, done)
        if first and changed:
            log.info("compute threads at nice %d, the event loop's thread at %d", nice,
                     os.getpriority(os.PRIO_PROCESS, keep))
            first = False
        done &= _threads()  # forget the ended ones (their ids may come back)
        await trio.sleep(interval_s)
