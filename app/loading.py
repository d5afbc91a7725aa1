"""Building real pools: load weights, make a runner per replica, warm up, wrap in engines.

With app/cli.py's `bench-engine`, the only app/ module that imports model/ (and so JAX),
and only inside functions, so the HTTP layer, its tests and `sluice chat` start without
JAX. Loading and compiling are blocking CPU work: `load_pools` runs them in a worker
thread, so the event loop keeps answering /health ("loading") meanwhile.

Warm-up (docs/operations.md, "Start-up"): a replica is ready once its essential shapes
are compiled (a few seconds); with `warmup = "background"` the rest compile in a thread
while it serves, and /health, /metrics and the ready line say how many are left.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import trio

from config.settings import PoolConfig, Settings

from .pools import Pool

log = logging.getLogger("sluice.loading")


def build_pool(cfg: PoolConfig, show_progress: bool = True, *, warmup: str | None = None,
               first_prompts: Callable[[Any], list[int]] | None = None) -> Pool:
    """Load `cfg.model` and build `cfg.replicas` engines, warmed up (blocking).

    `warmup` (default `cfg.warmup`): "full" compiles every shape before returning;
    "background" the essential ones (`ModelRunner.warm_essential`), then the rest in a
    background thread; "essential" only those (`sluice generate`). `first_prompts(tokenizer)`
    gives the prompt lengths the first steps will carry (default: a 64-token question), so
    their shapes are among the essential ones. Progress goes to stderr through
    model/progress.py, one display at a time (rich allows one live display): the
    loader's own, then one bar per replica's warm-up."""
    from model.progress import progress
    from model.runner import ModelRunner, enable_compilation_cache
    from model.weights import load_model
    from scheduler.engine import Engine

    from model import multihost

    enable_compilation_cache()
    if multihost.active():
        check_multihost([cfg])
    warmup = warmup or cfg.warmup
    loaded = load_model(cfg.model, progress=show_progress, shards=process_shards(cfg))
    log_read(loaded)
    if loaded.tokenizer is None:
        raise ValueError(f"pool {cfg.name!r}: {cfg.model} has no tokenizer to serve text with")
    tokenizer, config = loaded.tokenizer, loaded.config
    tokenizer.warm()  # the first request must not pay for the template's compile
    groups = device_groups(cfg)
    runners = [ModelRunner.for_pool(config, loaded.params, cfg,
                                    eos_token_ids=tokenizer.eos_token_ids, devices=group,
                                    replica=i if cfg.replicas > 1 else None)
               for i, group in enumerate(groups)]
    del loaded  # the runners hold the weights now, in their own layout
    if multihost.active():  # from here on every device call is mirrored to the followers
        runners[0].mirror = multihost.Leader()
    drafts = draft_proposers(cfg, config, groups, warmup, show_progress)
    engines: list[Any] = []
    for i, runner in enumerate(runners):
        what = f"{cfg.name}: warm up replica {i + 1}/{cfg.replicas}"
        with progress(show_progress) as bar:
            task = bar.add_task(what, total=None)

            def report(step: str, done: int, total: int) -> None:
                bar.update(task, description=f"{what}: {step}", completed=done, total=total)

            if warmup == "full":
                runner.warmup(progress=report)
            else:
                lengths = first_prompts(tokenizer) if first_prompts else [64]
                runner.warm_essential(lengths, progress=report)
        engines.append(Engine(runner, tokenizer, cfg.scheduler, name=f"{cfg.name}/{i}",
                              proposer=drafts[i]))
    if warmup == "background":
        for runner in runners:
            runner.warm_in_background()
    runner = runners[0]
    # A request must fit one replica's KV pool whole (page 0 is the null page).
    max_context = min(runner.max_context, (runner.num_pages - 1) * runner.page_size)
    pool = Pool(cfg, tokenizer, engines, max_context=max_context,
                vocab_size=config.vocab_size, adapter_reader=adapter_reader(config, cfg))
    for a in cfg.adapters:  # declared adapters; a bad one stops the start, naming the file
        try:
            pool.adapters.load_blocking(a.name, a.path)
        except ValueError as e:
            raise ValueError(f"pool {cfg.name!r}: adapter {a.name!r}: {e}") from None
    return pool


def draft_proposers(cfg: PoolConfig, config, groups, warmup: str,
                    show_progress: bool) -> list[Any]:
    """Each replica's draft model (`speculative = "draft"`: `draft_model`, on the replica's
    devices, a quarter of `kv_cache_bytes` for its pool, the pool's shapes, every shape
    compiled before serving); Nones otherwise."""
    if cfg.scheduler.speculative != "draft":
        return [None] * len(groups)
    import msgspec

    from model import multihost

    if multihost.active():  # its device calls are not mirrored to the followers
        raise ValueError(f"pool {cfg.name!r}: a draft model on a multi-host replica is not "
                         "supported (use speculative = \"ngram\")")

    from model.draft import DraftProposer
    from model.runner import ModelRunner
    from model.weights import load_model

    draft = load_model(cfg.scheduler.draft_model, progress=show_progress)
    if draft.config.vocab_size != config.vocab_size:
        raise ValueError(f"pool {cfg.name!r}: draft model {cfg.scheduler.draft_model} has "
                         f"{draft.config.vocab_size} tokens, the model "
                         f"{config.vocab_size}: a draft must share the tokenizer")
    shape = msgspec.structs.replace(cfg, kv_cache_bytes=max(cfg.kv_cache_bytes // 4, 1 << 20),
                                    kv_host_bytes=0, kv_disk_dir=None, max_loras=0,
                                    adapters=[], window_pages=False)  # (its own page tables)
    out = []
    for group in groups:
        runner = ModelRunner.for_pool(draft.config, draft.params, shape, devices=group)
        if warmup != "essential":
            runner.warmup()  # its steps must never wait for a compile
        out.append(DraftProposer(runner))
    return out


def device_groups(cfg: PoolConfig) -> list[list[Any] | None]:
    """Each replica's devices (None: JAX's default device), from `devices` and
    `tensor_parallel`; a config this process cannot honour fails naming the key."""
    import jax

    present = jax.devices()
    n, tp = len(present), cfg.tensor_parallel
    if cfg.devices is None:
        if tp == 1:
            return [None] * cfg.replicas
        if tp > n or n % tp:
            raise ValueError(f"pools[{cfg.name}].tensor_parallel = {tp}, but this process has "
                             f"{n} {present[0].platform} devices")
        ids = [(i * tp + j) % n for i in range(cfg.replicas) for j in range(tp)]
    else:
        if missing := [d for d in cfg.devices if d >= n]:
            raise ValueError(f"pools[{cfg.name}].devices: no device {missing[0]}; this process "
                             f"has {n} {present[0].platform} devices (ids 0-{n - 1})")
        ids = cfg.devices
    return [[present[d] for d in ids[i * tp:(i + 1) * tp]] for i in range(cfg.replicas)]


def check_multihost(pools) -> PoolConfig:
    """The one pool a multi-host replica serves: one replica, tensor parallel over every
    device of its processes (model/multihost.py). Else a ValueError naming the key."""
    import jax

    from model import multihost

    if len(pools) != 1:
        raise ValueError(f"a multi-host replica serves one pool; the config has {len(pools)} "
                         f"({', '.join(p.name for p in pools)})")
    cfg = pools[0]
    if cfg.replicas != 1:
        raise ValueError(f"pools[{cfg.name}].replicas = {cfg.replicas}: a multi-host server "
                         "is one replica over its processes")
    if cfg.kv_host_bytes:
        raise ValueError(f"pools[{cfg.name}].kv_host_bytes: the KV tiers keep pages in this "
                         "process's memory, which a multi-host replica's pool spans beyond")
    n = jax.device_count()
    if cfg.tensor_parallel != n:
        raise ValueError(f"pools[{cfg.name}].tensor_parallel = {cfg.tensor_parallel}, but a "
                         f"multi-host replica spans all {n} devices of its "
                         f"{multihost.num_processes()} processes")
    return cfg


def run_follower(settings: Settings) -> int:
    """A follower process of a multi-host replica (`sluice serve --process-id I`, I > 0):
    its runner built as process 0 builds its own, then the device calls process 0 sends,
    replayed until it stops. Returns `Follower.serve`'s status."""
    from config.settings import ConfigError
    from model.multihost import Follower
    from model.runner import ModelRunner, enable_compilation_cache
    from model.weights import load_model

    try:
        cfg = check_multihost(settings.pools)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    enable_compilation_cache()
    loaded = load_model(cfg.model, progress=False, shards=process_shards(cfg))
    log_read(loaded)
    eos = loaded.tokenizer.eos_token_ids if loaded.tokenizer is not None else ()
    runner = ModelRunner.for_pool(loaded.config, loaded.params, cfg, eos_token_ids=eos,
                                  devices=device_groups(cfg)[0])
    del loaded
    runner.precompile_in_background()
    return Follower().serve(runner)


def process_shards(cfg: PoolConfig):
    """For a multi-host replica's process: `shards(config)`, the slices of an orbax
    checkpoint's split tensors its devices hold (model/loaders/orbax_ckpt.py), or None
    where the tensors split only after padding (then it reads them whole). None: not
    multi-host."""
    from model import multihost

    if not multihost.active() or cfg.tensor_parallel == 1:
        return None
    import jax

    from model.loaders.orbax_ckpt import Shards
    from model.runner import ModelRunner

    group = device_groups(cfg)[0]
    mine = tuple(j for j, d in enumerate(group) if d.process_index == jax.process_index())
    tp = ModelRunner.tensor_parallel(group, cfg.quantization, cfg.dtype)
    return lambda config: (Shards(len(group), mine)
                           if tp.padded_config(config) == config else None)


def log_read(loaded) -> None:
    if loaded.read_bytes is not None:
        done, total = loaded.read_bytes
        log.info("read %.1f of %.1f MB of %s: this process's shards", done / 1e6,
                 total / 1e6, loaded.source)


def adapter_reader(config, cfg: PoolConfig) -> Callable[[str, str], Any] | None:
    """How the pool reads a LoRA adapter for its runners (None: it serves none)."""
    if not cfg.max_loras:
        return None
    from model.lora import load_peft_adapter

    def read(name: str, path: str):
        return load_peft_adapter(path, name, config, max_rank=cfg.max_lora_rank)

    return read


async def load_pools(settings: Settings, show_progress: bool = True) -> list[Pool]:
    """Build every pool in a worker thread (cancellable: a drain during loading exits)."""
    pools = []
    for cfg in settings.pools:
        pools.append(await trio.to_thread.run_sync(
            lambda: build_pool(cfg, show_progress), abandon_on_cancel=True))
    return pools
