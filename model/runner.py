"""The model runner: a `StepPlan` in, one sampled token per sequence out, with a single
device-to-host copy per step.

Shapes are fixed by buckets (`packing.Bucket`: decode rows x prefill tokens), each
compiled ahead of time; a step runs in the smallest ready bucket that holds it and never
compiles. The KV pool is allocated once at construction and donated into every step, so
XLA updates it in place. Attention is the backend's business (`pallas_kernels`: one
object per backend behind one interface): the runner hands it each step's generic layout
and passes its metadata and state along.

The runner owns the device state (KV pool, adapter slots, the weights in their format,
their placement, the compiled programs) and every device call, under one lock. Its jobs
live in one file each:

- model/runner.py (here): construction, and a step: `launch` (assemble, queue the
  programs) then `collect` (wait, read back), the halves overlapped scheduling runs
  apart; the device calls (`_dev_*`);
- model/assembly.py: step assembly, a plan's chunks as a bucket's inputs;
- model/compiling.py: the compiled programs and the compilation cache;
- model/warmup.py: warm-up (compile and run each shape once, some timed);
- model/formats.py: the weights' and the KV pool's formats;
- model/adapter_slots.py: LoRA adapters in device slots;
- model/programs.py: which buckets exist and are ready.

Given `devices`, the runner lives on them: one device, or N with tensor parallelism
(model/tp.py): weights and the KV pool are sharded over a 1-D mesh, and every compiled
step is one SPMD program whose logits are replicated, so sampling and everything after
it is unchanged. Every device program goes through one of the `_dev_*` calls, whose
arguments are host data: a multi-host replica's process 0 sends each one to the other
processes first (`mirror`, model/multihost.py), so they run the same programs in the
same order.

(About 600 lines: the device state's construction, its formats, shapes and placement settled
in one place, and every device call beside the lock that guards it.)
"""

from __future__ import annotations

import dataclasses
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
from scheduler.protocol import StepPlan, StepResult

from . import sampling
from .adapter_slots import LoraSlots, native_available as native_lora_available
from .assembly import StepAssembly
from .base import resolve_dtype
from .compiling import COPY_BUCKET, Compiling, enable_compilation_cache
from .config import ModelConfig
from .formats import kv_format, weight_format, weight_layout
from .inflight import Launched, ReadyTimes
from .kv_disk import DiskStore
from .kv_tiers import SWAP_BUCKET, TierStore, model_fingerprint
from .kv_transfer import ExportedPages
from .llama import StepBatch, prepare_params, rope_inv_freq
from .multihost import mirrored
from .packing import Bucket
from .programs import Programs
from .quant import NATIVE_WEIGHTS, quantized_bytes
from .scoring import PromptScorer
from .tp import TensorParallel
from .warmup import WarmUp

__all__ = ["ModelRunner", "enable_compilation_cache"]

log = logging.getLogger("sluice.runner")


class ModelRunner(StepAssembly, WarmUp, Compiling):
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
        kv_host_bytes: int = 0,
        kv_disk_dir: str | None = None,
        kv_disk_bytes: int = 0,
        window_pool: bool | int = True,
        kv_inbox: bool = False,  # a decode replica: prefilled pages come in (app/disagg.py)
        kv_transfers: bool = False,  # pages move between replicas (a prefill or decode pool)
    ) -> None:
        # Where it runs: None, JAX's default device; else these, tensor parallel over them.
        tp_n = len(devices) if devices else 1
        self.dtype = resolve_dtype(dtype)
        quantization = weight_format(quantization, self.dtype)
        self.tp = self.tensor_parallel(devices, quantization) if devices else None
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
        self._set_shapes(decode_buckets, prefill_buckets, mixed_decode_buckets,
                         max_prefill_seqs)

        self.quantization = quantization
        self.kv_dtype, self.kv_storage = kv_format(kv_cache_dtype, self.dtype, quantization,
                                                   attention, attention_options or {})
        row = row_elements(cfg.head_dim, self.kv_storage)
        self.kv_bytes_per_token = (2 * cfg.num_layers * cfg.num_kv_heads * row
                                   * np.dtype(self.kv_storage).itemsize)
        if num_pages is None:
            num_pages = max(2, kv_cache_bytes // (self.kv_bytes_per_token * page_size))
        # sliding layers (model/config.py): read through windowed tables, unless no
        # context is longer than the window
        window = (cfg.sliding_window if any(cfg.windowed)
                  and self.max_context > cfg.sliding_window else 0)
        if kv_inbox and not kv_host_bytes:
            # A decode replica takes prefilled pages through host slots: room for two
            # of the longest prompts at once (np.zeros: committed only as written).
            kv_host_bytes = (2 * -(-self.max_context // page_size) * page_size
                             * self.kv_bytes_per_token)
        self.num_pages, self.window_pool = self._size_pool(
            int(num_pages), window, False if kv_host_bytes or kv_inbox else window_pool)
        layer_bytes = page_size * self.kv_bytes_per_token // cfg.num_layers
        self.pool = PoolLayout(layers=cfg.num_layers, pages=self.num_pages,
                               page_size=page_size, kv_heads=cfg.num_kv_heads,
                               head_dim=cfg.head_dim, dtype=self.kv_storage,
                               pages_per_seq=-(-self.max_context // page_size),
                               window=window, window_queries=block_q,
                               sliding=tuple(cfg.windowed), window_pool=self.window_pool)
        self.kv_bytes = self.pool.rows * layer_bytes
        # Names the weights and page layout: disk tier files, transfers between replicas
        # (None: neither is used, or the weights are not all on this host: multi-host).
        self.kv_fingerprint: str | None = None
        if kv_disk_dir or kv_transfers:
            try:
                self.kv_fingerprint = self._fingerprint(params, quantization)
            except Exception:  # noqa: BLE001 - checked where it is needed
                if kv_disk_dir:
                    raise
        # The KV tiers below the pool (model/kv_tiers.py); None: evicted pages are dropped.
        self.kv_store = self._tier_store(params, quantization, kv_host_bytes, kv_disk_dir,
                                         kv_disk_bytes, kv_inbox) if kv_host_bytes else None
        self._swaps: tuple[Callable, Callable] | None = None
        # What one device computes (the whole model without tensor parallelism).
        self.local_config = self.tp.local_config(cfg) if self.tp else cfg
        self.kv = self._new_pool()
        self.attention = make_backend(
            attention, dataclasses.replace(self.pool, kv_heads=self.local_config.num_kv_heads),
            **(attention_options or {}))
        if tp_n > 1 and self.attention.state is not None:
            raise ValueError(f"attention backend {self.attention.name!r} keeps device state "
                             "across steps, which tensor parallelism does not shard")
        self.feature_major, self.switched_mlp, self.unrolled_layers = weight_layout(
            feature_major, switched_mlp, unrolled_layers, quantization)
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

    @staticmethod
    def tensor_parallel(devices: Sequence[Any], quantization: str,
                        dtype: str | None = None) -> TensorParallel:
        """The tensor parallelism a runner over `devices` uses for weights in
        `quantization` (with `dtype`: as a pool names them, resolved first): the native
        packed weights' blocks of 32 input values never straddle two devices."""
        if dtype is not None:
            quantization = weight_format(quantization, resolve_dtype(dtype))
        return TensorParallel(tuple(devices), in_multiple=(
            32 if quantization in NATIVE_WEIGHTS else 1))

    @classmethod
    def for_pool(cls, config: ModelConfig, params: dict, pool, *,
                 eos_token_ids: Iterable[int] = (),
                 devices: Sequence[Any] | None = None,
                 replica: int | None = None) -> "ModelRunner":
        """A runner shaped by a pool's settings (`config.settings.PoolConfig`), on
        `devices` (None: JAX's default device). Replica i of several keeps its disk
        tier in `kv_disk_dir/replica-i` (each its own files and `kv_disk_bytes`).

        Under an ITL target every decode bucket from the smallest mixed one up is also
        compiled beside the prompt chunks: the running set's size then follows from the
        step times, and a step of d decodes runs in the smallest shape that holds d, so
        with mixed shapes at 4 and 16 only, 5-16 streams cost what 16 do and a target
        that 16 just miss holds 4 (measured: docs/history/benchmarks-log.md, "Issue 16: a door that
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
                   devices=devices, kv_host_bytes=pool.kv_host_bytes,
                   kv_disk_dir=pool.kv_disk_dir and os.path.join(
                       os.path.expanduser(pool.kv_disk_dir),
                       *([f"replica-{replica}"] if replica is not None else [])),
                   kv_disk_bytes=pool.kv_disk_bytes,
                   window_pool=pool.window_pages and pool.role == "both",
                   kv_inbox=pool.role == "decode", kv_transfers=pool.role != "both")

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

    def _size_pool(self, pages: int, window: int, own: bool | int) -> tuple[int, int]:
        """(pages of each global layer, pages of each sliding layer; 0: the same pages)
        for the memory of `pages` pages in every layer. Sliding layers get pages of their
        own where that leaves the global layers more (scheduler/window_pages.py): as many
        as the most sequences a step decodes can hold at once within their windows
        (`StepLimits.window_pages_per_seq`), and a quarter more for the prefix cache's
        window tails. Not with the KV tiers (whose pages hold every layer). `own`: an
        int, that many sliding pages beside `pages` global ones (tests); False: none."""
        cfg = self.config
        sliding = sum(cfg.windowed)
        if own is False or not (window and 0 < sliding < cfg.num_layers):
            return pages, 0
        if own is not True:
            return pages, int(own)
        limits = self._step_limits(window=window)
        per_seq = limits.window_pages_per_seq(self.page_size)
        own = max(limits.max_decode_seqs, 1) * per_seq * 5 // 4 + 1
        rows = pages * cfg.num_layers
        glob = (rows - sliding * own) // (cfg.num_layers - sliding)
        if glob <= pages:  # a small pool: the window saves nothing
            return pages, 0
        return glob, own

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
            "window_pool_pages": self.window_pool,
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

    @property
    def page_shape(self) -> tuple[int, ...]:
        """One page of every layer as the KV tiers and transfers hold it: (K/V, layer,
        position, kv head, row)."""
        cfg = self.config
        return (2, cfg.num_layers, self.page_size, cfg.num_kv_heads,
                row_elements(cfg.head_dim, self.kv_storage))

    def _fingerprint(self, params: dict, quantization: str) -> str:
        """"These weights, this KV layout" (model/kv_tiers.model_fingerprint), from a few
        weights' first values, sliced where they live (an 8B model's embedding is not
        copied to the host for 64 numbers)."""
        leaves = [np.asarray(a.reshape(-1)[:64]) for _, a in
                  sorted(jax.tree_util.tree_leaves_with_path(params),
                         key=lambda kv: jax.tree_util.keystr(kv[0]))[:4]]
        return model_fingerprint(self.base_config, weights=quantization,
                                 kv_dtype=self.kv_storage, page_shape=self.page_shape,
                                 sample=leaves)

    def _tier_store(self, params: dict, quantization: str, host_bytes: int,
                    disk_dir: str | None, disk_bytes: int, inbox: bool) -> TierStore:
        page_shape = self.page_shape
        page_bytes = int(np.prod(page_shape)) * np.dtype(self.kv_storage).itemsize
        slots = host_bytes // page_bytes
        if slots < SWAP_BUCKET:
            raise ValueError(f"kv_host_bytes={host_bytes} holds {slots} pages of "
                             f"{page_bytes} bytes; at least {SWAP_BUCKET} are needed")
        disk = None
        if disk_dir:
            disk = DiskStore(disk_dir, capacity_bytes=disk_bytes,
                             fingerprint=self.kv_fingerprint,
                             page_shape=page_shape, page_dtype=self.kv_storage)
        return TierStore(slots, page_shape, self.kv_storage, disk=disk, inbox=inbox)

    def export_pages(self, pages: list[int]) -> ExportedPages:
        """Copy pool pages out for another replica (disaggregated prefill: scheduler/
        protocol.py `Runner`): the swap programs' gathers, queued now."""
        parts = []
        with self._lock:
            for i in range(0, len(pages), SWAP_BUCKET):
                part = pages[i:i + SWAP_BUCKET]
                k, v = self._dev_swap_out(self._page_rows(part))
                parts.append((k, v, len(part)))
        return ExportedPages(parts, self.page_shape, self.kv_storage)

    # ------------------------------------------------------------------------ warming up

    def close(self) -> None:
        """Stop compiling in the background (after the shape being compiled now), and a
        multi-host replica's followers; the KV tiers' disk writes are finished."""
        if self.kv_store is not None:
            self.kv_store.close()
        self.programs.close()
        self._ready.close()
        if self.mirror is not None:
            self.mirror.close()

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
            null = np.zeros(COPY_BUCKET * self.config.num_layers, np.int32)
            self.kv = self._copy(self.kv, null, null)  # first run: page 0 onto itself
        self.attention.warmup(self.kv)
        if self.lora is not None:
            self.lora.compile()

    @mirrored
    def _dev_copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.kv = self._copy(self.kv, src, dst)

    @mirrored
    def _dev_swap_out(self, rows: np.ndarray) -> tuple[Any, Any]:
        return self._swap_programs()[0](self.kv, rows)

    @mirrored
    def _dev_swap_in(self, rows: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        self.kv = self._swap_programs()[1](self.kv, rows, k, v)

    def _swap_programs(self) -> tuple[Callable, Callable]:
        if self._swaps is None:
            self._swaps = self._compile_swaps()
        return self._swaps

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
        swap_s = 0.0
        if plan.swap_out or plan.swap_in or plan.imports:
            swap_s = self._run_swaps(plan)
        if plan.copies:
            self._run_copies(plan.copies)
        if plan.window_copies:
            self._run_copies(plan.window_copies, window=True)
        for slot, name in plan.adapter_loads:
            self.lora.load(slot, name)
        if not plan.chunks:
            self._prev_rows = {}
            if self.kv_store is not None:
                self.kv_store.settle()
            return StepResult(sampled={}, device_seconds=time.perf_counter() - t0,
                              swap_in_seconds=swap_s)
        bucket, rows, layout, batch = self._assemble(plan)
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
        return Launched(layout, bucket, logits, packed, scores, ticket, t0, t_dispatch,
                        swap_mark=self.kv_store.mark if self.kv_store is not None else 0,
                        swap_in_s=swap_s)

    def _collect(self, l: Launched | StepResult, return_logits: bool = False) -> StepResult:
        if isinstance(l, StepResult):
            return l
        wait = l.ticket.wait()  # also when nothing is sampled: the step has run
        if self.kv_store is not None:  # the copies down queued before it have run too
            self.kv_store.settle(upto=l.swap_mark)
        layout, bucket = l.layout, l.bucket
        sampled, failed, drafted = ({}, {}, {}) if l.packed is None else sampling.unpack(
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
                            wait_seconds=wait, swap_in_seconds=l.swap_in_s,
                            drafted=drafted)
        if return_logits:
            host = np.asarray(l.logits)
            result.logits = {c.seq_id: host[r] for r, c in enumerate(layout.samples)}
        return result

    def _run_swaps(self, plan: StepPlan) -> float:
        """The KV tiers' copies, down then up (model/kv_tiers.py), before the copies and
        chunks of the step: a page copied down may be the target of one copied up.
        Returns the seconds the copies up took (host work and handing them over; on a GPU
        the transfer itself runs on in stream order)."""
        store = self.kv_store
        for i in range(0, len(plan.swap_out), SWAP_BUCKET):
            part = plan.swap_out[i:i + SWAP_BUCKET]
            k, v = self._dev_swap_out(self._page_rows([p for p, _, _, _ in part]))
            store.queued([s for _, s, _, _ in part], k, v, [(key, meta) for _, _, key, meta in part])
        for pages, data in plan.imports:  # another replica's pages, moved onto this pool's
            self._import(pages, data)     # devices (after the copies down that free them)
        t0 = time.perf_counter()
        for i in range(0, len(plan.swap_in), SWAP_BUCKET):
            part = plan.swap_in[i:i + SWAP_BUCKET]
            k, v = store.gather([s for s, _ in part])
            self._dev_swap_in(self._page_rows([p for _, p in part]), k, v)
        return time.perf_counter() - t0 if plan.swap_in else 0.0

    def save_pages(self, entries: list[tuple[int, int, tuple]]) -> int:
        """Write device pages, each (page, key, meta), to the disk tier and wait for the
        writes (a server stopping keeps its cached prefixes for the next start); returns
        how many were offered. Nothing may be running on the pool."""
        store = self.kv_store
        if store is None or store.disk is None or not entries:
            return 0
        data = self.export_pages([p for p, _, _ in entries])
        for i, (k, v, n) in zip(range(0, len(entries), SWAP_BUCKET), data.parts):
            store.persist(k, v, [(key, meta) for _, key, meta in entries[i:i + n]])
        store.disk.flush(timeout=60.0)
        return len(entries)

    def _import(self, pages: list[int], data: ExportedPages) -> None:
        """An `export_pages` result of another runner into `pages` of this pool: each
        gather's output put onto this pool's sharding (`jax.device_put`: a device-to-
        device copy where the two replicas' devices differ, none where they are the
        same) and scattered in by the copy-up program, in stream order."""
        sharding = self.kv[0].sharding
        j = 0
        for k, v, n in data.parts:
            k, v = jax.device_put((k, v), sharding)
            self._dev_swap_in(self._page_rows(pages[j:j + n]), k, v)
            j += n

    def _page_rows(self, pages: list[int]) -> np.ndarray:
        """Pool rows of `pages` in every layer, layer-major, padded to `SWAP_BUCKET` pages
        with the null page 0."""
        padded = np.zeros(SWAP_BUCKET, np.int32)
        padded[:len(pages)] = pages
        layers = np.arange(self.config.num_layers, dtype=np.int32)[:, None] * self.num_pages
        return (layers + padded[None, :]).reshape(-1)

    def _run_copies(self, copies: list[tuple[int, int]], window: bool = False) -> None:
        for src, dst in self._copy_rows(copies, window):
            self._dev_copy(src, dst)
