"""Building real pools: load weights, make a runner per replica, warm up, wrap in engines.

This is the only app/ module that imports model/ (and so JAX), and only inside functions,
so the HTTP layer, its tests and `sluice chat` start without JAX. Loading and compiling
are blocking CPU work: `load_pools` runs them in a worker thread, so the event loop keeps
answering /health ("loading") meanwhile.
"""

from __future__ import annotations

from typing import Any

import trio

from config.settings import PoolConfig, Settings

from .pools import Pool

def build_pool(cfg: PoolConfig, show_progress: bool = True) -> Pool:
    """Load `cfg.model` and build `cfg.replicas` warmed-up engines (blocking).

    Progress goes to stderr through model/progress.py, one display at a time (rich allows
    one live display): the loader's own, then one bar per replica's warmup.
    """
    from model.progress import progress
    from model.runner import ModelRunner, enable_compilation_cache
    from model.weights import load_model
    from scheduler.engine import Engine

    enable_compilation_cache()
    loaded = load_model(cfg.model, progress=show_progress)
    if loaded.tokenizer is None:
        raise ValueError(f"pool {cfg.name!r}: {cfg.model} has no tokenizer to serve text with")
    engines: list[Any] = []
    runner = None
    for i in range(cfg.replicas):
        runner = ModelRunner(
            loaded.config,
            loaded.params,
            eos_token_ids=loaded.tokenizer.eos_token_ids,
            page_size=cfg.page_size,
            kv_cache_bytes=cfg.kv_cache_bytes,
            max_context=cfg.max_context,
            decode_buckets=cfg.decode_buckets,
            prefill_buckets=sorted({tokens for _, tokens in cfg.prefill_buckets}),
            max_prefill_seqs=max(seqs for seqs, _ in cfg.prefill_buckets),
            dtype=cfg.dtype,
            attention_impl=None if cfg.attention == "auto" else cfg.attention,
        )
        what = f"{cfg.name}: warm up replica {i + 1}/{cfg.replicas}"
        with progress(show_progress) as bar:
            task = bar.add_task(what, total=None)

            def report(step: str, done: int, total: int) -> None:
                bar.update(task, description=f"{what}: {step}", completed=done, total=total)

            runner.warmup(report)
        engines.append(Engine(runner, loaded.tokenizer, cfg.scheduler, name=f"{cfg.name}/{i}"))
    assert runner is not None
    # A request must fit one replica's KV pool whole (page 0 is the null page).
    max_context = min(runner.max_context, (runner.num_pages - 1) * runner.page_size)
    return Pool(cfg, loaded.tokenizer, engines, max_context=max_context,
                vocab_size=loaded.config.vocab_size)


async def load_pools(settings: Settings, show_progress: bool = True) -> list[Pool]:
    """Build every pool in a worker thread (cancellable: a drain during loading exits)."""
    pools = []
    for cfg in settings.pools:
        pools.append(await trio.to_thread.run_sync(
            lambda: build_pool(cfg, show_progress), abandon_on_cancel=True))
    return pools
