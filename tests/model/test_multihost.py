"""The multi-host replica's channel (model/multihost.py), without jax.distributed: a
leader and followers over localhost, the rendezvous injected. tests/app/test_multihost.py
runs the real thing (two `sluice serve` processes)."""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time

import numpy as np
import pytest

from model import multihost
from model.multihost import MIRRORED, Follower, Leader
from model.runner import ModelRunner
from scheduler.protocol import RunnerLost


class Recorder:
    """A follower's runner: records the calls it is told to replay."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list = []
        self.fail = fail

    def replay(self, name, args):
        if self.fail:
            raise ValueError("this device call broke")
        self.calls.append((name, args))


def pair(timeout_s: float = 5.0, hello: bytes | None = None):
    """A connected (leader, follower); `hello`: a stranger connects first with it."""
    box: dict = {}
    published = threading.Event()

    def lead():
        box["leader"] = Leader("127.0.0.1", 1, timeout_s=timeout_s, connect_timeout_s=10,
                               publish=lambda v: (box.update(addr=v), published.set()))

    t = threading.Thread(target=lead)
    t.start()
    assert published.wait(10)
    if hello is not None:
        host, port, _ = box["addr"].rsplit(":", 2)
        stranger = socket.create_connection((host, int(port)))
        stranger.sendall(hello)
        box["stranger"] = stranger
    follower = Follower(lookup=lambda: box["addr"], pid=1)
    t.join(10)
    return box["leader"], follower, box


def test_the_runner_mirrors_each_of_its_device_calls():
    assert MIRRORED == {"_dev_support", "_dev_copy", "_dev_step", "_dev_sample", "_dev_score",
                        "_dev_swap_out", "_dev_swap_in"}  # (the KV tiers': refused there)
    for name in MIRRORED:
        assert callable(getattr(ModelRunner, name).__wrapped__)


def test_device_calls_reach_the_follower_in_order_and_stop_ends_it():
    leader, follower, _ = pair()
    runner = Recorder()
    status: list = []
    t = threading.Thread(target=lambda: status.append(follower.serve(runner)))
    t.start()
    src = np.arange(6, dtype=np.int32)
    leader.send("_dev_copy", (src, src[::-1].copy()))
    leader.send("_dev_support", ())
    leader.close()
    t.join(10)
    assert status == [0]
    assert [c[0] for c in runner.calls] == ["_dev_copy", "_dev_support"]
    np.testing.assert_array_equal(runner.calls[0][1][1], src[::-1])
    assert leader.lost is None


def test_a_stranger_without_the_token_is_turned_away():
    leader, follower, box = pair(hello=b"SLUICE-REPLICA-1" + b"\0\0\0\1" + b"x" * 32)
    assert box["stranger"].recv(10) == b""  # closed on it
    runner = Recorder()
    t = threading.Thread(target=follower.serve, args=(runner,))
    t.start()
    leader.send("_dev_support", ())
    leader.close()
    t.join(10)
    assert runner.calls == [("_dev_support", ())]


def test_the_follower_unpickles_only_step_data():
    with pytest.raises(pickle.UnpicklingError, match="may not carry"):
        multihost.loads(pickle.dumps(("_dev_copy", (os.system,))))
    batch = (np.zeros((2, 3), np.float32), np.int32(4), {"a": [1, 2.5, "x"]})
    out = multihost.loads(multihost.dumps(batch))
    assert out[0].shape == (2, 3) and out[1] == 4 and out[2] == {"a": [1, 2.5, "x"]}


def test_a_follower_that_exits_is_lost_at_once_and_steps_stop_waiting():
    leader, follower, _ = pair(timeout_s=60)
    blocked = threading.Event()
    errors: list = []

    def stuck_step():  # a collective whose peer is gone
        blocked.wait(30)

    t = threading.Thread(target=lambda: errors.append(_raises(leader.watch, stuck_step)))
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    follower.sock.close()  # the process died
    t.join(10)
    assert time.monotonic() - t0 < 3
    assert isinstance(errors[0], RunnerLost) and "process 1" in str(errors[0])
    assert "gone" in leader.lost
    with pytest.raises(RunnerLost):
        leader.send("_dev_support", ())
    blocked.set()
    leader.close()


def test_a_silent_follower_is_lost_after_the_heartbeat_timeout():
    leader, follower, _ = pair(timeout_s=1.0)
    follower._done.set()  # its heartbeats stop: a hung process
    t0 = time.monotonic()
    while leader.lost is None and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert leader.lost and "no heartbeat" in leader.lost
    assert 0.9 < time.monotonic() - t0 < 5
    leader.close()
    follower.sock.close()


def test_a_failed_replay_is_reported_and_a_vanished_leader_ends_the_follower():
    leader, follower, _ = pair()
    status: list = []
    t = threading.Thread(target=lambda: status.append(follower.serve(Recorder(fail=True))))
    t.start()
    leader.send("_dev_support", ())
    t.join(10)
    assert status == [2]
    t0 = time.monotonic()
    while leader.lost is None and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    assert "failed: ValueError: this device call broke" in leader.lost
    leader.close()

    leader, follower, _ = pair()
    status = []
    t = threading.Thread(target=lambda: status.append(follower.serve(Recorder())))
    t.start()
    for s in leader._socks.values():
        s.close()  # the leader process died
    t.join(10)
    assert status == [1]


def test_only_device_calls_may_be_asked_for():
    leader, follower, _ = pair()
    status: list = []
    t = threading.Thread(target=lambda: status.append(follower.serve(Recorder())))
    t.start()
    leader.send("close", ())
    t.join(10)
    assert status == [2]
    leader.close()


def _raises(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        return e
    return None
