"""A progress bar on stderr, so stdout stays clean for the JSON line.

The bar counts finished requests when the run is bounded by a count, and seconds when it
is bounded by time (`tick` advances it between completions, which can be minutes apart).
Disabled, every method does nothing, so callers never test for it.
"""

from __future__ import annotations

import time
from collections import Counter
from types import TracebackType

import trio
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn,
                           TextColumn, TimeElapsedColumn)

from .client import RequestRecord


class RunProgress:
    def __init__(self, description: str, *, total_requests: int | None = None,
                 duration_s: float | None = None, enabled: bool = True) -> None:
        self.by_time = total_requests is None and duration_s is not None
        self.total = duration_s if self.by_time else total_requests
        self.description = description
        self.enabled = enabled
        self.outcomes: Counter[str] = Counter()
        self.began = time.perf_counter()
        self._bar: Progress | None = None
        self._task = None

    def __enter__(self) -> RunProgress:
        if self.enabled:
            count = TaskProgressColumn() if self.by_time else MofNCompleteColumn()
            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), count,
                                 TimeElapsedColumn(), TextColumn("{task.fields[outcomes]}"),
                                 console=Console(stderr=True), transient=False)
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=self.total, outcomes="")
        self.began = time.perf_counter()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._update()
            self._bar.stop()

    def done(self, rec: RequestRecord) -> None:
        self.outcomes[rec.status] += 1
        self._update()

    async def tick(self, interval_s: float = 0.5) -> None:
        """Keep a time-bounded bar moving until cancelled."""
        while self._bar is not None and self.by_time:
            self._update()
            await trio.sleep(interval_s)

    def _update(self) -> None:
        if self._bar is None or self._task is None:
            return
        n = sum(self.outcomes.values())
        done = time.perf_counter() - self.began if self.by_time else n
        if self.total is not None:
            done = min(done, self.total)
        text = " ".join(f"{k}={v}" for k, v in sorted(self.outcomes.items()))
        self._bar.update(self._task, completed=done, outcomes=text)
