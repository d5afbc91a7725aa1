"""The CPU backend's native kernels (`csrc/`): built, loaded and registered with XLA here,
called through `q8_linear` (the int8-weight matmul, model/quant.py), `q4_linear` (Q4_1
weights times int8 activations, model/quant.py), `lora_delta` (each
token's own LoRA adapter, model/adapter_slots.py) and
`decode_attention` (each decode row's own pages), `prefix_attention` (a prefix decode rows
share, read once for all of them) and `prefill_attention` (prefill blocks), the CPU
backend's attention (pallas_kernels/cpu.py).

They are compiled on this machine the first time a runner asks for them (~18 s with g++
on 2 cores, the sources side by side;
`make install` builds it ahead, `python -m cpu_kernels.native`), for this CPU
(`-march=native`: AMX tiles where the CPU has them and the OS grants them, the AVX-512
path where the CPU has AVX-512 BF16, AVX2 + FMA forms on CPUs without AVX-512, a
portable loop otherwise), and kept in `$SLUICE_CACHE/native/` (default ~/.cache/sluice)
under a key of the source, the compiler, the flags, jaxlib's version and the CPU's
feature flags, so a changed source, toolchain or machine builds anew and nothing stale is
ever loaded. The
FFI targets are registered once per process (`sluice_q8_linear`, `sluice_q4_linear`,
`sluice_decode_attention`, `sluice_prefix_attention`, `sluice_prefill_attention`,
`sluice_lora_delta`).

Why native code at all: see each kernel's header and docs/benchmarks.md ("int8 weights")
and docs/history/benchmarks-log.md.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "q8_linear.cc", CSRC / "q4_linear.cc", CSRC / "decode_attention.cc",
           CSRC / "lane_attention.cc", CSRC / "lora_delta.cc")
TARGET = "sluice_q8_linear"
Q4_TARGET = "sluice_q4_linear"
ATTENTION_TARGET = "sluice_decode_attention"
PREFILL_TARGET = "sluice_prefill_attention"
PREFIX_TARGET = "sluice_prefix_attention"
LORA_TARGET = "sluice_lora_delta"
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-march=native", "-w")


class NativeUnavailable(RuntimeError):
    """The native kernel could not be built or loaded here (the message says why)."""


def _cache_dir() -> Path:
    root = os.environ.get("SLUICE_CACHE", os.path.expanduser("~/.cache/sluice"))
    return Path(root) / "native"


def _compiler() -> str:
    for cand in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cand and shutil.which(cand):
            return cand
    raise NativeUnavailable("no C++ compiler found (set CXX, or install g++)")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _library_path(cxx: str, flags: tuple[str, ...]) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([
        *(p.read_text() for p in sorted(CSRC.iterdir())), cxx, version, " ".join(flags),
        importlib.metadata.version("jaxlib"), _cpu_flags(),
    ]).encode()).hexdigest()[:16]
    return _cache_dir() / f"libsluice_q8_{key}.so"


def build(flags: tuple[str, ...] = FLAGS, verbose: bool = False) -> Path:
    """The kernel's shared library, compiled now unless an identical build is cached
    (`flags`: the compiler's; tests build the portable path with `-march=x86-64`).
    The sources compile as separate objects, as many at once as there are CPUs (26 s
    serially on a 2-core machine, the first serve's longest wait after the download),
    then link. Concurrent builders each write their own files and rename the library
    into place."""
    cxx = _compiler()
    lib = _library_path(cxx, flags)
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    with tempfile.TemporaryDirectory(dir=lib.parent) as objdir:
        compiles = [[cxx, *flags, "-c", "-I", jax.ffi.include_dir(), str(src), "-o",
                     os.path.join(objdir, f"{src.stem}.o")]
                    for src in sorted(SOURCES, key=lambda p: -p.stat().st_size)]
        link = [cxx, *flags, *(c[-1] for c in compiles), "-o", tmp]
        failed = _run_all(compiles, os.cpu_count() or 1, verbose) or _run_all([link], 1, verbose)
    if failed:
        os.unlink(tmp)
        raise NativeUnavailable(f"building the native kernels failed ({cxx}):\n{failed}")
    os.replace(tmp, lib)
    return lib


def _run_all(cmds: list[list[str]], jobs: int, verbose: bool) -> str:
    """Run the commands, up to `jobs` at once; the first failure's stderr (tail), or ""."""
    running: list[subprocess.Popen] = []
    failed = ""
    for cmd in [*cmds, None]:
        while running and (cmd is None or len(running) >= jobs):
            proc = running.pop(0)
            _, err = proc.communicate()
            if proc.returncode != 0 and not failed:
                failed = err[-2000:] or f"exit status {proc.returncode}"
        if cmd is not None and not failed:
            if verbose:
                print(" ".join(cmd), file=sys.stderr)
            running.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE, text=True))
    return failed


@functools.cache
def load() -> ctypes.CDLL:
    """Build if needed, load, and register the FFI target (once per process)."""
    if jax.default_backend() != "cpu":
        raise NativeUnavailable(f"the native kernel is for the CPU backend, not "
                                f"{jax.default_backend()!r}")
    lib = ctypes.cdll.LoadLibrary(str(build()))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.SluiceQ8Linear), platform="cpu")
    for target, symbol in ((Q4_TARGET, lib.SluiceQ4Linear),
                           (ATTENTION_TARGET, lib.SluiceDecodeAttention),
                           (PREFILL_TARGET, lib.SluicePrefillAttention),
                           (PREFIX_TARGET, lib.SluicePrefixAttention),
                           (LORA_TARGET, lib.SluiceLoraDelta)):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
    return lib


@functools.cache
def available() -> tuple[bool, str]:
    """(True, "amx" | "avx512" | "avx2" | "portable") once loaded, else (False, why not);
    asked once per process (a failing build is not retried by every runner and backend).
    "portable" (x86 without AVX2) computes the right numbers one product at a time: too
    slow to serve by default (`fast()`)."""
    try:
        lib = load()
    except (NativeUnavailable, OSError) as e:
        return False, str(e)
    return True, ("amx" if lib.sluice_q8_amx() else
                  "avx512" if lib.sluice_q8_avx512() else
                  "avx2" if lib.sluice_q8_avx2() else "portable")


def lane_width() -> int:
    """Lanes a vector of the lane walk (csrc/lane_attention.cc) holds in this build: 16
    (AVX-512), 8 (AVX2), 1 (portable); 0 where the kernels are unavailable."""
    return load().sluice_lane_width() if available()[0] else 0


def int8_dots() -> bool:
    """Whether this build's attention walks score an int8 pool's keys with int8 dots
    (AVX-512 VNNI; csrc/lane_attention.cc, `walk_vnni`)."""
    return bool(load().sluice_lane_int8_dots(-1)) if available()[0] else False


def fast() -> tuple[bool, str]:
    """(True, kind) where the native kernels beat XLA:CPU's f32 (AMX, AVX-512, AVX2), else
    (False, why): what "auto" settings ask before choosing int8 weights and a bf16 pool.
    The portable build is 6-45x slower than f32 (docs/benchmarks.md, "CPUs without AVX-512")."""
    ok, what = available()
    if ok and what == "portable":
        return False, "the native kernels' portable build (this CPU has no AVX2) is slower " \
                      "than f32"
    return ok, what


def q8_linear(x, q, scale, layer, *, feature_major: bool, n: int | None = None,
              layout: int = 0, target: str = TARGET):
    """x times layer `layer` of the packed int8 weights (`model/quant.py`, Int8Matrix):
    x [K, T] -> [N, T] if `feature_major`, else [T, K] -> [T, N]; f32. `n`: the matrix's
    columns, when fewer than the packed ones; `layout`: its blocks' order (1 only for
    the AVX2 path). (`target`: another registered build of the same kernel, for tests.)"""
    if target == TARGET:
        load()
    n = n or q.shape[1]
    t = x.shape[1] if feature_major else x.shape[0]
    out = jax.ShapeDtypeStruct((n, t) if feature_major else (t, n), jnp.float32)
    return jax.ffi.ffi_call(target, out)(
        x.astype(jnp.float32), q, scale, jnp.asarray(layer, jnp.int32),
        feature_major=np.int32(feature_major), layout=np.int32(layout))


def q4_linear(x, w, layer, *, feature_major: bool, n: int | None = None, format: int = 0,
              target: str = Q4_TARGET):
    """x times layer `layer` of weights in llama.cpp's blocks packed by model/quant.py
    (`BlockMatrix`, w uint8 [L, N/8, K/32, bytes]; `format` 0 Q4_1, 1 Q8_0), x quantized
    to int8 per row and block of 32 by the kernel (csrc/q4_linear.cc): x [K, T] -> [N, T]
    if `feature_major`, else [T, K] -> [T, N]; f32. `n`: the matrix's columns, when fewer
    than the packed ones."""
    if target == Q4_TARGET:
        load()
    n = n or w.shape[1] * 8
    t = x.shape[1] if feature_major else x.shape[0]
    out = jax.ShapeDtypeStruct((n, t) if feature_major else (t, n), jnp.float32)
    return jax.ffi.ffi_call(target, out)(
        x.astype(jnp.float32), w, jnp.asarray(layer, jnp.int32),
        feature_major=np.int32(feature_major), format=np.int32(format))


def lora_delta(y, x, a, b, slots, layer, bounds, *, feature_major: bool,
               target: str = LORA_TARGET):
    """y plus each token's own LoRA delta, B[slot] @ (A[slot] @ x), for one fused
    projection (y aliased to the result: added in place): y [N, T] and x [K, T] if
    `feature_major`, else [T, N] and [T, K]; a [L, J, S, R, K] and b [L, S, NB, R, 16],
    f32 or bf16; slots [T] (< 0: none); layer []; bounds [J + 1] the targets' columns in N
    (csrc/lora_delta.cc has the layouts; `pack_lora_b` makes b's)."""
    if target == LORA_TARGET:
        load()
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(y.shape, jnp.float32),
                            input_output_aliases={0: 0})(
        y.astype(jnp.float32), x.astype(jnp.float32), a, b, i32(slots), i32(layer),
        i32(bounds), feature_major=np.int32(feature_major))


LORA_BLOCK = 16  # output columns of a packed B block


def pack_lora_b(bs) -> np.ndarray:
    """The LoRA kernel's B of one fused group from each target's [..., R, out_j] (numpy):
    [..., NB, R, 16], target j's columns in blocks of 16 (the last one zero-padded),
    the targets' blocks one after another."""
    blocks = []
    for bj in bs:
        bj = np.asarray(bj)
        pad = -bj.shape[-1] % LORA_BLOCK
        if pad:
            bj = np.concatenate([bj, np.zeros((*bj.shape[:-1], pad), bj.dtype)], -1)
        bj = bj.reshape(*bj.shape[:-1], -1, LORA_BLOCK)  # [..., R, nb, 16]
        blocks.append(np.swapaxes(bj, -3, -2))  # [..., nb, R, 16]
    return np.ascontiguousarray(np.concatenate(blocks, axis=-3))


def _attention_call(target: str, ours: str, out, q, k_pool, v_pool, ints, rest=()):
    """The attention kernels' calling convention: `target` called for `out` on q as f32,
    the pools as they are, each of `ints` as int32, then `rest` as it is. The library is
    loaded first when `target` is `ours` (tests register other builds themselves)."""
    if target == ours:
        load()
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return jax.ffi.ffi_call(target, out)(
        q.astype(jnp.float32), k_pool, v_pool, *(i32(a) for a in ints), *rest)


def decode_attention(q, k_pool, v_pool, page_offset, tables, start, ctx, m, l, acc, *,
                     target: str = ATTENTION_TARGET):
    """One query per row over the keys [start, ctx) of its pages, merged into the partial
    softmax (m, l, acc) of its shared prefix; q [S, KVH, G, D] pre-scaled; returns the
    normalized output [S, KVH, G, D] f32 (csrc/decode_attention.cc has the layouts)."""
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return _attention_call(target, ATTENTION_TARGET, out, q, k_pool, v_pool,
                           (page_offset, tables, start, ctx), (m, l, acc))


def prefix_attention(q, k_pool, v_pool, page_offset, pages, length, rows, *,
                     target: str = PREFIX_TARGET):
    """Each decode row's partial softmax over its shared prefix: q [S, KVH, G, D]
    pre-scaled, `pages` [NP, W] and `length` [NP] the prefixes, `rows` [S] 1 + each row's
    prefix (0: none) -> (m, l [S, KVH, G], acc [S, KVH, G, D]) f32, for
    `decode_attention` to continue (csrc/lane_attention.cc has the layouts)."""
    s, kvh, g, d = q.shape
    f32 = jnp.float32
    out = (jax.ShapeDtypeStruct((s, kvh, g), f32), jax.ShapeDtypeStruct((s, kvh, g), f32),
           jax.ShapeDtypeStruct((s, kvh, g, d), f32))
    return _attention_call(target, PREFIX_TARGET, out, q, k_pool, v_pool,
                           (page_offset, pages, length, rows))


def prefill_attention(q, k_pool, v_pool, page_offset, tables, ctx, qlen, *,
                      target: str = PREFILL_TARGET):
    """Causal attention of prefill blocks: q [S, NQ, KVH, G, D] pre-scaled, row r's query
    i at position ctx[r] - qlen[r] + i over keys [0, it] of its pages -> [S, NQ, KVH, G,
    D] f32, zeros past qlen (csrc/lane_attention.cc)."""
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return _attention_call(target, PREFILL_TARGET, out, q, k_pool, v_pool,
                           (page_offset, tables, ctx, qlen))


if __name__ == "__main__":  # make install: build ahead of the first serve
    ok, what = available()
    print(f"sluice native kernel: {what}" if ok else f"sluice native kernel unavailable: {what}")
