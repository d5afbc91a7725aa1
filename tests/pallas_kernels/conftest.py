"""The native kernels' portable build (no AVX-512: a CI machine may be one), registered
beside the default build under `<target>_portable` names."""

from __future__ import annotations

import ctypes

import jax
import pytest

from pallas_kernels import native


@pytest.fixture(scope="session")
def portable():
    try:
        lib = ctypes.cdll.LoadLibrary(str(native.build(
            ("-O2", "-std=c++17", "-shared", "-fPIC", "-w", "-march=x86-64"))))
    except native.NativeUnavailable as e:
        pytest.skip(str(e))
    names = {}
    for target, symbol in ((native.ATTENTION_TARGET, lib.SluiceDecodeAttention),
                           (native.PREFILL_TARGET, lib.SluicePrefillAttention),
                           (native.PREFIX_TARGET, lib.SluicePrefixAttention),
                           (native.LORA_TARGET, lib.SluiceLoraDelta)):
        names[target] = target + "_portable"
        jax.ffi.register_ffi_target(names[target], jax.ffi.pycapsule(symbol), platform="cpu")
    return names
