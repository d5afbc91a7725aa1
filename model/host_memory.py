"""The process's host memory: read it, and keep glibc's allocator from sitting on what
compiling freed.

XLA's compiler allocates hundreds of MB while it compiles a step and frees them after;
glibc keeps freed pages in its per-thread arenas, so a server that had compiled its
shapes held ~0.6 GB it no longer used. Two standard remedies, both no-ops off glibc:
`trim()` after each compile hands free pages back, and `limit_arenas()` at start caps
the arenas that compile and worker threads spread allocations over
(docs/benchmarks.md, "Start-up and memory").
"""

from __future__ import annotations

import ctypes

_M_ARENA_MAX = -8  # glibc's mallopt parameter number
_libc: ctypes.CDLL | None | bool = None


def _glibc():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim, _libc.mallopt  # noqa: B018 - glibc has both
        except (OSError, AttributeError):
            _libc = False
    return _libc


def trim() -> None:
    """Return the heap's free pages to the OS."""
    if libc := _glibc():
        libc.malloc_trim(0)


def limit_arenas(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas; call before threads start (saved ~60 MB of a served
    model's resident memory here)."""
    if libc := _glibc():
        libc.mallopt(_M_ARENA_MAX, arenas)


def rss_bytes() -> int:
    """Resident memory now (0 where /proc is missing)."""
    return _status("VmRSS")


def peak_rss_bytes() -> int:
    """The most resident memory this process has had."""
    return _status("VmHWM")


def _status(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
