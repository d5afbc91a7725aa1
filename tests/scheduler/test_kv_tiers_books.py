"""The KV tiers' books (scheduler/kv_tiers.py) on their own: host slots, LRU, disk reads
asked for and done, copy-up or recompute."""

from __future__ import annotations

from scheduler.kv_tiers import KVTiers
from scheduler.pages import chain_key


def meta(i: int, salt: str = "") -> tuple:
    return (i, salt, (i, i + 1))


def key(i: int, salt: str = "") -> int:
    return chain_key(*meta(i, salt))


def test_chain_keys_are_stable_and_salted():
    # Fixed across processes (the disk tier's file names): a known value.
    assert chain_key(0, "", (1, 2, 3)) == chain_key(0, "", (1, 2, 3))
    assert chain_key(0, "a", (1, 2, 3)) != chain_key(0, "b", (1, 2, 3))
    assert chain_key(0, "", (1, 2, 3)) != chain_key(1, "", (1, 2, 3))
    assert chain_key(0, "ab", (1,)) != chain_key(0, "a", (1,))


def test_demote_fills_slots_then_evicts_the_least_recent():
    t = KVTiers(2, 100)
    assert t.demote(key(1), meta(1)) == 0
    assert t.demote(key(2), meta(2)) == 1
    assert t.demote(key(1), meta(1)) is None  # already there: touched, no copy
    assert t.demote(key(3), meta(3)) == 1  # slot 1 (key 2) was the least recent
    assert t.match(iter([(key(1), meta(1)), (key(3), meta(3))])) == [0, 1]
    assert t.match(iter([(key(2), meta(2))])) == []
    assert t.copy_down_bytes == 300
    assert t.audit() == []


def test_a_hit_needs_the_same_salt_and_tokens():
    t = KVTiers(4, 100)
    t.demote(key(1, "a"), meta(1, "a"))
    assert t.match(iter([(key(1, "a"), meta(1, "b"))])) == []  # same key, other contents
    assert t.match(iter([(key(1, "b"), meta(1, "b"))])) == []


def test_disk_reads_asked_for_and_done():
    disk = {key(1), key(2), key(3)}
    t = KVTiers(2, 100, disk=disk)
    run, busy = t.on_disk(iter([(key(i), meta(i)) for i in (1, 2, 3)]))
    assert [k for k, _ in run] == [key(1), key(2), key(3)] and not busy
    assert t.request_load(run) == 2  # two slots only
    assert t.on_disk(iter([(key(1), meta(1))]))[1]  # busy: being read
    assert t.demote(key(1), meta(1)) is None  # not copied down while it is read
    (job,) = t.take_loads()
    assert t.take_loads() == []
    job.ok = [True, False]  # the second file was bad
    t.loaded(job, seconds=0.001)
    assert t.match(iter([(key(1), meta(1)), (key(2), meta(2))])) == [job.slots[0]]
    t.count_hits([job.slots[0]])
    assert t.hit_tokens == {"host": 0, "disk": 16, "remote": 0}
    assert t.disk_failed_pages == 1 and t.num_loading == 0
    assert t.audit() == []


def test_copy_up_or_recompute_from_measured_costs():
    t = KVTiers(4, 1_000_000, page_size=16)
    assert t.worth(3, "host", None)  # nothing measured yet: copy
    assert not t.worth(0, "host", None)
    t.rate["disk"] = 1e6  # 1 MB/s: a page takes 1 s to read
    assert not t.worth(1, "disk", 0.001)  # its 16 tokens take 16 ms to compute
    assert t.worth(1, "disk", 0.1)
    for _ in range(50):
        t.note_rate("host", 10_000_000, 0.001)
    assert t.rate["host"] > 9e9


def test_forget_drops_what_a_failed_step_never_copied():
    t = KVTiers(2, 100)
    t.demote(key(1), meta(1))
    t.forget([key(1), key(9)])
    assert t.num_host_pages == 0 and t.audit() == []
