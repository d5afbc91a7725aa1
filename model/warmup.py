"""Warm-up: before serving, compile and run once the shapes a first request needs
(`warm_essential`), then the rest in a background thread (`warm_in_background`); a
multi-host follower only compiles (`precompile_in_background`). Each shape's first run
happens here, not in a request (XLA:CPU's first run of an executable costs 0.1-0.4 s
extra), and a few are timed: the step-cost model's estimates before any request ran.

`WarmUp` is a mixin of `ModelRunner` (model/runner.py); which shapes are essential and
the background thread are `model/programs.py`'s, the compiles `model/compiling.py`'s.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable

import numpy as np

from .compiling import SAMPLERS
from .packing import Bucket

log = logging.getLogger("sluice.runner")


class WarmUp:
    """Compile-and-run-once of the runner's shapes, and their timed runs."""

    def warmup(self, buckets: Iterable[Bucket] | None = None,
               progress: Callable[[str, int, int], None] | None = None) -> None:
        """Compile, and run once, the steps of `buckets` (None: every bucket) with their
        samplers, the page copy and the attention backend's own programs."""
        if self.mirror is not None:  # a follower lost meanwhile must not hang the start
            return self.mirror.watch(self._warmup, buckets, progress)
        self._warmup(buckets, progress)

    def _warmup(self, buckets, progress) -> None:
        self._warm_support()
        self.programs.compile(self.programs.all if buckets is None else buckets, progress)

    def warm_essential(self, prompt_lengths: Iterable[int] = (64,),
                       progress: Callable[[str, int, int], None] | None = None) -> None:
        """Just enough to serve (`Programs.essential`), plus the smallest shapes that hold
        the prefill chunks of prompts of `prompt_lengths` tokens (a first question; the
        one prompt of `sluice generate`)."""
        chunk, bq = self.limits.max_prefill_chunk, self.block_q
        needs = {Bucket(0, -(-c // bq) * bq) for n in prompt_lengths
                 for c in ([n] if n <= chunk else [chunk, n % chunk or chunk])}
        self.warmup(self.programs.essential(*sorted(needs)), progress)

    def warm_in_background(self, on_done: Callable[[], None] | None = None) -> None:
        """Compile every bucket not ready yet in a background thread."""
        self.programs.compile_in_background(on_done)

    @property
    def warmup_remaining(self) -> int:
        return self.programs.remaining

    def _warm_support(self) -> None:
        with self._lock:
            self._dev_support()

    def _build(self, b: Bucket) -> None:
        """Compile bucket `b`'s step and samplers, then run each once on inputs that touch
        only the null page: XLA:CPU's first run of an executable costs 0.1-0.4 s extra,
        which otherwise lands in the first request to need it (docs/architecture.md)."""
        self._precompile(b)
        layout = self._dummy(b)
        rows = self._sample_rows(b)
        with self._lock:
            prev = self._prev_tokens  # a step in flight's tokens, which the next one reads
            self._dev_step(b, self._batch(layout, []))
            for kind in SAMPLERS:  # (both branches of the top-20's `cond` run once)
                for top in (False, True):
                    np.asarray(self._dev_sample(kind, rows,
                                                self._sampling_args(kind, rows, [], top)))
            self._prev_tokens = prev
        if not self.time_all_shapes and b.pf_tokens not in (0, max(self.prefill_buckets)):
            return
        # Once more, timed (the first run's extra cost is gone): the step-cost estimate
        # admission predicts from until real steps are measured. The model needs each
        # decode size's time and one prefill token's cost: the decode-only shapes and the
        # largest prefill bucket beside each mixed decode size are enough.
        with self._lock:
            prev = self._prev_tokens
            t0 = time.perf_counter()
            self._dev_step(b, self._batch(layout, []))
            np.asarray(self._dev_sample("greedy", rows,
                                        self._sampling_args("greedy", rows, [])))
            self.warmup_times.append((b.dec_rows, b.pf_tokens, time.perf_counter() - t0))
            self._prev_tokens = prev

    def _precompile(self, b: Bucket) -> None:
        """Bucket `b`'s step and samplers compiled (nothing runs)."""
        self._program(b)
        for kind in SAMPLERS:
            self._sampler(kind, self._sample_rows(b))

    def precompile_in_background(self) -> None:
        """A multi-host follower's warm-up: compile every shape ahead of the leader's first
        call for it, without running anything (a follower launches only what the leader
        tells it to)."""
        order = [*self.programs.essential(), *self.programs.all]

        def run() -> None:
            try:
                for b in dict.fromkeys(order):
                    self._precompile(b)
            except Exception:  # noqa: BLE001 - compiled on demand instead
                log.exception("precompiling failed; shapes compile when first called")

        threading.Thread(target=run, name="sluice-precompile", daemon=True).start()
