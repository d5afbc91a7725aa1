"""A runner shaped by a pool's settings (`ModelRunner.for_pool`): under an ITL target every
decode bucket from the smallest mixed one up is compiled beside the prompt chunks, so the
running set can settle between the configured mixed sizes."""

from __future__ import annotations

from config.settings import PoolConfig, SchedulerConfig
from model.runner import ModelRunner

from .test_runner import TINY, random_params


def _pool(itl: float) -> PoolConfig:
    return PoolConfig(decode_buckets=[1, 4, 8, 16], mixed_decode_buckets=[4, 16],
                      prefill_buckets=[32, 64], page_size=8, kv_cache_bytes=1 << 20,
                      max_context=512, quantization="none", kv_cache_dtype="float32",
                      scheduler=SchedulerConfig(itl_target_s=itl, itl_strict=True))


def test_an_itl_target_compiles_every_decode_bucket_beside_the_chunks():
    params = random_params(TINY)
    plain = ModelRunner.for_pool(TINY, params, _pool(0.0))
    target = ModelRunner.for_pool(TINY, params, _pool(0.15))
    assert plain.mixed_decode_buckets == [4, 16]
    assert target.mixed_decode_buckets == [4, 8, 16]
    shapes = set(target.limits.shapes)
    assert {(8, 32), (8, 64)} <= shapes and not {(8, 32), (8, 64)} & set(plain.limits.shapes)
