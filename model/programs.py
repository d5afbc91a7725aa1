"""Which step shapes are compiled, and compiling the rest while the server already serves.

A runner's buckets are known at start; compiling all of them before serving made `make
serve` wait minutes. `Programs` instead compiles a few *essential* buckets before the
runner is used (the largest, which holds every plan, so a step never waits for a
compile, plus the smallest ones a first request needs) and the others in a background thread, most
useful first. A step uses the smallest ready bucket that holds it (`pick`): while the
rest compile, some steps run padded, never late. Steady state never compiles.

`build(bucket)` does the work for one bucket (compile its step and samplers, run them
once); it runs under no lock of ours, so the runner guards its own state.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable

from . import host_memory
from .packing import Bucket

log = logging.getLogger("sluice.programs")


class Programs:
    def __init__(self, buckets: Iterable[Bucket], build: Callable[[Bucket], None]) -> None:
        self.all = sorted(set(buckets), key=background_order)
        if not self.all:
            raise ValueError("no buckets to compile")
        # The buckets no other holds: together they hold every plan the set can run (a
        # serving pool's config makes that one bucket, the largest pair).
        self.maximal = [b for b in self.all
                        if not any(o != b and o.covers(b) for o in self.all)]
        self._build = build
        self._ready: list[Bucket] = []  # ascending cost: pick takes the first that holds
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.compile_seconds = 0.0
        self.error: BaseException | None = None

    # -- state ------------------------------------------------------------------------------
    @property
    def ready(self) -> list[Bucket]:
        return list(self._ready)

    @property
    def remaining(self) -> int:
        return len(self.all) - len(self._ready)

    def pick(self, need: Bucket) -> Bucket | None:
        """The cheapest ready bucket that holds `need` (None: none does yet)."""
        for b in self._ready:
            if b.covers(need):
                return b
        return None

    def essential(self, *needs: Bucket) -> list[Bucket]:
        """What to compile before serving: the maximal buckets (so that every plan has
        one), a single-sequence decode, and for each of `needs` the smallest bucket
        holding it."""
        out = list(self.maximal)
        for need in (Bucket(1, 0), *needs):
            best = min((b for b in self.all if b.covers(need)), key=_cost, default=None)
            if best is not None and best not in out:
                out.append(best)
        return out

    # -- compiling -----------------------------------------------------------------------
    def compile(self, buckets: Iterable[Bucket],
                progress: Callable[[str, int, int], None] | None = None) -> None:
        """Compile `buckets` now, in this thread."""
        todo = [b for b in buckets if b not in self._ready]
        for i, b in enumerate(todo):
            if progress:
                progress(describe(b), i, len(todo))
            self._compile_one(b)
        if progress:
            progress("done", len(todo), len(todo))

    def compile_in_background(self, on_done: Callable[[], None] | None = None) -> None:
        """Compile every bucket not ready yet in a daemon thread, most useful first."""
        if self._thread is not None or not self.remaining:
            if on_done and not self.remaining:
                on_done()
            return

        def run() -> None:
            try:
                for b in self.all:
                    if self._stop.is_set():
                        return
                    if b not in self._ready:
                        self._compile_one(b)
            except BaseException as e:  # noqa: BLE001 - reported, and serving goes on
                self.error = e
                log.exception("background compile failed; serving on %d ready shapes",
                              len(self._ready))
            finally:
                if on_done:
                    on_done()

        self._thread = threading.Thread(target=run, name="sluice-compile", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background compile; True when it has ended."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def close(self, timeout: float = 60.0) -> None:
        """Stop after the bucket being compiled now, and wait for that: a daemon thread
        still inside XLA's compiler when the interpreter exits is ended by a forced unwind
        through C++ frames, which can abort the process (as `ReadyTimes.close` found)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _compile_one(self, b: Bucket) -> None:
        t0 = time.perf_counter()
        self._build(b)
        host_memory.trim()  # what the compiler freed (model/host_memory.py)
        with self._lock:
            self.compile_seconds += time.perf_counter() - t0
            self._ready = sorted({*self._ready, b}, key=_cost)


def _cost(b: Bucket) -> tuple[int, int]:
    return (b.dec_rows + b.pf_tokens, b.dec_rows)


def background_order(b: Bucket) -> tuple[int, int, int]:
    """Decode-only steps first (every stream needs them), then prompt-only, then mixed,
    each smallest first."""
    kind = 0 if b.pf_tokens == 0 else 1 if b.dec_rows == 0 else 2
    return (kind, b.pf_tokens, b.dec_rows)


def describe(b: Bucket) -> str:
    return f"step decode={b.dec_rows} prefill={b.pf_tokens}"
