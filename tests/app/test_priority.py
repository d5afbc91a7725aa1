"""app/priority.py: every thread but the event loop's gets the compute nice value."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from app.priority import renice_others

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="per-thread nice values are Linux's")


def test_other_threads_are_niced_and_the_callers_is_not():
    started, stop = threading.Event(), threading.Event()
    tid: list[int] = []

    def worker() -> None:
        tid.append(threading.get_native_id())
        started.set()
        stop.wait()

    t = threading.Thread(target=worker)
    t.start()
    started.wait()
    try:
        me = threading.get_native_id()
        mine = os.getpriority(os.PRIO_PROCESS, me)
        done: set[int] = set()
        assert renice_others(max(mine, 5), me, done) >= 1 or os.getpriority(
            os.PRIO_PROCESS, tid[0]) >= 5
        assert os.getpriority(os.PRIO_PROCESS, tid[0]) >= 5
        assert os.getpriority(os.PRIO_PROCESS, me) == mine  # the event loop keeps its own
        assert tid[0] in done and me not in done
        assert renice_others(5, me, done) == 0  # each thread once
    finally:
        stop.set()
        t.join()
