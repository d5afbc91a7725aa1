"""One progress display for fetching, reading and dequantizing weights.

Loading the embedded model takes seconds and an 8B checkpoint minutes, so the user sees
what is happening. The display goes to stderr: stdout belongs to commands whose last
line is machine-readable JSON (`sluice bench-engine`). With ``enabled=False`` every call
is a no-op, so loaders can report progress unconditionally.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


class _NoProgress:
    def add_task(self, description: str, total: float | None = None, **_: object) -> int:
        return 0

    def update(self, task_id: int, **_: object) -> None:
        pass

    def advance(self, task_id: int, advance: float = 1) -> None:
        pass


@contextmanager
def progress(enabled: bool = True) -> Iterator:
    """Yield a `rich.progress.Progress` (or a silent stand-in with the same methods)."""
    if not enabled:
        yield _NoProgress()
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    class _Count(MofNCompleteColumn):
        """Bytes for byte-sized tasks, 'n/m' for counted ones, nothing for spinners."""

        def render(self, task):  # type: ignore[override]
            if task.fields.get("unit") == "bytes":
                return DownloadColumn().render(task)
            if task.total is None:
                return ""
            return super().render(task)

    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        _Count(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=False,
    ) as p:
        yield p
