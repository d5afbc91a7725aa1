"""The KV cache's disk tier (model/kv_disk.py): round trips, restarts, isolation between
models and tenants, bad files, capacity, and the faults that must only cost a recompute."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading

import numpy as np
import pytest

from model import kv_disk
from model.kv_disk import DiskStore

SHAPE = (2, 3, 16, 2, 8)
FP = "model-a"


def page(i: int, dtype="int8") -> np.ndarray:
    return np.random.default_rng(i).integers(-100, 100, SHAPE).astype(dtype)


def meta(i: int, salt: str = "") -> tuple:
    return (None if i == 0 else i - 1, salt, tuple(range(16 * i, 16 * i + 16)))


def store(tmp_path, fp=FP, capacity=1 << 20, **kw) -> DiskStore:
    kw.setdefault("page_dtype", "int8")
    return DiskStore(tmp_path, capacity_bytes=capacity, fingerprint=fp, page_shape=SHAPE,
                     **kw)


def filled(tmp_path, n: int, **kw) -> DiskStore:
    s = store(tmp_path, **kw)
    for i in range(n):
        assert s.put(i, meta(i), page(i))
    s.flush()
    return s


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "sluice.kv_disk" and r.levelno == logging.WARNING]


def test_round_trip(tmp_path):
    s = filled(tmp_path, 3)
    assert len(s) == 3 and 1 in s and 7 not in s
    files = sorted(os.listdir(tmp_path / FP))
    assert files == [f"{i:016x}.kv" for i in range(3)]
    assert s.bytes_used == sum(os.path.getsize(tmp_path / FP / f) for f in files)
    got = s.get(1, meta(1))
    assert got.shape == SHAPE and got.dtype == np.int8
    assert got.tobytes() == page(1).tobytes()
    got[...] = 0  # a fresh, writable array
    assert s.get(1, meta(1)).tobytes() == page(1).tobytes()
    st = s.stats()
    assert st["pages"] == 3 and st["bytes"] == s.bytes_used and st["writes"] == 3
    assert st["reads"] == 2 and st["read_bytes"] == 2 * page(1).nbytes
    assert st["errors"] == {} and st["dropped"] == 0 and st["queued"] == 0 and st["enabled"]
    assert s.get(7, meta(7)) is None  # never stored: a plain miss
    assert not s.put(1, meta(1), page(1))  # stored already
    assert s.stats()["dropped"] == 1
    s.close()
    s.close()
    assert not s.put(5, meta(5), page(5))


def test_bfloat16_and_large_keys(tmp_path):
    bf16 = pytest.importorskip("ml_dtypes").bfloat16
    s = store(tmp_path, page_dtype=bf16)
    key = 2**64 - 1
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(bf16)
    assert s.put(key, (2**63, "t", (0, 2**31 - 1)), x)
    s.flush()
    got = s.get(key, (2**63, "t", (0, 2**31 - 1)))
    assert got.dtype == bf16 and got.tobytes() == x.tobytes()
    # A float16 store under the same fingerprint (a caller's bug): never mixed up.
    (tmp_path / "f16" / FP).mkdir(parents=True)
    shutil.copy(tmp_path / FP / f"{key:016x}.kv", tmp_path / "f16" / FP)
    other = DiskStore(tmp_path / "f16", capacity_bytes=1 << 20, fingerprint=FP,
                      page_shape=SHAPE, page_dtype="float16")
    assert other.get(key, (2**63, "t", (0, 2**31 - 1))) is None
    assert other.stats()["errors"] == {"layout": 1}


def test_bad_arguments(tmp_path):
    s = store(tmp_path)
    with pytest.raises(ValueError):
        s.put(0, meta(0), page(0).astype("int16"))
    with pytest.raises(ValueError):
        s.put(0, meta(0), page(0)[:1])
    with pytest.raises(ValueError):
        s.put(-1, meta(0), page(0))
    with pytest.raises(ValueError):
        s.put(2**64, meta(0), page(0))
    with pytest.raises(ValueError):
        s.put(0, (None, "", (2**40,)), page(0))
    with pytest.raises(ValueError):
        store(tmp_path, fp="../x")
    assert len(s) == 0


def test_restart_and_fingerprints(tmp_path, caplog):
    filled(tmp_path, 3).close()
    again = store(tmp_path)
    assert len(again) == 3 and again.bytes_used > 0
    assert again.get(2, meta(2)).tobytes() == page(2).tobytes()

    other = store(tmp_path, fp="model-b")  # its own subfolder: nothing of model-a's
    assert len(other) == 0 and other.get(2, meta(2)) is None
    # model-a's file copied into model-b's folder: found by name, rejected on read.
    shutil.copy(tmp_path / FP / f"{2:016x}.kv", tmp_path / "model-b")
    other = store(tmp_path, fp="model-b")
    assert 2 in other
    with caplog.at_level(logging.WARNING, "sluice.kv_disk"):
        assert other.get(2, meta(2)) is None
    assert 2 not in other and not (tmp_path / "model-b" / f"{2:016x}.kv").exists()
    assert other.stats()["errors"] == {"foreign": 1}
    [msg] = warnings_of(caplog)
    assert "another model" in msg and "recomputed" in msg
    assert len(store(tmp_path)) == 3  # model-a's own pages are untouched


def test_restart_keeps_lru_order(tmp_path):
    s = filled(tmp_path, 3)
    for i in range(3):  # oldest mtime: page 2, then 0, then 1
        t = {2: 1_000, 0: 2_000, 1: 3_000}[i]
        os.utime(tmp_path / FP / f"{i:016x}.kv", (t, t))
    s.close()
    size = s.bytes_used // 3
    s = store(tmp_path, capacity=3 * size)
    assert s.put(3, meta(3), page(3))
    s.flush()
    assert 2 not in s and {0, 1, 3} <= {k for k in range(4) if k in s}
    # A smaller capacity at start-up drops the oldest at once.
    s.close()
    s = store(tmp_path, capacity=2 * size)
    assert len(s) == 2 and 0 not in s and s.bytes_used <= 2 * size
    assert sorted(os.listdir(tmp_path / FP)) == [f"{1:016x}.kv", f"{3:016x}.kv"]


def test_isolation(tmp_path, caplog):
    s = filled(tmp_path, 3)
    parent, salt, tokens = meta(1)
    wrong = [(parent, "tenant-b", tokens), (parent, salt, tokens[:-1] + (999,)),
             (7, salt, tokens), (None, salt, tokens)]
    with caplog.at_level(logging.WARNING, "sluice.kv_disk"):
        for m in wrong:
            assert s.get(1, m) is None
            s.put(1, meta(1), page(1))  # stored again after the bad read deleted it
            s.flush()
            assert 1 in s
    assert s.stats()["errors"] == {"mismatch": 4}
    assert len(warnings_of(caplog)) == 1
    assert s.get(1, meta(1)).tobytes() == page(1).tobytes()
    # Salted pages: only the same salt reads them.
    assert s.put(10, meta(10, "tenant-a"), page(10))
    s.flush()
    assert s.get(10, meta(10, "tenant-b")) is None and s.get(10, meta(10, "")) is None


def test_bad_files(tmp_path, caplog):
    s = filled(tmp_path, 8)
    folder = tmp_path / FP

    def path(i):
        return folder / f"{i:016x}.kv"

    def flip_last_byte(i):
        data = bytearray(path(i).read_bytes())
        data[-1] ^= 0xFF
        path(i).write_bytes(bytes(data))

    def truncate(i):
        data = path(i).read_bytes()
        path(i).write_bytes(data[:len(data) - 100])

    flip_last_byte(0), flip_last_byte(1)
    truncate(2), truncate(3)
    path(4).write_bytes(b"not a page at all" * 10)
    path(5).write_bytes(b"")
    os.unlink(path(6))
    with caplog.at_level(logging.WARNING, "sluice.kv_disk"):
        for i in range(7):
            assert s.get(i, meta(i)) is None
            assert i not in s and not path(i).exists()
    assert s.stats()["errors"] == {"corrupt": 3, "truncated": 3, "missing": 1}
    msgs = warnings_of(caplog)
    assert len(msgs) == 3 and all("recomputed" in m for m in msgs)
    assert len(s) == 1 and s.bytes_used == path(7).stat().st_size
    assert s.get(7, meta(7)).tobytes() == page(7).tobytes()


def test_capacity_evicts_lru(tmp_path):
    one = filled(tmp_path / "probe", 1).bytes_used
    s = store(tmp_path, capacity=3 * one + one // 2)
    for i in range(3):
        s.put(i, meta(i), page(i))
        s.flush()
    assert len(s) == 3
    assert s.get(0, meta(0)) is not None  # 0 becomes the most recent
    s.put(3, meta(3), page(3))
    s.flush()
    assert [k for k in range(4) if k in s] == [0, 2, 3]  # 1 was the oldest
    for i in range(4, 20):
        s.put(i, meta(i), page(i))
        s.flush()
        assert s.bytes_used <= s.capacity_bytes and len(s) == 3
    assert sorted(os.listdir(tmp_path / FP)) == [f"{i:016x}.kv" for i in (17, 18, 19)]
    assert s.stats()["evictions"] == 17
    tiny = store(tmp_path, fp="tiny", capacity=100)  # a page can never fit
    assert not tiny.put(0, meta(0), page(0)) and tiny.stats()["dropped"] == 1


def test_disk_full(tmp_path, caplog, monkeypatch):
    s = filled(tmp_path, 1)
    real_replace = os.replace

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    with caplog.at_level(logging.WARNING, "sluice.kv_disk"):
        monkeypatch.setattr(kv_disk.os, "replace", full)
        for i in range(1, 5):
            assert s.put(i, meta(i), page(i))
        s.flush()
        monkeypatch.setattr(kv_disk.os, "replace", real_replace)
    assert s.stats()["errors"] == {"write": 4}
    assert len(s) == 1 and [k for k in range(5) if k in s] == [0]
    assert os.listdir(tmp_path / FP) == [f"{0:016x}.kv"]  # no temporary files left
    [msg] = warnings_of(caplog)
    assert "full/unwritable" in msg and "recomputed" in msg
    # The fault goes away: storing works again.
    assert s.put(1, meta(1), page(1))
    s.flush()
    assert s.get(1, meta(1)).tobytes() == page(1).tobytes()


def test_writer_survives_a_bug(tmp_path, monkeypatch):
    s = store(tmp_path)
    monkeypatch.setattr(s, "_header", lambda *a: 1 / 0)
    assert s.put(0, meta(0), page(0))
    s.flush()
    monkeypatch.undo()
    assert s.stats()["errors"] == {"internal": 1}
    assert s.put(1, meta(1), page(1))
    s.flush()
    assert 1 in s


def test_directory_removed(tmp_path, caplog):
    s = filled(tmp_path, 3)
    with caplog.at_level(logging.WARNING, "sluice.kv_disk"):
        shutil.rmtree(tmp_path / FP)
        assert s.get(1, meta(1)) is None
        assert len(s) == 0 and s.bytes_used == 0 and 0 not in s
        assert s.put(1, meta(1), page(1))
        s.flush()
        assert s.get(1, meta(1)).tobytes() == page(1).tobytes()
        # Removed again; this time a write notices first.
        shutil.rmtree(tmp_path / FP)
        assert s.put(2, meta(2), page(2))
        s.flush()
        assert [k for k in range(3) if k in s] == [2]
        assert s.get(2, meta(2)).tobytes() == page(2).tobytes()
        # And stats() notices a removal that nothing else has.
        shutil.rmtree(tmp_path / FP)
        assert s.stats()["pages"] == 0 and s.bytes_used == 0
    assert s.stats()["errors"] == {"directory": 3}
    [msg] = warnings_of(caplog)
    assert "removed" in msg
    assert len(store(tmp_path)) == 0


def test_queue_full_and_queued_reads(tmp_path, monkeypatch):
    s = store(tmp_path, max_queue=1)
    release, started = threading.Event(), threading.Event()
    real_write = s._write_file

    def blocked(*args):
        started.set()
        release.wait(5)
        real_write(*args)

    monkeypatch.setattr(s, "_write_file", blocked)
    assert s.put(0, meta(0), page(0))
    assert started.wait(5)
    assert not s.put(1, meta(1), page(1))  # the writer is busy with 0: queue full
    assert not s.put(0, meta(0), page(0))  # queued already
    st = s.stats()
    assert st["dropped"] == 2 and st["queued"] == 1 and st["pages"] == 0
    # Queued but not yet written: `in` says so and get serves the queued copy.
    assert 0 in s
    assert s.get(0, meta(0)).tobytes() == page(0).tobytes()
    assert s.get(0, meta(0, "other")) is None
    release.set()
    s.flush()
    assert len(s) == 1 and s.stats()["queued"] == 0
    assert s.put(1, meta(1), page(1))
    s.close()
    assert 1 in s and len(s) == 2


def test_startup_cleanup(tmp_path):
    folder = tmp_path / FP
    folder.mkdir()
    filled(tmp_path, 2).close()
    (folder / f".{5:016x}.123.tmp").write_bytes(b"half a page")
    (folder / "leftover.tmp").write_bytes(b"")
    for name in ("readme.txt", "xyz.kv", "ABCDEF0123456789.kv", "12.kv",
                 "00000000000000000001.kv"):
        (folder / name).write_bytes(b"junk")
    (folder / f"{9:016x}.kv").mkdir()  # a folder with a page's name
    s = store(tmp_path)
    assert len(s) == 2 and 9 not in s
    names = set(os.listdir(folder))
    assert not any(n.endswith(".tmp") for n in names)
    assert "readme.txt" in names and "xyz.kv" in names  # not ours: left alone


def test_disabled_when_unusable(tmp_path, caplog):
    (tmp_path / "file").write_bytes(b"")
    with caplog.at_level(logging.WARNING, "sluice.kv_disk"):
        s = store(tmp_path / "file")
    assert not s.enabled and len(s) == 0
    assert not s.put(0, meta(0), page(0))
    assert s.get(0, meta(0)) is None
    assert s.stats()["enabled"] is False and s.stats()["dropped"] == 1
    [msg] = warnings_of(caplog)
    assert "disabled" in msg
    s.close()


def test_concurrent_use(tmp_path):
    one = filled(tmp_path / "probe", 1).bytes_used
    s = store(tmp_path, capacity=20 * one, max_queue=8)
    errors = []
    pages = [page(i).tobytes() for i in range(40)]

    def reader():
        try:
            for _ in range(100):
                for i in range(40):
                    got = s.get(i, meta(i))
                    assert got is None or got.tobytes() == pages[i]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(40):
        while not s.put(i, meta(i), page(i)) and i not in s:
            s.flush(0.01)
    for t in threads:
        t.join()
    s.flush()
    assert not errors
    assert s.bytes_used <= s.capacity_bytes
    st = s.stats()
    assert st["errors"] == {} and st["pages"] == len(os.listdir(tmp_path / FP))
