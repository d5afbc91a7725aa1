"""Each native target's build (tests/cpu_kernels/native_targets.py: portable, AVX2, AVX-512, AVX-512
BF16, AMX), registered beside the default build, skipped with the reason where this CPU
cannot run it; and the build for this CPU without the AMX tile unit (the exact paths the
AMX ones are held against)."""

from __future__ import annotations

import pytest

from tests.cpu_kernels import native_targets as targets


@pytest.fixture(scope="session", params=targets.TARGETS)
def target_build(request) -> targets.Build:
    return targets.build(request.param)


@pytest.fixture(scope="session")
def noamx() -> targets.Build:
    return targets.without_amx()
