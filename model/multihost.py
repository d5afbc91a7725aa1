"""One replica over several processes: multi-controller JAX (`jax.distributed`).

Every process of the replica holds its own devices' shards of the weights and the KV pool
and must launch the same device programs in the same order, or their collectives never
meet. Process 0 (the leader) runs the HTTP server, the scheduler and the runner; the
others (followers) run only the runner's device calls, replayed:

- each runner method that launches a device program is `@mirrored`: on the leader it first
  sends its name and host arguments (the packed step arrays, a few KB) to every follower,
  in the order the leader runs them (the runner's lock orders them), and the follower
  calls the same method on its own runner. The plan itself never travels: what a step
  computes is fixed by the arrays the leader packed, so followers need no scheduler, no
  tokenizer and no random state of their own;
- followers send a heartbeat every `HEARTBEAT_S`. A follower that exits closes its socket
  and the leader sees it at once; one that hangs is declared lost after `timeout_s`
  without a heartbeat. Either way `Leader.lost` says why, and every step from then on
  raises `scheduler.protocol.RunnerLost` (the engine dies cleanly: in-flight requests get
  an error event, /health turns 503). A step already stuck in a collective is abandoned,
  not waited for: `Leader.watch` runs it in a thread of its own;
- a follower whose leader is gone exits (status 1); `Leader.close` stops them (status 0).

The channel: the leader binds a port on the coordinator's host and publishes its address
and a random token in the coordinator's key-value store; followers read it there, connect
and present the token. The processes of a replica trust each other as `jax.distributed`
and gloo already do (run them on a private network), and the follower unpickles only the
classes a step's arguments are made of (`_Unpickler`).

The coordination service is started "recoverable" (`jax_enable_recoverability`): by
default JAX terminates every process when one stops sending heartbeats, which would take
the HTTP server down with it instead of letting /health say 503.

(About 370 lines: the rendezvous, the framing, the restricted unpickler and both ends of
the channel belong together; the runner only calls `mirrored`, `send` and `watch`.)
"""

from __future__ import annotations

import concurrent.futures
import functools
import hmac
import io
import logging
import pickle
import secrets
import select
import socket
import struct
import threading
import time
from typing import Any, Callable

log = logging.getLogger("sluice.multihost")

HEARTBEAT_S = 0.5  # a follower's heartbeat period
_HELLO = b"SLUICE-REPLICA-1"
_KEY = "sluice/replica/channel"
_STOP = "__stop__"
MIRRORED: set[str] = set()  # the runner methods a follower may be told to call


class _State:
    process_id = 0
    num_processes = 1
    coordinator = ""


_state = _State()


def initialize(coordinator: str, num_processes: int, process_id: int, *,
               heartbeat_timeout_s: int = 10, init_timeout_s: int = 300) -> None:
    """Join the replica's processes (before anything touches a device). On the CPU the
    collectives go through gloo."""
    import jax

    if not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id {process_id} is not in 0..{num_processes - 1}")
    # The CPU client's collectives (a GPU's use NCCL whatever this says).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(coordinator, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=init_timeout_s,
                               heartbeat_timeout_seconds=heartbeat_timeout_s,
                               shutdown_timeout_seconds=5)
    _state.process_id, _state.num_processes, _state.coordinator = (
        process_id, num_processes, coordinator)


def active() -> bool:
    """True in a process of a multi-process replica."""
    return _state.num_processes > 1


def num_processes() -> int:
    return _state.num_processes


def _kv_client():
    # The coordinator's key-value store (what jax.experimental.multihost_utils uses).
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


def mirrored(method: Callable) -> Callable:
    """A runner method that launches device programs: on a leader, its name and host
    arguments go to the followers first (`self.mirror`), then it runs here."""
    MIRRORED.add(method.__name__)

    @functools.wraps(method)
    def call(self, *args):
        if self.mirror is not None:
            self.mirror.send(method.__name__, args)
        return method(self, *args)

    return call


# -------------------------------------------------------------------------- framing
def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack("!Q", len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("channel closed")
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> bytes:
    (n,) = struct.unpack("!Q", _recv_exact(sock, 8))
    return _recv_exact(sock, n)


class _Unpickler(pickle.Unpickler):
    """Only numpy arrays, builtin containers and the plain data classes of this package
    (a step's arguments: `StepBatch`, `Bucket`, `SamplingBatch`, the backends' metadata)."""

    _NUMPY = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
              ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
              ("numpy._core.multiarray", "scalar"), ("numpy.core.numeric", "_frombuffer"),
              ("numpy._core.numeric", "_frombuffer")}

    def find_class(self, module: str, name: str):
        if (module, name) in self._NUMPY:
            return super().find_class(module, name)
        if module.split(".")[0] in ("model", "pallas_kernels"):
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        raise pickle.UnpicklingError(f"a replica's step may not carry {module}.{name}")


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=5)


def loads(data: bytes) -> Any:
    return _Unpickler(io.BytesIO(data)).load()


# --------------------------------------------------------------------------- leader
class Leader:
    """Process 0's end of the channel: mirrors device calls, watches the followers."""

    def __init__(self, host: str | None = None, followers: int | None = None, *,
                 timeout_s: float = 10.0, connect_timeout_s: float = 600.0,
                 publish: Callable[[str], None] | None = None) -> None:
        host = host or _state.coordinator.rsplit(":", 1)[0]
        self.followers = _state.num_processes - 1 if followers is None else followers
        self.timeout_s = timeout_s
        self.lost: str | None = None
        self._lost = threading.Event()
        self._send_lock = threading.Lock()
        server = socket.create_server((host, 0))
        token = secrets.token_hex(16)
        port = server.getsockname()[1]
        (publish or (lambda v: _kv_client().key_value_set(_KEY, v)))(f"{host}:{port}:{token}")
        self._socks: dict[int, socket.socket] = {}
        server.settimeout(connect_timeout_s)
        try:
            while len(self._socks) < self.followers:
                conn, _ = server.accept()
                conn.settimeout(timeout_s)
                try:
                    hello = _recv_exact(conn, len(_HELLO) + 4 + 32)
                except (OSError, ConnectionError):
                    conn.close()
                    continue
                pid = struct.unpack("!I", hello[len(_HELLO):len(_HELLO) + 4])[0]
                if not (hello.startswith(_HELLO) and hmac.compare_digest(
                        hello[-32:], token.encode()) and 0 < pid <= self.followers
                        and pid not in self._socks):
                    conn.close()  # not one of ours
                    continue
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._socks[pid] = conn
        except socket.timeout:
            raise TimeoutError(f"only {len(self._socks)} of {self.followers} follower "
                               f"processes connected within {connect_timeout_s:.0f} s") from None
        finally:
            server.close()
        self._seen = {pid: time.monotonic() for pid in self._socks}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "sluice-replica-step")
        self._closed = False
        threading.Thread(target=self._monitor, name="sluice-replica-watch", daemon=True).start()
        log.info("replica of %d processes connected", self.followers + 1)

    def _lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
            log.error("multi-host replica lost: %s", why)
        self._lost.set()

    def _monitor(self) -> None:
        socks = dict(self._socks)
        while socks and not self._closed:
            ready, _, _ = select.select(list(socks.values()), [], [], HEARTBEAT_S)
            now = time.monotonic()
            for pid, s in list(socks.items()):
                if s in ready:
                    try:
                        data = s.recv(4096)
                    except OSError as e:
                        data, err = b"", e
                    else:
                        err = None
                    if not data:
                        if not self._closed:
                            self._lose(f"process {pid} of the replica is gone (its channel "
                                       f"closed{': ' + str(err) if err else ''})")
                        socks.pop(pid)
                        continue
                    if b"E" in data:  # the follower failed and says why before exiting
                        msg = data[data.index(b"E") + 1:].decode(errors="replace")
                        self._lose(f"process {pid} of the replica failed: {msg}")
                    self._seen[pid] = now
                elif now - self._seen[pid] > self.timeout_s:
                    self._lose(f"process {pid} of the replica sent no heartbeat for "
                               f"{now - self._seen[pid]:.1f} s")

    def send(self, name: str, args: tuple) -> None:
        from scheduler.protocol import RunnerLost

        if self.lost is not None:
            raise RunnerLost(self.lost)
        frame = dumps((name, args))
        with self._send_lock:
            for pid, s in self._socks.items():
                try:
                    _send_frame(s, frame)
                except OSError as e:
                    self._lose(f"process {pid} of the replica is unreachable: {e}")
                    raise RunnerLost(self.lost) from e

    def watch(self, fn: Callable, *args, **kwargs):
        """`fn(*args)` in the replica's step thread, given up on (RunnerLost) as soon as
        a follower is lost: a collective whose peer is gone may never return."""
        from scheduler.protocol import RunnerLost

        if self.lost is not None:
            raise RunnerLost(self.lost)
        future = self._pool.submit(fn, *args, **kwargs)
        while True:
            try:
                return future.result(timeout=0.1)
            except concurrent.futures.TimeoutError:
                if self.lost is not None:
                    raise RunnerLost(self.lost) from None
            except RunnerLost:
                raise
            except Exception as exc:
                # A collective whose peer died fails: say it was the peer, once the
                # monitor has seen it go.
                if self._lost.wait(1.0):
                    raise RunnerLost(self.lost) from exc
                raise

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the followers (they exit with status 0), waiting up to `timeout_s` for
        them to leave the coordination service this process hosts."""
        if self._closed:
            return
        stopping = self.lost is None
        # Closed before the stop goes out: a follower that stops at once closes its end,
        # and the monitor must not take that for a lost process.
        self._closed = True
        if stopping:
            try:
                self.send(_STOP, ())
            except Exception:  # noqa: BLE001 - closing anyway
                stopping = False
        deadline = time.monotonic() + timeout_s
        for s in self._socks.values():
            try:  # heartbeats until the follower closes its end
                while stopping and (left := deadline - time.monotonic()) > 0:
                    s.settimeout(left)
                    if not s.recv(4096):
                        break
            except OSError:
                pass
            s.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


# ------------------------------------------------------------------------- follower
class Follower:
    """A follower process's end: connects to the leader, then replays its device calls."""

    def __init__(self, *, timeout_s: float = 600.0, lookup: Callable[[], str] | None = None,
                 pid: int | None = None) -> None:
        value = (lookup or (lambda: _kv_client().blocking_key_value_get(
            _KEY, int(timeout_s * 1000))))()
        host, port, token = value.rsplit(":", 2)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pid = _state.process_id if pid is None else pid
        self._send_lock = threading.Lock()
        self.sock.sendall(_HELLO + struct.pack("!I", pid) + token.encode())
        self._done = threading.Event()
        threading.Thread(target=self._beat, name="sluice-replica-heartbeat",
                         daemon=True).start()

    def _beat(self) -> None:
        while not self._done.wait(HEARTBEAT_S):
            try:
                with self._send_lock:
                    self.sock.sendall(b"H")
            except OSError:
                return

    def serve(self, runner: Any) -> int:
        """Replay the leader's device calls on `runner` until it says stop (0) or is gone
        (1). A call that fails is reported to the leader, then the process gives up (2):
        its devices would no longer match the leader's."""
        calls = 0
        try:
            while True:
                try:
                    name, args = loads(_recv_frame(self.sock))
                except (ConnectionError, OSError) as e:
                    log.error("the replica's leader is gone (%s) after %d calls", e, calls)
                    return 1
                if name == _STOP:
                    # Leave the coordination service while its host (the leader, who
                    # waits for this channel to close) is still up.
                    if active():
                        import jax

                        jax.distributed.shutdown()
                    return 0
                if name not in MIRRORED:
                    raise ValueError(f"the leader asked for {name!r}, not a device call")
                runner.replay(name, args)
                calls += 1
        except Exception as e:  # noqa: BLE001 - told to the leader, then exit
            log.exception("replaying the leader's device call failed")
            try:
                with self._send_lock:
                    self.sock.sendall(b"E" + f"{type(e).__name__}: {e}".encode()[:1000])
            except OSError:
                pass
            return 2
        finally:
            self._done.set()
            self.sock.close()
