"""Compile management: each bucket's step, the samplers and the page copy compiled ahead
of time (`jax.jit(...).lower(shapes).compile()`), once per key whichever thread asks
first, with the shardings the arrays will have under tensor parallelism; and the
persistent compilation cache that carries them across restarts.

`Compiling` is a mixin of `ModelRunner` (model/runner.py): it reads the runner's device
state (params, kv, attention, lora, tp) and fills its tables (`_steps`, `_samplers`).
Which buckets exist and which are ready is `model/programs.py`'s business; running each
once after its compile is warm-up's (model/warmup.py).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp

from . import sampling
from .llama import forward
from .packing import Bucket
from .tp import AXIS

COPY_BUCKET = 16  # pages copied per call of the page-copy program
SAMPLERS = ("greedy", "full", "penalties")  # each serves what the ones before it do


def enable_compilation_cache(path: str | None = None) -> str:
    """Persist compiled executables across processes (restarts, test runs)."""
    path = path or os.environ.get("SLUICE_JAX_CACHE") or os.path.join(
        os.environ.get("SLUICE_CACHE", os.path.expanduser("~/.cache/sluice")), "jax")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


class Compiling:
    """The runner's compiled programs, made on first use (ahead of any step that runs them)."""

    def _spec(self, tree: Any) -> Any:
        """Shapes for an ahead-of-time compile, with the shardings the arrays will have
        (host arrays: replicated on the mesh; none without devices)."""
        def one(a):
            sharding = None
            if self.tp is not None:
                sharding = a.sharding if isinstance(a, jax.Array) else self.tp.replicated
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

        return jax.tree.map(one, tree)

    def _spmd(self, fn: Callable) -> Callable:
        """`forward` as one program over the mesh: each device runs it on its shards,
        with the o/down partial sums all-reduced (model/tp.py)."""
        if self.tp is None:
            return fn
        from jax.sharding import PartitionSpec as P

        kv = (self.tp.kv_spec, self.tp.kv_spec)
        return jax.shard_map(
            functools.partial(fn, reduce=functools.partial(jax.lax.psum, axis_name=AXIS)),
            mesh=self.tp.mesh, in_specs=(self._param_specs, kv, P(), P(),
                                         P() if self.lora is None else self.lora.specs),
            out_specs=(kv, P(), P()), check_vma=False)

    def _new_pool(self) -> tuple:
        """The zeroed K and V pools, made where they live (on their shards, with TP)."""
        if self.tp is None:
            return (jnp.zeros(self.pool.shape, self.kv_storage),
                    jnp.zeros(self.pool.shape, self.kv_storage))
        make = jax.jit(lambda: jnp.zeros(self.pool.shape, self.kv_storage),
                       out_shardings=self.tp.sharding(self.tp.kv_spec))
        return (make(), make())

    def _compiled(self, table: dict, key: Any, make: Callable[[], Callable]) -> Callable:
        """`table[key]`, compiled by `make()` first if it is not there yet (once, whichever
        thread asks first)."""
        fn = table.get(key)
        if fn is None:
            with self._compile_lock:
                fn = table.get(key)
                if fn is None:
                    fn = table[key] = make()
        return fn

    def _program(self, b: Bucket) -> Callable:
        """Bucket `b`'s compiled step (compiled now if it is not yet). Its example inputs
        are taken under the device lock *before* the compile lock: the other order, with
        a thread that holds the device lock waiting on the compile lock (a follower
        replaying the leader's call for a shape its background precompile has not reached
        yet), deadlocked a two-process replica's warm-up now and then."""
        if b in self._steps:
            return self._steps[b]
        with self._lock:
            inputs = (self._batch(self._dummy(b), []), self.attention.state,
                      self._lora_arrays)
        return self._compiled(self._steps, b, lambda: self._compile_step(b, *inputs))

    def _compile_step(self, b: Bucket, batch, state, lora) -> Callable:
        spec = self._spec
        fn = self._spmd(functools.partial(
            forward, cfg=self.local_config, inv_freq=self._inv_freq, attention=self.attention,
            dec_rows=b.dec_rows, pf_blocks=b.pf_tokens // self.block_q, block_q=self.block_q,
            feature_major=self.feature_major))

        def step(params, kv, batch, state, lora, prev):
            # A pending token (overlapped scheduling): the step before sampled it.
            src = batch.prev_src
            tokens = jnp.where(src >= 0, prev[jnp.maximum(src, 0)], batch.tokens)
            return fn(params, kv, batch.replace(tokens=tokens), state, lora)

        prev = jax.ShapeDtypeStruct((self._prev_width,), jnp.int32,
                                    sharding=self.tp.replicated if self.tp else None)
        return jax.jit(step, donate_argnums=(1,)).lower(
            spec(self.params), spec(self.kv), spec(batch), spec(state), spec(lora),
            prev).compile()

    def _sampler(self, kind: str, rows: int) -> Callable:
        return self._compiled(self._samplers, (kind, rows),
                              lambda: self._compile_sampler(kind, rows))

    def _compile_sampler(self, kind: str, rows: int) -> Callable:
        logits = self._spec(jax.ShapeDtypeStruct((rows, self.config.vocab_size), jnp.float32))
        sample = sampling.sample_greedy if kind == "greedy" else sampling.sample_full
        width = self._prev_width

        def run(logits, *args):  # also the tokens alone, where the next step reads them
            packed = sample(logits, *args)
            tokens = jnp.zeros(width, jnp.int32).at[:rows].set(packed[:, 0].astype(jnp.int32))
            return packed, tokens

        args = self._spec(self._sampling_args(kind, rows, []))
        return jax.jit(run).lower(logits, *args).compile()

    def _compile_copy(self) -> Callable:
        def copy(kv, src, dst):  # pool rows, every layer's
            return tuple(a.at[dst].set(a[src]) for a in kv)

        rows = self._spec(jax.ShapeDtypeStruct((COPY_BUCKET * self.config.num_layers,),
                                               jnp.int32))
        return jax.jit(copy, donate_argnums=(0,)).lower(self._spec(self.kv), rows,
                                                          rows).compile()

    def _compile_swaps(self) -> tuple[Callable, Callable]:
        """The KV tiers' programs (model/kv_tiers.py): pool rows out (a gather; the pool
        is not donated, the steps queued after it use it) and host data in (a scatter,
        the pool donated), `SWAP_BUCKET` pages of every layer a call (fixed shapes)."""
        def out(kv, rows):
            return tuple(a[rows] for a in kv)

        def into(kv, rows, k, v):
            return (kv[0].at[rows].set(k), kv[1].at[rows].set(v))

        return jax.jit(out), jax.jit(into, donate_argnums=(0,))
