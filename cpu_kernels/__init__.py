"""The CPU's native kernels: C++ (`csrc/`) compiled on the machine that runs them and
called from JAX programs as XLA FFI custom calls (`native.py`: build, load, register, and
one Python entry point per kernel).

    q8_linear          int8 weights x f32 activations (model/quant.py)
    q4_linear          Q4_1 weights x int8 activations (model/quant.py)
    lora_delta         each token's own LoRA adapter (model/adapter_slots.py)
    decode_attention   each decode row's own pages     \\
    prefix_attention   a shared prefix read once       |- the CPU attention backend
    prefill_attention  prefill blocks                  /  (pallas_kernels/cpu.py)

Each kernel has a portable loop and AVX2, AVX-512 (BF16, VNNI) and AMX paths, picked when
it is built (`-march=native`); tests/cpu_kernels/ runs each path the CPU can run against
the portable one and the jnp reference. Nothing here imports the rest of Sluice.
"""
