"""The model runner: a `StepPlan` in, one sampled token per sequence out, with a single
device-to-host copy per step.

Shapes are fixed by buckets (`packing.Bucket`: decode rows x prefill tokens). Each bucket's
step is compiled ahead of time (`model/programs.py`: a few before serving, the rest in
the background); a step runs in the smallest ready bucket that holds it and never
compiles. The KV pool is allocated once at construction and donated into every step, so
XLA updates it in place. Attention is the backend's business (`pallas_kernels`): the
runner hands it each step's generic layout and passes its metadata and state along.

Given `devices`, the runner lives on them: one device, or N with tensor parallelism
(model/tp.py): weights and the KV pool are sharded over a 1-D mesh, and every compiled
step is one SPMD program (`jax.shard_map` around `forward`) whose logits are replicated,
so sampling and everything after it is unchanged.

Every device program it launches goes through one of its `_dev_*` calls, whose arguments
are host data: a multi-host replica's process 0 sends each one to the other processes
first (`mirror`, model/multihost.py), so they run the same programs in the same order.

(About 750 lines: the runner owns the device state — KV pool, adapter slots, the f32 or
int8 weights, their placement on devices, compiled programs — and every path that touches
it is kept here, under one lock, so that the device calls can be listed in one place;
a step is `launch` (pack, queue the programs) then `collect` (wait, read back), the two
halves overlapped scheduling runs apart;
prompt scoring, quantization, the tensor-parallel layout and the multi-host channel live
in scoring.py, quant.py, tp.py and multihost.py.)
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import PoolLayout, make_backend
from pallas_kernels.backends import row_elements
from scheduler.protocol import SeqChunk, StepLimits, StepPlan, StepResult

from . import sampling
from .base import resolve_dtype
from .adapter_slots import LoraSlots, native_available as native_lora_available
from .config import ModelConfig
from .inflight import Launched, ReadyTimes
from .llama import StepBatch, forward, prepare_params, rope_inv_freq
from .quant import NATIVE_WEIGHTS, quantized_bytes
from .scoring import PromptScorer
from .packing import Bucket, StepLayout, dummy_layout, pack, sample_rows, split
from .multihost import mirrored
from .programs import Programs
from .tp import AXIS, TensorParallel

log = logging.getLogger("sluice.runner")

_COPY_BUCKET = 16  # pages copied per call of the page-copy program
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


class ModelRunner:
    """Implements `scheduler.protocol.Runner` for the Llama family in JAX."""

    def __init__(
        self,
        config: ModelConfig,
        params: dict,
        *,
        eos_token_ids: Iterable[int] = (),
        page_size: int = 16,
        num_pages: int | None = None,
        kv_cache_bytes: int = 1 << 30,
        max_context: int | None = None,
        decode_buckets: Iterable[int] = (1, 4, 8, 16),
        prefill_buckets: Iterable[int] = (64, 256),
        mixed_decode_buckets: Iterable[int] | None = None,
        block_q: int = 16,
        max_prefill_seqs: int = 4,
        dtype: str = "auto",
        attention: str | None = None,
        attention_options: dict | None = None,
        feature_major: bool | None = None,
        switched_mlp: bool | None = None,
        unrolled_layers: bool | None = None,
        adapter_slots: int = 0,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        native_lora: bool | None = None,
        time_all_shapes: bool = False,
        quantization: str = "none",
        kv_cache_dtype: str = "auto",
        devices: Sequence[Any] | None = None,
    ) -> None:
        # Where it runs: None, JAX's default device; else these, tensor parallel over them.
        tp_n = len(devices) if devices else 1
        self.dtype = resolve_dtype(dtype)
        quantization = self._quantization(quantization)
        # The native packed weights' blocks: 32 input values never straddle two devices.
        self.tp = TensorParallel(tuple(devices), in_multiple=(
            32 if quantization in NATIVE_WEIGHTS else 1)) if devices else None
        if tp_n > 1 and attention in (None, "cpu"):
            # The jnp cascade's prefix copy is device state kept across steps, which is not
            # sharded (the native kernels keep none: they read the pool's pages in place).
            attention_options = {"prefix_copy_tokens": 0, **(attention_options or {})}
        self.base_config = config  # the model's own shapes (LoRA adapters are read against)
        if self.tp is not None:  # `config` becomes the padded one (model/tp.py)
            params = self.tp.pad_params(params, config)
            config = self.tp.padded_config(config)
        self.config = cfg = config
        self.page_size = page_size
        self.block_q = block_q
        self.max_context = min(max_context or cfg.max_position, cfg.max_position)
        self.eos_token_ids = frozenset(eos_token_ids or cfg.eos_token_ids)
        self.decode_buckets = sorted(set(decode_buckets))
        self.prefill_buckets = sorted(set(prefill_buckets))
        for b in self.prefill_buckets:
            if b % block_q:
                raise ValueError(f"prefill bucket {b} must be a multiple of {block_q=}")
        self.max_prefill_seqs = max_prefill_seqs
        if self.prefill_buckets and (
                self.prefill_buckets[-1] <= max_prefill_seqs * (block_q - 1)):
            # Each of `max_prefill_seqs` chunks may pad up to block_q - 1 tokens: the
            # largest bucket must hold that padding and at least one real token more.
            raise ValueError(
                f"the largest prefill bucket ({self.prefill_buckets[-1]}) leaves no room for "
                f"prompt tokens beside {max_prefill_seqs} chunks' padding (max_prefill_seqs x "
                f"(block_q - 1) = {max_prefill_seqs * (block_q - 1)}): raise prefill_buckets "
                "or lower max_prefill_seqs")
        # Decode sizes compiled beside each prefill bucket (0: prompt-only steps); None:
        # all of them. A step with prompt tokens uses the smallest that holds its decodes.
        mixed = ([0, *self.decode_buckets] if mixed_decode_buckets is None
                 else mixed_decode_buckets)
        self.mixed_decode_buckets = sorted(set(mixed))

        self.quantization = quantization
        self.kv_dtype, self.kv_storage = self._kv_dtype(kv_cache_dtype, attention,
                                                        attention_options or {})
        row = row_elements(cfg.head_dim, self.kv_storage)
        self.kv_bytes_per_token = (2 * cfg.num_layers * cfg.num_kv_heads * row
                                   * np.dtype(self.kv_storage).itemsize)
        if num_pages is None:
            num_pages = max(2, kv_cache_bytes // (self.kv_bytes_per_token * page_size))
        self.num_pages = int(num_pages)
        self.kv_bytes = self.num_pages * page_size * self.kv_bytes_per_token
        self.pool = PoolLayout(layers=cfg.num_layers, pages=self.num_pages,
                               page_size=page_size, kv_heads=cfg.num_kv_heads,
                               head_dim=cfg.head_dim, dtype=self.kv_storage,
                               pages_per_seq=-(-self.max_context // page_size))
        # What one device computes (the whole model without tensor parallelism).
        self.local_config = self.tp.local_config(cfg) if self.tp else cfg
        self.kv = self._new_pool()
        self.attention = make_backend(
            attention, dataclasses.replace(self.pool, kv_heads=self.local_config.num_kv_heads),
            **(attention_options or {}))
        if tp_n > 1 and self.attention.state is not None:
            raise ValueError(f"attention backend {self.attention.name!r} keeps device state "
                             "across steps, which tensor parallelism does not shard")
        # Feature-major residual stream (weights (out, in), multiplied from the left): faster
        # on XLA:CPU at few rows (model/llama.py, forward); not measured on a GPU yet.
        self.feature_major = (jax.default_backend() == "cpu" if feature_major is None
                              else feature_major)
        # On the CPU the MLP weights stay per layer, behind a switch: XLA:CPU copies a slice
        # of a stacked weight before its matmul (model/llama.py, _per_layer).
        self.switched_mlp = (jax.default_backend() == "cpu" if switched_mlp is None
                             else switched_mlp)
        # The layer loop unrolled over per-layer weights: XLA:GPU (jax 0.11.2, H200) copied
        # each layer's slice of a stacked weight before its matmul, half of an 8B decode
        # step (docs/benchmarks.md, "Accelerator (H200)"); it costs compile time.
        self.unrolled_layers = ((jax.default_backend() == "gpu" if unrolled_layers is None
                                 else unrolled_layers) and quantization not in NATIVE_WEIGHTS)
        self.params = prepare_params(
            params, cfg, self.dtype, feature_major=self.feature_major,
            switched_mlp=self.switched_mlp, unrolled=self.unrolled_layers,
            quantization=quantization, shards=tp_n,
            place=self.tp.placer(feature_major=self.feature_major) if self.tp else None,
            place_quantized=self.tp.quantized_placer() if self.tp else None)
        self._param_specs = (self.tp.param_specs(self.params, feature_major=self.feature_major)
                             if self.tp else None)
        # LoRA adapters held on the device at once (model/adapter_slots.py); 0: none, and
        # the compiled steps carry no LoRA code at all.
        self.adapter_slots = adapter_slots
        # On the CPU the native kernel applies each token's own slot (SGMV-style), in bf16
        # beside the native kernels' base weights (which round activations too).
        # With tensor parallelism the slots are split as the weights are (adapter_slots.py).
        native_lora = (native_lora if native_lora is not None else
                       bool(adapter_slots) and native_lora_available())
        self.lora = LoraSlots(
            self.base_config, adapter_slots, max_rank=max_lora_rank, tp=self.tp,
            dtype=jnp.bfloat16 if native_lora and quantization in NATIVE_WEIGHTS else self.dtype,
            feature_major=self.feature_major, max_cpu=max_cpu_loras,
            native=native_lora) if adapter_slots else None
        self._inv_freq = rope_inv_freq(cfg)
        self._steps: dict[Bucket, Callable] = {}
        self._samplers: dict[tuple[str, int], Callable] = {}
        self._copy: Callable | None = None
        self._scorer = PromptScorer(cfg, self.feature_major)  # prompt logprobs
        # The pool and the backend's state: one user at a time (reentrant: a device call
        # may compile its program on first use, inside the lock).
        self._lock = threading.RLock()
        self._compile_lock = threading.Lock()
        self._last: tuple[Any, Any] = (None, None)  # the last step's logits and hidden
        # Overlapped scheduling: the last launched step's sampled tokens, on the device
        # ([_prev_width] int32, written by every sampler run), and each sequence's row
        # in it: a `pending` chunk of the next step reads its token from there.
        self._prev_tokens: Any = None
        self._prev_rows: dict[int, int] = {}
        self._ready = ReadyTimes()  # when each launched step's output was ready
        self._last_ready = 0.0  # ... the last collected one's (perf_counter)
        # A multi-host replica's leader (model/multihost.py): every device call is
        # mirrored to the follower processes first; None in one process.
        self.mirror = None
        self._rng = np.random.default_rng()
        # (decode rows, prefill tokens, seconds) of each shape's timed warm-up run, for the
        # scheduler's step-cost estimates before any request ran (appended by the thread
        # that compiles; the engine reads what is there).
        self.warmup_times: list[tuple[int, int, float]] = []
        # Time every shape's warm-up run, not just those admission needs (a pool with an
        # ITL target plans each step from each shape's own time).
        self.time_all_shapes = time_all_shapes
        self.programs = Programs(self.buckets(), self._build)
        self._prev_width = max((self._sample_rows(b) for b in self.programs.all), default=1)
        self._prev_tokens = np.zeros(self._prev_width, np.int32)

    def _quantization(self, quantization: str) -> str:
        """int8 weights (model/quant.py): the projections and the lm_head multiplied by the
        CPU backend's native kernel in every shape; their f32 copies are not kept.
        "auto": int8 on the CPU where the kernel builds with a fast path (AMX, AVX-512,
        AVX2), else the weights' dtype. "q4_1": the projections in Q4_1 blocks times int8
        activations (opt-in: the activations' rounding, docs/benchmarks.md). With tensor
        parallelism too: each device multiplies its own packed shards (model/tp.py)."""
        if quantization not in ("auto", "none", *NATIVE_WEIGHTS):
            raise ValueError(f"quantization must be 'auto', 'none', 'int8' or 'q4_1', not "
                             f"{quantization!r}")
        if quantization == "auto":
            quantization = "none"
            if jax.default_backend() == "cpu" and self.dtype == jnp.float32:
                from pallas_kernels.native import fast

                ok, why = fast()
                if ok:
                    quantization = "int8"
                else:
                    log.warning("int8 weights unavailable, serving f32: %s", why)
        if quantization in NATIVE_WEIGHTS:
            from pallas_kernels.native import NativeUnavailable, available

            ok, why = available()
            if not ok:
                raise NativeUnavailable(f"quantization {quantization!r} needs the CPU's "
                                        f"native kernels: {why}")
        return quantization

    def _kv_dtype(self, kv_cache_dtype: str, attention: str | None,
                  attention_options: dict):
        """(what the KV pool holds, the array dtype it is stored as). "auto": the model's
        dtype, except beside the native weight formats on the CPU (the native kernels'
        path), where it is int8: each token's row of a KV head rounded over its largest
        magnitude, its f32 scale beside it (`backends.to_pool`), a quarter of f32's bytes
        and a bit more, read by the native kernels only: 1.9x bf16's tokens in the same
        bytes and faster steps, at 0.8 points of top-1 agreement (docs/benchmarks.md, "The
        defaults"). "bfloat16" on the CPU is stored as its bit patterns in uint16: XLA:CPU
        has no native bf16 scatter or gather (a bf16 pool's step ran for minutes), and
        only the native attention kernels read it, widening as they go (its prompt
        attention on the AMX tile unit where the CPU has one)."""
        if kv_cache_dtype not in ("auto", "float32", "bfloat16", "int8"):
            raise ValueError(f"kv_cache_dtype must be 'auto', 'float32', 'bfloat16' or "
                             f"'int8', not {kv_cache_dtype!r}")
        dtype = self.dtype if kv_cache_dtype == "auto" else jnp.dtype(kv_cache_dtype)
        if (kv_cache_dtype == "auto" and self.quantization in NATIVE_WEIGHTS
                and attention in (None, "cpu") and attention_options.get("native") is not False):
            dtype = jnp.dtype(jnp.int8)  # native weights mean the native kernels are here
        if dtype == jnp.int8 and jax.default_backend() != "cpu":
            raise ValueError("an int8 KV pool is read by the CPU backend's native kernels "
                             "only; on an accelerator use 'auto' or 'bfloat16'")
        if dtype not in (jnp.bfloat16, jnp.int8) or jax.default_backend() != "cpu":
            return dtype, dtype
        from pallas_kernels.native import available

        ok, why = available()
        # With tensor parallelism too: inside `shard_map` the native kernels read each
        # device's KV-head shard of the pool (a bf16 row, or an int8 row and its scale, is
        # one head's), and their state-free plan is host metadata every device shares.
        if (attention not in (None, "cpu") or not ok
                or attention_options.get("native") is False):
            if kv_cache_dtype == "auto":  # a bf16 model's own pool, read by jnp (slow)
                return dtype, dtype
            raise ValueError(f"a {dtype.name} KV pool on the CPU needs the CPU attention "
                             "backend's native kernels" +
                             ("" if ok else f" (native kernels unavailable: {why})"))
        return dtype, jnp.dtype(jnp.int8 if dtype == jnp.int8 else jnp.uint16)

    def _new_pool(self) -> tuple:
        """The zeroed K and V pools, made where they live (on their shards, with TP)."""
        if self.tp is None:
            return (jnp.zeros(self.pool.shape, self.kv_storage),
                    jnp.zeros(self.pool.shape, self.kv_storage))
        make = jax.jit(lambda: jnp.zeros(self.pool.shape, self.kv_storage),
                       out_shardings=self.tp.sharding(self.tp.kv_spec))
        return (make(), make())

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

    @classmethod
    def for_pool(cls, config: ModelConfig, params: dict, pool, *,
                 eos_token_ids: Iterable[int] = (),
                 devices: Sequence[Any] | None = None) -> "ModelRunner":
        """A runner shaped by a pool's settings (`config.settings.PoolConfig`), on
        `devices` (None: JAX's default device).

        Under an ITL target every decode bucket from the smallest mixed one up is also
        compiled beside the prompt chunks: the running set's size then follows from the
        step times, and a step of d decodes runs in the smallest shape that holds d, so
        with mixed shapes at 4 and 16 only, 5-16 streams cost what 16 do and a target
        that 16 just miss holds 4 (measured: docs/benchmarks.md, "Issue 16: a door that
        calibrates itself")."""
        mixed = list(pool.mixed_decode_buckets)
        beside = [m for m in mixed if m]  # (0: prompt-only steps)
        if pool.scheduler.strict_itl_s > 0 and beside:
            mixed = sorted(set(mixed) | {d for d in pool.decode_buckets if d >= min(beside)})
        return cls(config, params, eos_token_ids=eos_token_ids, page_size=pool.page_size,
                   kv_cache_bytes=pool.kv_cache_bytes, max_context=pool.max_context,
                   decode_buckets=pool.decode_buckets, prefill_buckets=pool.prefill_buckets,
                   mixed_decode_buckets=mixed,
                   max_prefill_seqs=pool.max_prefill_seqs, dtype=pool.dtype,
                   attention=None if pool.attention == "auto" else pool.attention,
                   adapter_slots=pool.max_loras, max_lora_rank=pool.max_lora_rank,
                   max_cpu_loras=pool.max_cpu_loras,
                   time_all_shapes=pool.scheduler.strict_itl_s > 0,
                   quantization=pool.quantization, kv_cache_dtype=pool.kv_cache_dtype,
                   devices=devices)

    # ------------------------------------------------------------------------ adapters
    def add_adapter(self, adapter) -> None:
        """Register a LoRA adapter (`model.lora.load_peft_adapter`); the scheduler puts it
        in a slot when a sequence needs it."""
        if self.lora is None:
            raise ValueError("this runner has no adapter slots (max_loras = 0)")
        self.lora.add(adapter)

    def drop_adapter(self, name: str) -> None:
        if self.lora is not None:
            self.lora.drop(name)

    @property
    def _lora_arrays(self):
        """What the compiled steps take for the adapter slots (None: no LoRA code)."""
        return None if self.lora is None else self.lora.arrays

    # ----------------------------------------------------------------- limits and buckets
    @property
    def limits(self) -> StepLimits:
        max_pf = self.prefill_buckets[-1] if self.prefill_buckets else 0
        # Each chunk pads up to a multiple of block_q; keep the worst case inside the bucket.
        budget = max(0, max_pf - self.max_prefill_seqs * (self.block_q - 1))
        return StepLimits(
            max_decode_seqs=self.decode_buckets[-1] if self.decode_buckets else 0,
            max_prefill_seqs=self.max_prefill_seqs if max_pf else 0,
            max_prefill_chunk=budget,
            max_prefill_tokens=budget,
            shapes=tuple((b.dec_rows, b.pf_tokens) for b in self.programs.all),
            block_q=self.block_q,
        )

    def buckets(self) -> list[Bucket]:
        """Decode-only steps of each decode bucket, and each prefill bucket with each
        mixed decode size."""
        return ([Bucket(d, 0) for d in self.decode_buckets]
                + [Bucket(d, p) for d in self.mixed_decode_buckets for p in self.prefill_buckets])

    def _sample_rows(self, b: Bucket) -> int:
        return sample_rows(b, self.block_q, self.max_prefill_seqs)

    def describe(self) -> dict:
        return {
            "model": self.config.name,
            "dtype": self.dtype.name,
            "page_size": self.page_size,
            "num_pages": self.num_pages,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_cache_dtype": jnp.dtype(self.kv_dtype).name,
            "kv_cache_bytes": self.kv_bytes,
            "kv_capacity_tokens": (self.num_pages - 1) * self.page_size,
            "max_context": self.max_context,
            "buckets": len(self.programs.all),
            "buckets_ready": len(self.programs.ready),
            "feature_major": self.feature_major,
            "switched_mlp": self.switched_mlp,
            "unrolled_layers": self.unrolled_layers,
            "adapter_slots": self.adapter_slots,
            "adapter_slot_bytes": 0 if self.lora is None else self.lora.nbytes,
            "lora_kernel": None if self.lora is None else (
                "native" if self.lora.native else "stacked"),
            "quantization": self.quantization,
            "int8_weight_bytes": quantized_bytes(self.params),
            **self.attention.describe(),
        }

    # ------------------------------------------------------------------------ warming up
    def warmup(self, buckets: Iterable[Bucket] | None = None,
               progress: Callable[[str, int, int], None] | None = None) -> None:
        """Compile, and run once, the steps of `buckets` (None: every bucket) with their
        samplers, the page copy and the attention backend's own programs."""
        if self.mirror is not None:  # a follower lost meanwhile must not hang the start
            return self.mirror.watch(self._warmup, buckets, progress)
        self._warmup(buckets, progress)

    def _warmup(self, buckets, progress) -> None:
        self._warm_support()
        self.programs.compile(self.programs.all if buckets is None else buckets, progress)

    def warm_essential(self, prompt_lengths: Iterable[int] = (64,),
                       progress: Callable[[str, int, int], None] | None = None) -> None:
        """Just enough to serve (`Programs.essential`), plus the smallest shapes that hold
        the prefill chunks of prompts of `prompt_lengths` tokens (a first question; the
        one prompt of `sluice generate`)."""
        chunk, bq = self.limits.max_prefill_chunk, self.block_q
        needs = {Bucket(0, -(-c // bq) * bq) for n in prompt_lengths
                 for c in ([n] if n <= chunk else [chunk, n % chunk or chunk])}
        self.warmup(self.programs.essential(*sorted(needs)), progress)

    def warm_in_background(self, on_done: Callable[[], None] | None = None) -> None:
        """Compile every bucket not ready yet in a background thread."""
        self.programs.compile_in_background(on_done)

    @property
    def warmup_remaining(self) -> int:
        return self.programs.remaining

    def close(self) -> None:
        """Stop compiling in the background (after the shape being compiled now), and a
        multi-host replica's followers."""
        self.programs.close()
        self._ready.close()
        if self.mirror is not None:
            self.mirror.close()

    def _warm_support(self) -> None:
        with self._lock:
            self._dev_support()

    def _build(self, b: Bucket) -> None:
        """Compile bucket `b`'s step and samplers, then run each once on inputs that touch
        only the null page: XLA:CPU's first run of an executable costs 0.1-0.4 s extra,
        which otherwise lands in the first request to need it (docs/architecture.md)."""
        self._precompile(b)
        layout = self._dummy(b)
        rows = self._sample_rows(b)
        with self._lock:
            prev = self._prev_tokens  # a step in flight's tokens, which the next one reads
            self._dev_step(b, self._batch(layout, []))
            for kind in SAMPLERS:  # (both branches of the top-20's `cond` run once)
                for top in (False, True):
                    np.asarray(self._dev_sample(kind, rows,
                                                self._sampling_args(kind, rows, [], top)))
            self._prev_tokens = prev
        if not self.time_all_shapes and b.pf_tokens not in (0, max(self.prefill_buckets)):
            return
        # Once more, timed (the first run's extra cost is gone): the step-cost estimate
        # admission predicts from until real steps are measured. The model needs each
        # decode size's time and one prefill token's cost: the decode-only shapes and the
        # largest prefill bucket beside each mixed decode size are enough.
        with self._lock:
            prev = self._prev_tokens
            t0 = time.perf_counter()
            self._dev_step(b, self._batch(layout, []))
            np.asarray(self._dev_sample("greedy", rows,
                                        self._sampling_args("greedy", rows, [])))
            self.warmup_times.append((b.dec_rows, b.pf_tokens, time.perf_counter() - t0))
            self._prev_tokens = prev

    def _precompile(self, b: Bucket) -> None:
        """Bucket `b`'s step and samplers compiled (nothing runs)."""
        self._program(b)
        for kind in SAMPLERS:
            self._sampler(kind, self._sample_rows(b))

    def precompile_in_background(self) -> None:
        """A multi-host follower's warm-up: compile every shape ahead of the leader's first
        call for it, without running anything (a follower launches only what the leader
        tells it to)."""
        order = [*self.programs.essential(), *self.programs.all]

        def run() -> None:
            try:
                for b in dict.fromkeys(order):
                    self._precompile(b)
            except Exception:  # noqa: BLE001 - compiled on demand instead
                log.exception("precompiling failed; shapes compile when first called")

        threading.Thread(target=run, name="sluice-precompile", daemon=True).start()

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

    # ----------------------------------------------------------------- device calls
    # Every device program the runner launches goes through one of these, with host
    # arguments only: a multi-host replica's followers replay them in the same order
    # (model/multihost.py, `replay`). The caller holds the lock.
    def replay(self, name: str, args: tuple) -> None:
        """A follower's side of a mirrored device call."""
        with self._lock:
            getattr(self, name)(*args)

    @mirrored
    def _dev_support(self) -> None:
        if self._copy is None:
            self._copy = self._compile_copy()
            null = np.zeros(_COPY_BUCKET * self.config.num_layers, np.int32)
            self.kv = self._copy(self.kv, null, null)  # first run: page 0 onto itself
        self.attention.warmup(self.kv)
        if self.lora is not None:
            self.lora.compile()

    @mirrored
    def _dev_copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.kv = self._copy(self.kv, src, dst)

    @mirrored
    def _dev_step(self, b: Bucket, batch: StepBatch) -> tuple[Any, Any]:
        self.kv, logits, hidden = self._program(b)(self.params, self.kv, batch,
                                                   self.attention.state, self._lora_arrays,
                                                   self._prev_tokens)
        self._last = (logits, hidden)
        return self._last

    @mirrored
    def _dev_sample(self, kind: str, rows: int, args: tuple):
        packed, self._prev_tokens = self._sampler(kind, rows)(self._last[0], *args)
        return packed

    @mirrored
    def _dev_score(self, targets: np.ndarray):
        return self._scorer.run(self.params, self._last[1], targets)

    def _dummy(self, b: Bucket) -> StepLayout:
        return dummy_layout(b, block_q=self.block_q, pages_per_seq=self.pool.pages_per_seq,
                            n_samples=self._sample_rows(b),
                            context=min(2048, self.max_context - 1))

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

    def _sampling_args(self, kind: str, rows: int, samples: list[SeqChunk],
                       top: bool = False) -> tuple:
        top = np.bool_(top or sampling.wants_top(samples))
        if kind == "greedy":
            return (top,)
        hist = self.max_context if kind == "penalties" else 1
        return (sampling.sampling_batch(samples, rows, hist, self._rng,
                                        self.config.vocab_size), top)

    def _compile_copy(self) -> Callable:
        def copy(kv, src, dst):  # pool rows, every layer's
            return tuple(a.at[dst].set(a[src]) for a in kv)

        rows = self._spec(jax.ShapeDtypeStruct((_COPY_BUCKET * self.config.num_layers,),
                                               jnp.int32))
        return jax.jit(copy, donate_argnums=(0,)).lower(self._spec(self.kv), rows,
                                                          rows).compile()

    # --------------------------------------------------------------------------- a step
    @property
    def lost(self) -> str | None:
        """Why this multi-host replica can never step again (None: it can)."""
        return None if self.mirror is None else self.mirror.lost

    @property
    def can_overlap(self) -> bool:
        """Whether the engine may launch a step before collecting the one before (not on
        a multi-host replica: its followers step in lockstep, one step at a time)."""
        return self.mirror is None

    def step(self, plan: StepPlan, *, return_logits: bool = False) -> StepResult:
        if self.mirror is not None:  # a collective whose peer is gone may never return
            return self.mirror.watch(self._step, plan, return_logits)
        return self._step(plan, return_logits)

    def _step(self, plan: StepPlan, return_logits: bool) -> StepResult:
        with self._lock:
            return self._collect(self._launch(plan), return_logits)

    def launch(self, plan: StepPlan) -> Launched | StepResult:
        """Pack the plan and queue its programs; returns before they have run (a
        multi-host replica runs the whole step here). Its `pending` chunks take the
        tokens the step launched just before sampled."""
        if self.mirror is not None:
            return self.step(plan)
        with self._lock:
            return self._launch(plan)

    def collect(self, handle: Launched | StepResult) -> StepResult:
        """Wait for a launched step (in launch order) and read its result back."""
        return self._collect(handle)

    def _launch(self, plan: StepPlan) -> Launched | StepResult:
        t0 = time.perf_counter()
        if plan.copies:
            self._run_copies(plan.copies)
        for slot, name in plan.adapter_loads:
            self.lora.load(slot, name)
        if not plan.chunks:
            self._prev_rows = {}
            return StepResult(sampled={}, device_seconds=time.perf_counter() - t0)
        dec, pf, need = split(plan, self.limits.max_decode_seqs, self.block_q)
        if len(pf) > self.max_prefill_seqs:
            raise ValueError(f"{len(pf)} prefill chunks > {self.max_prefill_seqs=}")
        bucket = self.programs.pick(need)
        if bucket is None:
            raise RuntimeError(f"no compiled step holds {need} (decode rows, prefill "
                               f"tokens); ready: {self.programs.ready}")
        rows = self._sample_rows(bucket)
        layout = pack(dec, pf, bucket, page_size=self.page_size, block_q=self.block_q,
                      pages_per_seq=self.pool.pages_per_seq, n_samples=rows,
                      prev_rows=self._prev_rows)
        batch = self._batch(layout, plan.copies)
        t_dispatch = time.perf_counter()
        logits, _ = self._dev_step(bucket, batch)
        packed = scores = None
        if layout.samples:
            kind = sampling.kind_of(layout.samples)
            packed = self._dev_sample(kind, rows, self._sampling_args(kind, rows, layout.samples))
        if layout.scored:
            scores = self._dev_score(self._scorer.targets(layout.scored, sum(bucket)))
        self._prev_rows = {c.seq_id: r for r, c in enumerate(layout.samples)}
        ticket = self._ready.watch(logits if packed is None else packed)
        return Launched(layout, bucket, logits, packed, scores, ticket, t0, t_dispatch)

    def _collect(self, l: Launched | StepResult, return_logits: bool = False) -> StepResult:
        if isinstance(l, StepResult):
            return l
        wait = l.ticket.wait()  # also when nothing is sampled: the step has run
        layout, bucket = l.layout, l.bucket
        sampled, failed = ({}, {}) if l.packed is None else sampling.unpack(
            np.asarray(l.packed), layout.samples)  # the one device-to-host copy
        scores = {} if l.scores is None else self._scorer.unpack(layout.scored, l.scores)
        # The step's own time: from its launch, or from the end of the step before if it
        # was launched while that one ran (then its packing cost the computation nothing).
        prev, self._last_ready = self._last_ready, l.ticket.at
        begin = max(l.t0, prev)
        result = StepResult(sampled=sampled, padded_tokens=sum(bucket),
                            real_tokens=layout.real_tokens,
                            device_seconds=l.ticket.at - begin,
                            shape=(bucket.dec_rows, bucket.pf_tokens),
                            host_seconds=max(0.0, l.t_dispatch - begin),
                            prompt_logprobs=scores, failed=failed,
                            idle_seconds=max(0.0, l.t_dispatch - prev) if prev else 0.0,
                            wait_seconds=wait)
        if return_logits:
            host = np.asarray(l.logits)
            result.logits = {c.seq_id: host[r] for r, c in enumerate(layout.samples)}
        return result

    def _batch(self, layout: StepLayout, copies: list[tuple[int, int]]) -> StepBatch:
        dec, pf = self.attention.prepare(self.kv, (layout.decode, layout.prefill),
                                         layout.slots, copies)
        return StepBatch(tokens=layout.tokens, positions=layout.positions, slots=layout.slots,
                         sample_idx=layout.sample_idx, decode=dec, prefill=pf,
                         prev_src=layout.prev_src,
                         lora_slots=None if self.lora is None else layout.lora_slots)

    def _run_copies(self, copies: list[tuple[int, int]]) -> None:
        layers = np.arange(self.config.num_layers, dtype=np.int32)[:, None] * self.num_pages
        for i in range(0, len(copies), _COPY_BUCKET):
            part = np.zeros((2, _COPY_BUCKET), np.int32)  # unused entries: page 0 onto 0
            part[:, :len(copies[i:i + _COPY_BUCKET])] = np.asarray(
                copies[i:i + _COPY_BUCKET], np.int32).T
            src, dst = ((layers + p[None, :]).reshape(-1) for p in part)
            self._dev_copy(src, dst)
