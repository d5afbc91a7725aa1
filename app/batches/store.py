"""The durable batch store: one SQLite file (the standard library's sqlite3, WAL mode).

What is in it: uploaded files (their bytes), batches (OpenAI's fields and counts), one
row per request line (its body, and once done its output line), and stored responses
(`/v1/responses` with `store`: the conversation so far and the response object, kept
`response_retention_s`). A request's result and
the batch's counts change in one transaction, so after a crash every accepted request is
either done exactly once or still pending (and is run again): none is lost, none appears
twice. Output and error files are assembled from the rows when a batch finalizes.

The schema is versioned (`PRAGMA user_version`) and migrated forward at open. One server
owns a store: `open` takes an exclusive lock on `<dir>/sluice.lock` and a second server
on the same directory fails with `StoreLocked`, naming the owner's pid.

Everything here is blocking; the server calls it through `AsyncStore` (one worker thread,
so the trio thread never waits on the disk and calls never interleave).
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import trio

# Each entry moves the schema from version i to i + 1; never edit one, append.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE files (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL,
        filename TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL,
        content BLOB NOT NULL);
    CREATE TABLE batches (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, endpoint TEXT NOT NULL,
        input_file_id TEXT, completion_window TEXT NOT NULL, window_s REAL NOT NULL,
        status TEXT NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL,
        in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER,
        failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
        metadata TEXT, output_file_id TEXT, error_file_id TEXT, errors TEXT,
        total INTEGER NOT NULL, completed INTEGER NOT NULL DEFAULT 0,
        failed INTEGER NOT NULL DEFAULT 0, tokens INTEGER NOT NULL DEFAULT 0);
    CREATE INDEX batches_tenant ON batches (tenant, created_at);
    CREATE TABLE requests (
        batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL,
        url TEXT NOT NULL, body BLOB NOT NULL, state TEXT NOT NULL, result BLOB,
        cost INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (batch_id, idx));
    CREATE INDEX requests_state ON requests (batch_id, state, idx);
    """,
    """
    CREATE TABLE responses (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_at INTEGER NOT NULL,
        conversation BLOB NOT NULL, response BLOB NOT NULL);
    CREATE INDEX responses_created ON responses (created_at);
    """,
]
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("completed", "failed", "expired", "cancelled")


class StoreLocked(RuntimeError):
    """Another server process owns this store."""


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return Path(base) / "sluice"


@dataclass
class Line:
    """One request line of a batch, valid (body set) or not (error set)."""

    custom_id: str
    url: str
    body: bytes  # the JSON body as sent
    error: dict | None = None  # {"code", "message"}: goes to the error file at once
    cost: int = 0  # prompt + max_tokens: what the tenant's pending-work quota counts


class Store:
    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory).expanduser()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.dir / "sluice.lock", "a+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.seek(0)
            owner = self._lock_file.read().strip() or "?"
            self._lock_file.close()
            raise StoreLocked(f"the batch store {self.dir} is in use by another sluice "
                              f"server (pid {owner}); give this one another "
                              "[batches] data_dir") from None
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(str(os.getpid()))
        self._lock_file.flush()
        self.db = sqlite3.connect(self.dir / "batches.sqlite3", check_same_thread=False,
                                  isolation_level=None)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")  # a result written is a result kept
        self._mutex = threading.Lock()
        self.migrate()

    def close(self) -> None:
        self.db.close()
        self._lock_file.close()  # releases the lock

    @property
    def version(self) -> int:
        return self.db.execute("PRAGMA user_version").fetchone()[0]

    def migrate(self) -> None:
        v = self.version
        if v > len(MIGRATIONS):
            raise RuntimeError(f"{self.dir}: store schema v{v} is newer than this sluice "
                               f"(v{len(MIGRATIONS)})")
        for i in range(v, len(MIGRATIONS)):  # each step and its version bump: atomic
            self.db.executescript(
                f"BEGIN IMMEDIATE; {MIGRATIONS[i]}; PRAGMA user_version = {i + 1}; COMMIT;")

    def _tx(self):
        return _Tx(self)

    # -- files -------------------------------------------------------------------------
    def add_file(self, file_id: str, tenant: str, purpose: str, filename: str,
                 content: bytes) -> dict:
        now = int(time.time())
        with self._tx():
            self.db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                            (file_id, tenant, purpose, filename, len(content), now, content))
        return self.file(file_id)  # type: ignore[return-value]

    def file(self, file_id: str) -> dict | None:
        row = self.db.execute("SELECT id, tenant, purpose, filename, bytes, created_at "
                              "FROM files WHERE id = ?", (file_id,)).fetchone()
        return dict(row) if row else None

    def file_content(self, file_id: str) -> bytes:
        return self.db.execute("SELECT content FROM files WHERE id = ?",
                               (file_id,)).fetchone()[0]

    def delete_file(self, file_id: str) -> None:
        with self._tx():
            self.db.execute("DELETE FROM files WHERE id = ?", (file_id,))

    def list_files(self, tenant: str, purpose: str | None = None) -> list[dict]:
        q = "SELECT id, tenant, purpose, filename, bytes, created_at FROM files WHERE tenant = ?"
        args: list[Any] = [tenant]
        if purpose:
            q, args = q + " AND purpose = ?", args + [purpose]
        return [dict(r) for r in self.db.execute(q + " ORDER BY created_at, id", args)]

    # -- batches -----------------------------------------------------------------------
    def add_batch(self, batch_id: str, tenant: str, endpoint: str, input_file_id: str | None,
                  window: str, window_s: float, metadata: dict | None,
                  lines: list[Line]) -> dict:
        """Store a batch and every line in one transaction: all of it, or nothing."""
        now = int(time.time())
        invalid = sum(1 for ln in lines if ln.error)
        with self._tx():
            self.db.execute(
                "INSERT INTO batches (id, tenant, endpoint, input_file_id, completion_window,"
                " window_s, status, created_at, expires_at, metadata, total, failed)"
                " VALUES (?, ?, ?, ?, ?, ?, 'validating', ?, ?, ?, ?, ?)",
                (batch_id, tenant, endpoint, input_file_id, window, window_s, now,
                 int(now + window_s), json.dumps(metadata) if metadata else None,
                 len(lines), invalid))
            self.db.executemany(
                "INSERT INTO requests VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [(batch_id, i, ln.custom_id, ln.url, ln.body,
                  "failed" if ln.error else "pending",
                  error_line(batch_id, i, ln.custom_id, ln.error) if ln.error else None,
                  ln.cost) for i, ln in enumerate(lines)])
        return self.batch(batch_id)  # type: ignore[return-value]

    def batch(self, batch_id: str) -> dict | None:
        row = self.db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return dict(row) if row else None

    def list_batches(self, tenant: str, after: str | None, limit: int) -> list[dict]:
        """Newest first; `after` is the last id of the previous page."""
        q, args = "SELECT * FROM batches WHERE tenant = ?", [tenant]
        if after:
            ref = self.batch(after)
            if ref is not None:
                q += " AND (created_at, id) < (?, ?)"
                args += [ref["created_at"], ref["id"]]
        q += " ORDER BY created_at DESC, id DESC LIMIT ?"
        return [dict(r) for r in self.db.execute(q, args + [limit])]

    def active_batches(self) -> list[dict]:
        marks = ",".join("?" * len(ACTIVE))
        return [dict(r) for r in self.db.execute(
            f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY expires_at, id",
            ACTIVE)]

    def pending(self, batch_id: str, limit: int, after_idx: int = -1) -> list[dict]:
        return [dict(r) for r in self.db.execute(
            "SELECT idx, custom_id, url, body FROM requests WHERE batch_id = ? AND "
            "state = 'pending' AND idx > ? ORDER BY idx LIMIT ?", (batch_id, after_idx, limit))]

    def set_status(self, batch_id: str, status: str, **fields: Any) -> None:
        stamp = {"in_progress": "in_progress_at", "finalizing": "finalizing_at",
                 "completed": "completed_at", "failed": "failed_at", "expired": "expired_at",
                 "cancelling": "cancelling_at", "cancelled": "cancelled_at"}.get(status)
        values = {"status": status, **fields}
        if stamp:
            values[stamp] = int(time.time())
        cols = ", ".join(f"{k} = ?" for k in values)
        with self._tx():
            self.db.execute(f"UPDATE batches SET {cols} WHERE id = ?",
                            (*values.values(), batch_id))

    def record(self, batch_id: str, idx: int, ok: bool, line: bytes, tokens: int) -> bool:
        """A request's output line and the batch's counts, together. False when it was
        already recorded (nothing changes: a result is kept exactly once)."""
        with self._tx():
            cur = self.db.execute(
                "UPDATE requests SET state = ?, result = ? WHERE batch_id = ? AND idx = ? "
                "AND state = 'pending'", ("done" if ok else "failed", line, batch_id, idx))
            if cur.rowcount == 0:
                return False
            col = "completed" if ok else "failed"
            self.db.execute(f"UPDATE batches SET {col} = {col} + 1, tokens = tokens + ? "
                            "WHERE id = ?", (tokens, batch_id))
        return True

    def finalize(self, batch_id: str, status: str, output_id: str, error_id: str) -> dict:
        """Write the output and error files from the recorded lines and end the batch in
        `status` (completed, expired or cancelled), in one transaction. Requests never
        run are left out (expired and cancelled batches keep what finished)."""
        b = self.batch(batch_id)
        assert b is not None
        rows = self.db.execute("SELECT state, result FROM requests WHERE batch_id = ? AND "
                               "state != 'pending' ORDER BY idx", (batch_id,)).fetchall()
        out = b"".join(r["result"] + b"\n" for r in rows if r["state"] == "done")
        err = b"".join(r["result"] + b"\n" for r in rows if r["state"] == "failed")
        now = int(time.time())
        stamp = {"completed": "completed_at", "expired": "expired_at",
                 "cancelled": "cancelled_at"}[status]
        with self._tx():
            ids = []
            for fid, content, name in ((output_id, out, "output"), (error_id, err, "errors")):
                if content:
                    self.db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                                    (fid, b["tenant"], "batch_output",
                                     f"{batch_id}_{name}.jsonl", len(content), now, content))
                ids.append(fid if content else None)
            self.db.execute(f"UPDATE batches SET status = ?, {stamp} = ?, output_file_id = ?,"
                            " error_file_id = ? WHERE id = ?",
                            (status, now, ids[0], ids[1], batch_id))
        return self.batch(batch_id)  # type: ignore[return-value]

    def pending_tokens(self, tenant: str) -> int:
        """Prompt + max_tokens of a tenant's requests not yet run (its batch quota)."""
        row = self.db.execute(
            "SELECT COALESCE(SUM(r.cost), 0) FROM requests r JOIN batches b ON "
            "b.id = r.batch_id WHERE b.tenant = ? AND r.state = 'pending' AND "
            "b.status IN ('validating', 'in_progress')", (tenant,)).fetchone()
        return int(row[0])

    def count_pending(self, batch_id: str) -> int:
        return self.db.execute("SELECT COUNT(*) FROM requests WHERE batch_id = ? AND "
                               "state = 'pending'", (batch_id,)).fetchone()[0]


    # -- stored responses (app/responses.py) ----------------------------------------------
    def add_response(self, response_id: str, tenant: str, conversation: bytes,
                     response: bytes, keep_s: float) -> None:
        """Store a response; those older than `keep_s` go in the same transaction."""
        now = int(time.time())
        with self._tx():
            self.db.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?)",
                            (response_id, tenant, now, conversation, response))
            self.db.execute("DELETE FROM responses WHERE created_at < ?", (now - keep_s,))

    def response(self, response_id: str) -> dict | None:
        row = self.db.execute("SELECT id, tenant, created_at, conversation, response "
                              "FROM responses WHERE id = ?", (response_id,)).fetchone()
        return dict(row) if row else None

    def delete_response(self, response_id: str) -> None:
        with self._tx():
            self.db.execute("DELETE FROM responses WHERE id = ?", (response_id,))


class _Tx:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error), one at a time."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def __enter__(self) -> None:
        self.store._mutex.acquire()
        self.store.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, et, e, tb) -> None:
        try:
            self.store.db.execute("ROLLBACK" if et else "COMMIT")
        finally:
            self.store._mutex.release()


def error_line(batch_id: str, idx: int, custom_id: str, error: dict) -> bytes:
    """An error-file line for a request that never ran (invalid)."""
    return json.dumps({"id": f"{batch_id}-{idx}", "custom_id": custom_id, "response": None,
                       "error": error}).encode()


class AsyncStore:
    """`Store` from the trio thread: each call runs in one worker thread, in order."""

    def __init__(self, store: Store) -> None:
        self.sync = store
        self._limiter = trio.CapacityLimiter(1)

    async def call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        return await trio.to_thread.run_sync(lambda: fn(*args, **kw), limiter=self._limiter)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.sync, name)

        async def call(*args: Any, **kw: Any) -> Any:
            return await self.call(fn, *args, **kw)

        return call
