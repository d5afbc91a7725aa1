"""The native kernels' builds without AVX-512 (a CI machine, or a user's, may be one):
the portable loops and the AVX2 paths; and the build for this CPU without the AMX tile
unit (the AVX-512 paths where the default build takes AMX), registered beside the
default build under `<target>_x86_64`, `<target>_haswell` and `<target>_noamx` names."""

from __future__ import annotations

import ctypes

import jax
import pytest

from pallas_kernels import native


def _register(flags: tuple[str, ...], suffix: str) -> dict[str, str]:
    try:
        lib = ctypes.cdll.LoadLibrary(str(native.build(flags)))
    except native.NativeUnavailable as e:
        pytest.skip(str(e))
    names = {}
    for target, symbol in ((native.ATTENTION_TARGET, lib.SluiceDecodeAttention),
                           (native.PREFILL_TARGET, lib.SluicePrefillAttention),
                           (native.PREFIX_TARGET, lib.SluicePrefixAttention),
                           (native.LORA_TARGET, lib.SluiceLoraDelta)):
        names[target] = target + suffix
        jax.ffi.register_ffi_target(names[target], jax.ffi.pycapsule(symbol), platform="cpu")
    return names


def _has_avx2() -> bool:
    flags = native._cpu_flags().split()
    return "avx2" in flags and "fma" in flags


@pytest.fixture(scope="session", params=["x86-64", "haswell"])
def portable(request):
    """Each build without AVX-512: the portable loops (`x86-64`) and the AVX2 paths
    (`haswell`: AVX2 + FMA, the CPUs before AVX-512), where this CPU runs them."""
    arch = request.param
    if arch == "haswell" and not _has_avx2():
        pytest.skip("this CPU has no AVX2")
    return _register(("-O2", "-std=c++17", "-shared", "-fPIC", "-w", f"-march={arch}"),
                     f"_{arch.replace('-', '_')}")


@pytest.fixture(scope="session")
def noamx():
    return _register((*native.FLAGS, "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"),
                     "_noamx")
