"""Issue 18 points 1-2: tensor parallelism with jax.sharding, and pools on their own
devices. JAX fixes its device count when it starts, so each check runs in a subprocess
with 4 forced host devices (`--xla_force_host_platform_device_count=4`) sharing this
machine's cores: the point is correctness, not speed (docs/benchmarks.md has the cost).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from config.settings import PoolConfig, Settings

ROOT = Path(__file__).resolve().parents[2]


def run_forced(module: str, *args: str, timeout: float = 600) -> list[dict]:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def check_degrees(rows: list[dict], pool_heads: int) -> None:
    one = rows[0]
    assert one["tp"] == 1
    for r in rows[1:]:
        # The same greedy tokens for every request of the mixed batch...
        assert r["tokens"] == one["tokens"], r["tp"]
        # ... and logits within f32's reordering of the sums at the first steps (prefill,
        # then decode): 1e-5 of the largest logit, at least 1e-4. (SmolLM2's logits reach
        # ~31; XLA:CPU's AVX2 code for a 2-core AMD EPYC gave 1.28e-4 at tp = 4, its
        # AVX-512 code under 1e-4.)
        for step in range(2):
            want = np.asarray(one["logits"][step])
            diff = np.abs(np.asarray(r["logits"][step]) - want)
            assert diff.max() < 1e-5 * max(np.abs(want).max(), 10.0), (r["tp"], step,
                                                                        diff.max())
        # The compiled steps all-reduce (after o and down) and never gather: the KV pool
        # stays split by head, each device holding only its own heads' pages.
        assert r["all_reduce"] >= 2 and r["all_gather"] == 0, r
        assert [s[2] for s in r["kv_shards"]] == [pool_heads // r["tp"]], r


def test_tp_2_and_4_match_tp_1_on_a_llama_shaped_model():
    rows = run_forced("tests.model.tp_check", "random", "1,2,4")
    assert [r["tp"] for r in rows] == [1, 2, 4]
    check_degrees(rows, pool_heads=4)


@pytest.mark.slow
def test_tp_2_and_4_match_tp_1_on_smollm2_whose_heads_do_not_divide(embedded_gguf):
    # 9 query heads, 3 KV heads: padded to 12 and 4 for both degrees (model/tp.py).
    rows = run_forced("tests.model.tp_check", "embedded", "1,2,4")
    assert rows[0]["pool"].split("x")[2] == "3" and rows[1]["pool"].split("x")[2] == "4"
    check_degrees(rows, pool_heads=4)


def test_two_pools_pinned_to_their_own_devices_serve_at_once():
    (report,) = run_forced("tests.app.pinned_pools_check")
    chat, long = report["chat"], report["long"]
    assert chat["answers"] == 4 and long["answers"] == 4
    assert chat["steps"] > 0 and long["steps"] > 0
    assert chat["kv_devices"] == chat["param_devices"] == [0, 1]
    assert long["kv_devices"] == long["param_devices"] == [2, 3]


def test_device_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"pools\[a\]\.devices: 1 devices for replicas x "
                                         r"tensor_parallel = 2"):
        PoolConfig(name="a", devices=[0], tensor_parallel=2)
    with pytest.raises(ValueError, match=r"pools\[a\]\.devices has duplicates"):
        PoolConfig(name="a", devices=[1, 1], tensor_parallel=2)
    with pytest.raises(ValueError, match=r"pools\[b\]\.devices overlaps pools\[a\]\.devices"):
        Settings(pools=[PoolConfig(name="a", devices=[0, 1], tensor_parallel=2),
                        PoolConfig(name="b", served_model_names=["other"], devices=[1])])
    from app.loading import device_groups

    with pytest.raises(ValueError, match=r"pools\[a\]\.devices: no device 7"):
        device_groups(PoolConfig(name="a", devices=[7]))
    with pytest.raises(ValueError, match=r"pools\[a\]\.tensor_parallel = 2, but this process "
                                         r"has 1 cpu devices"):
        device_groups(PoolConfig(name="a", tensor_parallel=2))
    assert device_groups(PoolConfig(name="a", replicas=2)) == [None, None]
