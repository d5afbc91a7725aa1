"""The native kernels' portable build (no AVX-512: a CI machine may be one) and the
build for this CPU without the AMX tile unit (the AVX-512 paths where the default build
takes AMX), registered beside the default build under `<target>_portable` and
`<target>_noamx` names."""

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


@pytest.fixture(scope="session")
def portable():
    return _register(("-O2", "-std=c++17", "-shared", "-fPIC", "-w", "-march=x86-64"),
                     "_portable")


@pytest.fixture(scope="session")
def noamx():
    return _register((*native.FLAGS, "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"),
                     "_noamx")
