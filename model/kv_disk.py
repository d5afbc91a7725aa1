"""The disk tier of the KV cache: evicted prefix pages kept as files, read back later.

A page holds the attention keys and values of 16 prompt tokens. When memory evicts one,
`DiskStore.put` queues a copy for a writer thread; a later request with the same prompt
prefix, in this process or after a restart, asks `get` for it and gets the array back
instead of recomputing those tokens. Everything here is an optimisation: any problem
(disk full, a file corrupt or truncated, the folder removed while serving, another
model's file) costs a recompute, never a failed request, and is logged once per kind of
problem per store (logger "sluice.kv_disk"); `stats()["errors"]` keeps counting.

Layout: `directory/<fingerprint>/<key as 16 hex digits>.kv`, one file per page. The
fingerprint names the model and the page layout, so two models never read each other's
pages. Start-up lists the folder (names, sizes, mtimes; no file is opened) and takes the
oldest mtime as least recently used; a read moves its page to the most recent end and
touches the file's mtime so that the order survives a restart. The writer evicts least
recently used files until a new page fits `capacity_bytes`.

A page is written to a temporary file in the same folder (`.<key>.<pid>.tmp`) and
renamed over its name, so a crash never leaves a half-written file under a valid name;
start-up deletes leftover `*.tmp` files. No fsync: a page cut short by a power loss fails
its checks and is recomputed.

File format, version 1, little-endian:

    prefix   4s magic b"SLKV", u16 version, u16 flags (bit 0: has a parent page),
             u32 header length (prefix included)
    fixed    u64 key, u64 parent key (0 without a parent), u64 payload length,
             u32 crc32 of the payload, u32 token count, u8 ndim
    strings  u16 length + utf-8 each: fingerprint, salt, dtype tag (`dtype.str:name`,
             e.g. "<f4:float32", "<V2:bfloat16")
    shape    ndim x u64
    tokens   token count x int32
    payload  the page's bytes, C order

A read checks all of it against what the caller asked for (`meta` = parent key, cache
salt, token ids): a hash collision or another tenant's page (a different salt) is never
returned; the file is deleted instead.

(About 560 lines: the file format, the index, the writer thread and every fault it
survives share the one lock and the one set of books, and are read together.)
"""

from __future__ import annotations

import collections
import logging
import os
import struct
import threading
import zlib
from pathlib import Path

import numpy as np

log = logging.getLogger("sluice.kv_disk")

MAGIC = b"SLKV"
VERSION = 1
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
_PREFIX = struct.Struct("<4sHHI")  # magic, version, flags, header length
_FIXED = struct.Struct("<QQQIIB")  # key, parent, payload length, crc32, tokens, ndim
_HAS_PARENT = 1
_MAX_HEADER = 1 << 20  # a page's header is ~100 bytes; more means the file is garbage
_KEY_LIMIT = 1 << 64

Meta = tuple[int | None, str, tuple[int, ...]]  # parent key, cache salt, token ids

# What each kind of problem costs, for its one warning.
_PROBLEMS = {
    "missing": "its file had vanished",
    "truncated": "its file was truncated",
    "corrupt": "its file was corrupt (bad header or checksum)",
    "version": "its file has an unknown format version",
    "foreign": "its file belongs to another model (different fingerprint)",
    "mismatch": "its file holds different tokens, parent or cache salt (hash collision "
                "or another tenant)",
    "layout": "its file has a different page shape or dtype",
    "read": "its file could not be read",
}


def _private(path: str, flags: int) -> int:
    """Open for writing as the owner's alone (0600): a page holds what a prompt computed."""
    return os.open(path, flags, 0o600)


def _dtype_tag(dtype: np.dtype) -> str:
    # `str` alone names every bfloat16/float8 "<V2"/"<V1"; `name` alone drops byte order.
    return f"{dtype.str}:{dtype.name}"


def _check_key(key: int, what: str = "key") -> int:
    if not isinstance(key, (int, np.integer)) or not 0 <= int(key) < _KEY_LIMIT:
        raise ValueError(f"{what} must be an int in [0, 2**64), got {key!r}")
    return int(key)


def _pack_str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<H", len(b)) + b


def _tokens_bytes(tokens) -> bytes | None:
    """The token ids as the file stores them; None if they don't fit int32."""
    try:
        return _to_i4(tokens)
    except (OverflowError, ValueError, TypeError):
        return None


def _to_i4(tokens) -> bytes:
    arr = np.asarray(tuple(tokens), dtype=np.int64)
    if arr.ndim != 1 or (arr.size and (arr.min() < -(1 << 31) or arr.max() >= 1 << 31)):
        raise ValueError("token ids must be a sequence of int32")
    return arr.astype("<i4").tobytes()


class _Problem(Exception):
    """A page that can't be used; `kind` is a key of `_PROBLEMS`."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(detail)
        self.kind = kind


class DiskStore:
    """One model's KV pages on disk: an LRU index in memory, a writer thread, checked
    reads. `put`, `get`, `in`, `len` and `stats` may be called from any thread."""

    def __init__(self, directory: str | os.PathLike, *, capacity_bytes: int,
                 fingerprint: str, page_shape: tuple[int, ...],
                 page_dtype: np.dtype | str, max_queue: int = 256) -> None:
        if not fingerprint or fingerprint in (".", "..") or "/" in fingerprint \
                or os.sep in fingerprint or "\0" in fingerprint:
            raise ValueError(f"fingerprint must be a folder name, got {fingerprint!r}")
        self.fingerprint = fingerprint
        self.page_shape = tuple(int(d) for d in page_shape)
        self.page_dtype = np.dtype(page_dtype)
        self.page_nbytes = (int(np.prod(self.page_shape, dtype=np.int64))
                            * self.page_dtype.itemsize)
        self.capacity_bytes = int(capacity_bytes)
        self.max_queue = max(1, int(max_queue))
        self._dir = Path(directory) / fingerprint
        self._tag = _dtype_tag(self.page_dtype)

        self._lock = threading.Condition()  # guards everything below; no I/O under it
        # key -> file size, least recently used first
        self._index: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._bytes = 0
        self._pending: dict[int, tuple[Meta, bytes]] = {}  # queued or being written
        self._queue: collections.deque[int] = collections.deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._warned: set[str] = set()
        self._errors: collections.Counter[str] = collections.Counter()
        self._counts = collections.Counter()  # writes, write_bytes, reads, read_bytes, ...

        try:
            self._dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # prompts' KV: private
            probe = self._dir / f".probe.{os.getpid()}{TMP_SUFFIX}"
            probe.write_bytes(b"")
            probe.unlink()
            self._scan()
            self._enabled = True
        except OSError as e:
            self._enabled = False
            self._index.clear()
            self._bytes = 0
            log.warning("KV disk tier disabled: cannot use %s (%s); evicted pages are "
                        "recomputed instead", self._dir, e)

    # ---- the index ----------------------------------------------------------------------

    def _path(self, key: int) -> Path:
        return self._dir / f"{key:016x}{SUFFIX}"

    def _scan(self) -> None:
        """Index the folder's pages by name, size and mtime; delete leftover temp files."""
        found = []
        with os.scandir(self._dir) as it:
            for entry in it:
                name = entry.name
                try:
                    if name.endswith(TMP_SUFFIX):
                        os.unlink(entry.path)  # a write a crash (or a kill) cut short
                        continue
                    stem = name[:-len(SUFFIX)]
                    if not name.endswith(SUFFIX) or len(stem) != 16 \
                            or stem != stem.lower():
                        continue
                    key = int(stem, 16)
                    st = entry.stat(follow_symlinks=False)
                except (ValueError, OSError):
                    continue  # not ours, or gone since listing
                if entry.is_file(follow_symlinks=False):
                    found.append((st.st_mtime_ns, name, key, st.st_size))
        found.sort()
        for _, _, key, size in found:
            self._index[key] = size
            self._bytes += size
        # A smaller capacity than last time: the oldest pages go now.
        victims = self._evict_locked(0)
        for key in victims:
            self._unlink(key)

    def _evict_locked(self, incoming: int) -> list[int]:
        """Drop least recently used pages from the index until `incoming` more bytes fit;
        the caller deletes their files (after releasing the lock)."""
        victims = []
        while self._index and self._bytes + incoming > self.capacity_bytes:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            victims.append(key)
        self._counts["evictions"] += len(victims)
        return victims

    def _unlink(self, key: int) -> None:
        try:
            os.unlink(self._path(key))
        except OSError:
            pass  # already gone, or the folder is: either way not on disk any more

    def _forget(self, key: int) -> None:
        """Delete a bad page: file first, so that while its key is still indexed no `put`
        can queue a new copy that this deletion would then remove."""
        self._unlink(key)
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size

    def _lost_directory(self) -> None:
        """The folder was removed under us: its pages are gone; make it again."""
        with self._lock:
            self._index.clear()
            self._bytes = 0
        self._problem("directory", f"the KV disk tier folder {self._dir} was removed while "
                      "serving; its pages are dropped and recomputed, new pages are "
                      "stored in a fresh folder")
        try:
            os.makedirs(self._dir, mode=0o700, exist_ok=True)
        except OSError:
            pass  # the next write fails and counts as "write"

    def _problem(self, kind: str, message: str) -> None:
        with self._lock:
            self._errors[kind] += 1
            first = kind not in self._warned
            self._warned.add(kind)
        if first:
            log.warning("%s (further problems of this kind are not logged)", message)

    # ---- the public interface ---------------------------------------------------------

    @property
    def directory(self) -> Path:
        return self._dir

    @property
    def enabled(self) -> bool:
        return self._enabled

    def __contains__(self, key: int) -> bool:
        """On disk, or queued for it (then `get` answers from the queued copy)."""
        with self._lock:
            return key in self._index or key in self._pending

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    def put(self, key: int, meta: Meta, payload: np.ndarray) -> bool:
        """Queue a copy of a page for writing; False (counted as dropped) if the store is
        disabled or closed, the key is stored or queued already, the queue is full or the
        page can't fit the capacity. Never blocks on I/O."""
        key = _check_key(key)
        parent, salt, tokens = meta
        if parent is not None:
            _check_key(parent, "parent key")
        if _tokens_bytes(tokens) is None:
            raise ValueError("token ids must be a sequence of int32")
        if payload.shape != self.page_shape or payload.dtype != self.page_dtype:
            raise ValueError(f"page is {payload.shape} {payload.dtype}, this store holds "
                             f"{self.page_shape} {self.page_dtype}")
        meta = (None if parent is None else int(parent), salt or "",
                tuple(int(t) for t in tokens))
        with self._lock:
            if (not self._enabled or self._closed or key in self._index
                    or key in self._pending or len(self._pending) >= self.max_queue
                    or self.page_nbytes > self.capacity_bytes):
                self._counts["dropped"] += 1
                return False
            self._pending[key] = (meta, payload.tobytes())
            self._queue.append(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._writer, name="sluice-kv-disk",
                                                daemon=True)
                self._thread.start()
            self._lock.notify_all()
        return True

    def get(self, key: int, meta: Meta) -> np.ndarray | None:
        """The page stored under `key` if it holds `meta`'s tokens (a fresh array), else
        None. A bad file is deleted and logged once per kind. Never raises for I/O."""
        key = _check_key(key)
        parent, salt, tokens = meta
        want_tokens = _tokens_bytes(tokens)
        salt = salt or ""
        with self._lock:
            queued = self._pending.get(key)
            indexed = key in self._index
        if queued is not None:  # evicted moments ago, not written yet: serve the copy
            (q_parent, q_salt, q_tokens), data = queued
            if q_parent != parent or q_salt != salt or tuple(q_tokens) != tuple(tokens):
                self._count("misses")
                return None
            self._count("queued_hits")
            return np.frombuffer(data, self.page_dtype).reshape(self.page_shape).copy()
        if not indexed:
            self._count("misses")
            return None
        path = self._path(key)
        try:
            page = self._read(path, key, parent, salt, want_tokens)
        except _Problem as p:
            self._skip(key, p.kind, str(p))
            return None
        except FileNotFoundError:
            if not self._dir.is_dir():
                self._lost_directory()
                return None
            with self._lock:
                evicted = key not in self._index
            if evicted:  # the writer made room between our look-up and the open
                self._count("misses")
                return None
            self._skip(key, "missing")
            return None
        except OSError as e:
            self._skip(key, "read", str(e))
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            self._counts["reads"] += 1
            self._counts["read_bytes"] += self.page_nbytes
        try:
            os.utime(path)  # so that a restart sees the same LRU order
        except OSError:
            pass
        return page

    def flush(self, timeout: float = 10.0) -> None:
        """Wait (`timeout` seconds at most) until every queued page is written or
        dropped."""
        with self._lock:
            self._lock.wait_for(lambda: not self._pending, timeout)

    def close(self) -> None:
        """Write what is queued (waiting a few seconds at most), then stop the writer;
        later `put`s are dropped. Idempotent."""
        with self._lock:
            if self._closed:
                return
            thread = self._thread
        if thread is not None:
            self.flush(timeout=5.0)
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if thread is not None:
            thread.join(timeout=5.0)

    def stats(self) -> dict:
        """Counts for metrics; checks that the folder still exists (one stat call)."""
        if self._enabled and not self._closed and not self._dir.is_dir():
            self._lost_directory()
        with self._lock:
            c = self._counts
            return {
                "pages": len(self._index), "bytes": self._bytes,
                "capacity_bytes": self.capacity_bytes,
                "writes": c["writes"], "write_bytes": c["write_bytes"],
                "reads": c["reads"], "read_bytes": c["read_bytes"],
                "queued_hits": c["queued_hits"], "misses": c["misses"],
                "evictions": c["evictions"], "errors": dict(self._errors),
                "dropped": c["dropped"], "queued": len(self._pending),
                "enabled": self._enabled,
            }

    def _skip(self, key: int, kind: str, detail: str = "") -> None:
        """A page that failed its read: delete it, log the first of its kind."""
        self._forget(key)
        detail = f": {detail}" if detail else ""
        self._problem(kind, f"KV disk tier: skipped page {key:016x} ({key:016x}{SUFFIX}): "
                      f"{_PROBLEMS[kind]}{detail}; deleted it, its tokens are recomputed")

    def _count(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1

    # ---- reading ----------------------------------------------------------------------

    def _read(self, path: Path, key: int, parent: int | None, salt: str,
              want_tokens: bytes | None) -> np.ndarray:
        """Read and check one page file; raises `_Problem` (or OSError) if unusable."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(_PREFIX.size)
            if len(prefix) < _PREFIX.size:
                raise _Problem("truncated" if prefix == MAGIC[:len(prefix)] else "corrupt")
            magic, version, flags, header_len = _PREFIX.unpack(prefix)
            if magic != MAGIC:
                raise _Problem("corrupt", "not a KV page file")
            if version != VERSION:
                raise _Problem("version", f"version {version}, this server reads {VERSION}")
            if not _PREFIX.size + _FIXED.size <= header_len <= _MAX_HEADER:
                raise _Problem("corrupt", f"header length {header_len}")
            header = f.read(header_len - _PREFIX.size)
            if len(header) < header_len - _PREFIX.size:
                raise _Problem("truncated")
            try:
                fields = _parse_header(header, flags)
            except (struct.error, UnicodeDecodeError, ValueError) as e:
                raise _Problem("corrupt", f"bad header ({e})") from None
            f_key, f_parent, payload_len, crc, fp, f_salt, tag, shape, f_tokens = fields
            if fp != self.fingerprint:
                raise _Problem("foreign", f"fingerprint {fp!r}")
            if f_key != key:
                raise _Problem("corrupt", f"it holds key {f_key:016x}")
            if f_parent != parent or f_salt != salt or f_tokens != want_tokens:
                raise _Problem("mismatch")
            if tag != self._tag or shape != self.page_shape \
                    or payload_len != self.page_nbytes:
                raise _Problem("layout", f"{shape} {tag}, this store holds "
                               f"{self.page_shape} {self._tag}")
            if size < header_len + payload_len:
                raise _Problem("truncated")
            if size > header_len + payload_len:
                raise _Problem("corrupt", "trailing bytes")
            page = np.empty(self.page_shape, self.page_dtype)
            buf = page.reshape(-1).view(np.uint8)
            if f.readinto(buf) != payload_len:
                raise _Problem("truncated")
        if zlib.crc32(buf) != crc:
            raise _Problem("corrupt", "payload checksum mismatch")
        return page

    # ---- writing ----------------------------------------------------------------------

    def _writer(self) -> None:
        """The writer thread: one queued page at a time, until `close`."""
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    # close() waited for the queue already; what is left is dropped.
                    self._counts["dropped"] += len(self._queue)
                    for key in self._queue:
                        self._pending.pop(key, None)
                    self._queue.clear()
                    self._lock.notify_all()
                    return
                key = self._queue.popleft()
                meta, data = self._pending[key]
            try:
                self._store(key, meta, data)
            except Exception:  # noqa: BLE001 - a bug here must not stop the server
                self._problem("internal", "KV disk tier: writing a page failed "
                              "unexpectedly; it is recomputed instead")
                log.debug("KV disk tier write failed", exc_info=True)
            finally:
                with self._lock:
                    self._pending.pop(key, None)
                    self._lock.notify_all()

    def _store(self, key: int, meta: Meta, data: bytes) -> None:
        header = self._header(key, meta, data)
        size = len(header) + len(data)
        with self._lock:
            if size > self.capacity_bytes:
                self._counts["dropped"] += 1
                return
            victims = self._evict_locked(size)
        for victim in victims:
            self._unlink(victim)
        for attempt in range(2):
            try:
                self._write_file(key, header, data)
                break
            except FileNotFoundError:
                if attempt == 0 and not self._dir.is_dir():
                    self._lost_directory()
                    continue  # once more, into the new folder
                self._write_failed(FileNotFoundError("folder missing"))
                return
            except OSError as e:
                self._write_failed(e)
                return
        with self._lock:
            self._index[key] = size
            self._bytes += size
            self._counts["writes"] += 1
            self._counts["write_bytes"] += size
            # A read may have run while this page was written: keep within capacity.
            victims = self._evict_locked(0)
        for victim in victims:
            self._unlink(victim)

    def _write_failed(self, e: OSError) -> None:
        self._problem("write", f"KV disk tier full/unwritable at {self._dir} ({e}); pages "
                      "are recomputed instead of read back")

    def _header(self, key: int, meta: Meta, data: bytes) -> bytes:
        parent, salt, tokens = meta
        tokens_b = _to_i4(tokens)
        shape = self.page_shape
        body = (_FIXED.pack(key, parent or 0, len(data), zlib.crc32(data),
                            len(tokens_b) // 4, len(shape))
                + _pack_str(self.fingerprint) + _pack_str(salt) + _pack_str(self._tag)
                + struct.pack(f"<{len(shape)}Q", *shape) + tokens_b)
        flags = 0 if parent is None else _HAS_PARENT
        return _PREFIX.pack(MAGIC, VERSION, flags, _PREFIX.size + len(body)) + body

    def _write_file(self, key: int, header: bytes, data: bytes) -> None:
        """Write a page under a temporary name, then rename it over its own; on failure
        the temporary file is removed and the OSError raised."""
        final = self._path(key)
        tmp = self._dir / f".{key:016x}.{os.getpid()}{TMP_SUFFIX}"
        try:
            with open(tmp, "wb", opener=_private) as f:
                f.write(header)
                f.write(data)
            os.replace(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise


def _parse_header(header: bytes, flags: int) -> tuple:
    """A header's fields after the prefix: key, parent, payload length, crc32,
    fingerprint, salt, dtype tag, shape, token bytes."""
    key, parent, payload_len, crc, n_tokens, ndim = _FIXED.unpack_from(header, 0)
    pos = _FIXED.size
    strings = []
    for _ in range(3):
        (n,) = struct.unpack_from("<H", header, pos)
        pos += 2
        if pos + n > len(header):
            raise ValueError("string runs past the header")
        strings.append(header[pos:pos + n].decode())
        pos += n
    shape = struct.unpack_from(f"<{ndim}Q", header, pos)
    pos += 8 * ndim
    tokens = header[pos:pos + 4 * n_tokens]
    pos += 4 * n_tokens
    if pos != len(header):
        raise ValueError("header length disagrees with its fields")
    fp, salt, tag = strings
    return (key, parent if flags & _HAS_PARENT else None, payload_len, crc, fp, salt,
            tag, tuple(shape), tokens)
