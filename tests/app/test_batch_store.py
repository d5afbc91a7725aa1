"""The batch store: all-or-nothing batches, results kept exactly once, the schema's
version, and one owner per directory."""

from __future__ import annotations

import json
import sqlite3

import pytest

from app.batches.store import MIGRATIONS, Line, Store, StoreLocked


def lines(n: int, bad: tuple[int, ...] = ()) -> list[Line]:
    return [Line(f"c{i}", "/v1/chat/completions", b'{"x": %d}' % i,
                 {"code": "invalid", "message": "bad"} if i in bad else None)
            for i in range(n)]


def test_results_are_kept_exactly_once_and_files_assembled(tmp_path):
    s = Store(tmp_path)
    b = s.add_batch("batch_1", "t", "/v1/chat/completions", None, "24h", 86400, None,
                    lines(5, bad=(3,)))
    assert (b["status"], b["total"], b["completed"], b["failed"]) == ("validating", 5, 0, 1)
    assert [r["idx"] for r in s.pending("batch_1", 10)] == [0, 1, 2, 4]
    assert s.record("batch_1", 0, True, b'{"ok": 0}', 7)
    assert not s.record("batch_1", 0, True, b'{"ok": 0}', 7)  # twice: kept once
    assert s.record("batch_1", 2, False, b'{"err": 2}', 0)
    assert [r["idx"] for r in s.pending("batch_1", 10)] == [1, 4]
    b = s.finalize("batch_1", "expired", "file-out", "file-err")
    assert (b["status"], b["completed"], b["failed"], b["tokens"]) == ("expired", 1, 2, 7)
    assert s.file_content(b["output_file_id"]) == b'{"ok": 0}\n'
    err = s.file_content(b["error_file_id"]).splitlines()
    assert err[0] == b'{"err": 2}'
    assert len(err) == 2 and json.loads(err[1])["custom_id"] == "c3"
    s.close()


def test_a_batch_is_stored_whole_or_not_at_all(tmp_path):
    s = Store(tmp_path)
    s.add_batch("b", "t", "/v1/completions", None, "1h", 3600, None, lines(2))
    with pytest.raises(sqlite3.IntegrityError):
        # the third line cannot be stored (no body): neither the batch nor its lines are
        s.add_batch("b2", "t", "/v1/completions", None, "1h", 3600, None,
                    lines(2) + [Line("x", "u", None)])  # type: ignore[arg-type]
    assert s.batch("b2") is None and s.pending("b2", 10) == []
    s.close()


def test_schema_version_and_reopen(tmp_path):
    s = Store(tmp_path)
    assert s.version == len(MIGRATIONS)
    s.add_file("file-1", "t", "batch", "in.jsonl", b"abc")
    s.close()
    s = Store(tmp_path)  # reopened: nothing migrates twice, the data is there
    assert s.version == len(MIGRATIONS) and s.file_content("file-1") == b"abc"
    s.close()


def test_one_server_per_store(tmp_path):
    s = Store(tmp_path)
    with pytest.raises(StoreLocked, match="in use by another sluice server"):
        Store(tmp_path)
    s.close()
    Store(tmp_path).close()  # the lock went with the owner


def test_stored_responses_are_kept_for_their_retention(tmp_path, monkeypatch):
    """A response is kept `keep_s`; one older than that goes when the next is stored."""
    import app.batches.store as store_module

    store = Store(tmp_path)
    now = [1_000_000]
    monkeypatch.setattr(store_module.time, "time", lambda: now[0])
    store.add_response("resp_old", "a", b"[]", b"{}", keep_s=100)
    assert store.response("resp_old")["tenant"] == "a"
    now[0] += 101
    store.add_response("resp_new", "a", b"[]", b"{}", keep_s=100)
    assert store.response("resp_old") is None and store.response("resp_new") is not None
    store.delete_response("resp_new")
    assert store.response("resp_new") is None
    store.close()
