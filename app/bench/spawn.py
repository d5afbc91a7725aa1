"""Start a `sluice serve` for a sweep target, wait until it is healthy, stop it after.

Servers are started one at a time and stopped before the next: on a small machine two
servers would share the cores and each would measure the other. Ready means ``GET
/health`` answers 200, which Sluice does only after loading and warming up (compiling
every bucket: minutes on a CPU). Stopping sends SIGINT (Sluice drains, then exits) and
kills after a grace period. The server's output goes to a log file, never to a pipe that
nobody reads (a full pipe would stall the server mid-benchmark).
"""

from __future__ import annotations

import shlex
import signal
import socket
import subprocess
import sys
import tempfile
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Sequence

import httpx
import trio


class SpawnError(Exception):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks; a race is possible but unlikely)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def sluice_command(text: str | None) -> list[str]:
    """``--sluice`` split like a shell would, or the `sluice` script beside this Python."""
    if text:
        return shlex.split(text)
    script = Path(sys.executable).parent / "sluice"
    return [str(script)] if script.exists() else [sys.executable, "-m", "app.cli"]


async def wait_healthy(url: str, proc: trio.Process, timeout_s: float, log: Path, *,
                       warm: bool = False) -> None:
    """Until /health is 200; `warm`: and no step shape is still compiling in the
    background. A server spawned for a benchmark is measured warm (its first minutes are
    what `sluice bench-engine` and benchmarks/serve_start.sh measure), so a compile
    competing for the cores cannot slow the first requests' steps and teach the
    step-cost model a wrong start."""
    async with httpx.AsyncClient(base_url=url, timeout=5.0, trust_env=False) as http:
        with trio.move_on_after(timeout_s):
            while True:
                if proc.poll() is not None:
                    raise SpawnError(f"the server exited with {proc.returncode} before it was "
                                     f"ready; its log ({log}) ends:\n{_tail(log)}")
                try:
                    r = await http.get("/health")
                    if r.status_code == 200 and not (
                            warm and r.json().get("warmup_remaining_shapes")):
                        return
                except (httpx.HTTPError, ValueError):
                    pass  # not listening yet
                await trio.sleep(1.0)
        raise SpawnError(f"{url}/health was not 200{' with every shape compiled' * warm} "
                         f"within {timeout_s} s; log: {log}")


def _tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@asynccontextmanager
async def spawned(label: str, args: str, *, command: Sequence[str], log_dir: Path | None,
                  ready_timeout_s: float = 900.0, grace_s: float = 30.0
                  ) -> AsyncIterator[str]:
    """A healthy server for ``label``; yields its URL and stops it however the block ends."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [*command, "serve", "--host", "127.0.0.1", "--port", str(port), *shlex.split(args)]
    folder = log_dir or Path(tempfile.mkdtemp(prefix="sluice-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / f"server-{label}.log"
    with open(log, "wb") as out:
        out.write(f"$ {shlex.join(cmd)}\n".encode())
        out.flush()
        proc = await trio.lowlevel.open_process(cmd, stdout=out, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL)
        try:
            await wait_healthy(url, proc, ready_timeout_s, log, warm=True)
            yield url
        finally:
            with trio.CancelScope(shield=True):
                await stop(proc, grace_s)


async def stop(proc: trio.Process, grace_s: float) -> int | None:
    """SIGINT, up to ``grace_s`` to exit, then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        with trio.move_on_after(grace_s):
            await proc.wait()
    if proc.poll() is None:
        proc.kill()
        await proc.wait()
    return proc.returncode
