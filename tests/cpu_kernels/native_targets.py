"""The native kernels' targets (cpu_kernels/csrc/), each built for the x86 CPUs it
serves, so that the suite tests every path on whatever machine it lands on and skips, with
the reason, only the ones this CPU cannot run:

- portable:     `-march=x86-64`, any x86 (no AVX2: scalar loops, slower than XLA's f32);
- avx2:         `-march=haswell`, AVX2 + FMA (Zen 2/3, Intel before Skylake-SP);
- avx512:       `-march=skylake-avx512`, AVX-512 without BF16 or VNNI (Skylake-SP, Cascade
                and Ice Lake): AVX-512 attention, the int8 matmul on its AVX2 path;
- avx512-bf16:  this CPU's own flags without the AMX tile unit (Zen 4/5, Cooper Lake,
                Sapphire Rapids with AMX switched off): the bf16-dot matmul;
- amx:          `-march=native` where the CPU has AMX and the OS grants its tile state.

`build(name)` compiles (cached by native.build under the flags' key) and registers each
FFI target under `<target>_<name>`; tests/conftest.py prints which targets this machine
exercises in the report header."""

from __future__ import annotations

import ctypes
import functools

import jax
import pytest

from cpu_kernels import native

TARGETS = ("portable", "avx2", "avx512", "avx512-bf16", "amx")
_BASE = ("-O2", "-std=c++17", "-shared", "-fPIC", "-w")
_NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
# What each target needs of the CPU (/proc/cpuinfo's names).
_NEEDS = {
    "portable": (),
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"),
    "avx512-bf16": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
    "amx": ("amx_tile", "amx_bf16", "amx_int8"),
}
# The int8 matmul's block order each target packs (model/quant.py `native_layout`) and
# the orders it reads: the AVX2 path (avx2, and avx512 without BF16) packs [32 k][16
# columns]; the bf16-dot paths read [16 columns][32 k] only; the portable loop reads both.
PACKS = {"portable": 0, "avx2": 1, "avx512": 1, "avx512-bf16": 0, "amx": 0}
READS = {"portable": [0, 1], "avx2": [0, 1], "avx512": [0, 1], "avx512-bf16": [0],
         "amx": [0]}
SYMBOLS = {native.TARGET: "SluiceQ8Linear", native.Q4_TARGET: "SluiceQ4Linear",
           native.ATTENTION_TARGET: "SluiceDecodeAttention",
           native.PREFILL_TARGET: "SluicePrefillAttention",
           native.PREFIX_TARGET: "SluicePrefixAttention",
           native.LORA_TARGET: "SluiceLoraDelta"}


def _cpu() -> set[str]:
    return set(native._cpu_flags().split())


def flags(name: str) -> tuple[str, ...]:
    if name == "portable":
        return (*_BASE, "-march=x86-64")
    if name == "avx2":
        return (*_BASE, "-march=haswell")
    if name == "avx512":
        return (*_BASE, "-march=skylake-avx512")
    if name == "avx512-bf16":  # the default build where the CPU has no AMX (no new build)
        return (*native.FLAGS, *_NO_AMX) if "amx_tile" in _cpu() else native.FLAGS
    return native.FLAGS  # amx, and "default": the build a server loads


def why_not(name: str) -> str:
    """Why this machine cannot run target `name` ("" where it can, as far as the CPU's
    flags tell: AMX also needs the OS's grant, asked once built)."""
    if native._cpu_flags() == "":
        return "no /proc/cpuinfo (not Linux on x86)"
    missing = [f for f in _NEEDS[name] if f not in _cpu()]
    return f"this CPU lacks {', '.join(missing)}" if missing else ""


def runnable() -> list[str]:
    return [t for t in TARGETS if not why_not(t)]


class Build:
    """One target's library, its FFI targets registered under `names[target]`."""

    def __init__(self, name: str, lib: ctypes.CDLL) -> None:
        self.name, self.lib = name, lib
        suffix = "_" + name.replace("-", "_")
        self.names = {}
        for target, symbol in SYMBOLS.items():
            self.names[target] = target + suffix
            jax.ffi.register_ffi_target(self.names[target],
                                        jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")

    def __getitem__(self, target: str) -> str:
        return self.names[target]

    @property
    def q8_layout(self) -> int:
        return self.lib.sluice_q8_layout()

    def reads_layout(self, layout: int) -> bool:
        return bool(self.lib.sluice_q8_reads_layout(layout))

    @property
    def int8_dots(self) -> bool:
        """Its attention walks score an int8 pool's keys with int8 dots (AVX-512 VNNI:
        the queries rounded to int8 in blocks of 32)."""
        return bool(self.lib.sluice_lane_int8_dots(-1))

    @property
    def q8_rounds_to_bf16(self) -> bool:
        """The int8 matmul's dots are in bf16 (AVX-512 BF16, AMX, and the portable loop
        that matches them); the AVX2 path multiplies in f32."""
        return not self.lib.sluice_q8_avx2()


@functools.cache
def _build(name: str) -> Build:
    return Build(name, ctypes.cdll.LoadLibrary(str(native.build(flags(name)))))


def build(name: str) -> Build:
    """Target `name`'s build, or a skip saying why this machine cannot run it."""
    why = why_not(name)
    if why:
        pytest.skip(f"native target {name}: {why}")
    try:
        b = _build(name)
    except native.NativeUnavailable as e:
        pytest.skip(f"native target {name}: {e}")
    if name == "amx" and not b.lib.sluice_q8_amx():
        pytest.skip("native target amx: the OS does not grant the AMX tile state")
    return b


def without_amx() -> Build:
    """This CPU's own build without the AMX tile unit (the default build where the CPU
    has none): the exact paths that the AMX ones are held against."""
    try:
        return _build("avx512-bf16" if "amx_tile" in _cpu() else "default")
    except native.NativeUnavailable as e:
        pytest.skip(str(e))


def header() -> str:
    """The report header's line: the targets this CPU runs, and why not the others."""
    skipped = [f"{t} ({why_not(t)})" for t in TARGETS if why_not(t)]
    return ("native kernel targets exercised here: " + ", ".join(runnable())
            + ("; skipped: " + "; ".join(skipped) if skipped else ""))
