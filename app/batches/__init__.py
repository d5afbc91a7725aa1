"""Batch jobs: work with a deadline instead of a waiting user, run in idle capacity.

    store.py    the durable store: SQLite (WAL), schema migrations, one owner per directory
    lines.py    JSONL and the platform's form -> validated request lines
    worker.py   runs stored batches through the engines, earliest deadline first
    routes.py   /v1/files and /v1/batches (OpenAI's Batch API, and the platform's form)

docs/operations.md, "Batch jobs", says how to run and size them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import trio

from config.settings import BatchConfig

from .store import AsyncStore, Store, default_data_dir
from .worker import BatchWorker


@dataclass
class Batches:
    store: AsyncStore
    worker: BatchWorker

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self.store.call(self.store.sync.close)


def data_dir(config: BatchConfig) -> Path:
    """The store's directory: the config's, else $SLUICE_DATA_DIR, else the user's."""
    if config.data_dir:
        return Path(config.data_dir).expanduser()
    env = os.environ.get("SLUICE_DATA_DIR")
    return Path(env).expanduser() if env else default_data_dir()


async def open_batches(state) -> Batches | None:  # type: ignore[no-untyped-def]
    """Open the store (raises `StoreLocked` if another server owns it) and make the worker
    (started by the server once the pools are ready)."""
    config = state.settings.batches
    if not config.enabled:
        return None
    store = AsyncStore(await trio.to_thread.run_sync(Store, data_dir(config)))
    return Batches(store, BatchWorker(state, store, config))
