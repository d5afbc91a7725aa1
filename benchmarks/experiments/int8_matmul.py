"""The int8-weight and Q4_1 kernels against XLA:CPU's f32 matmul, per token-row count
(issue 20).

The embedded model's shapes with random weights: the four projections of 30 layers
(q/k/v 960 x 576, attention output 576 x 576, gate/up 3072 x 576, down 576 x 1536), each
layer's weight passed whole as the step does, and the tied lm_head (49,152 x 576), at 1
to 272 token rows (272: a decode of 16 beside a 256-token prompt chunk), feature-major
as the CPU runner multiplies. Median of 7, ms. Where the kernel uses AMX, the same
source built without it (`int8_avx512`) runs beside it. `q4`: the projections in Q4_1
blocks times int8 activations, `q8_0` the lm_head in Q8_0 blocks times int8 activations
(csrc/q4_linear.cc: `quantization = "q4_1"`). Prints one JSON line.

    .venv/bin/python benchmarks/experiments/int8_matmul.py [--rows 1,4,16,64,272]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from model.bench import median_time
from model.quant import quantize_int8, quantize_q4, quantize_q8_0
from cpu_kernels import native
from cpu_kernels.native import available, q4_linear, q8_linear

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def timed(f, x) -> float:
    return round(median_time(lambda: f(x).block_until_ready()) * 1000, 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16,64,272")
    args = ap.parse_args(argv)
    ok, what = available()
    if not ok:
        print(json.dumps({"error": what}))
        return 1
    rng = np.random.default_rng(0)
    f32 = {k: jnp.asarray(rng.standard_normal((30, n, i)).astype(np.float32) * 0.02)
           for k, (n, i) in SHAPES.items()}
    i8 = {k: quantize_int8(np.asarray(w)) for k, w in f32.items()}
    q4 = {k: quantize_q4(np.asarray(w)) for k, w in f32.items()}
    head = rng.standard_normal((1, 49152, 576)).astype(np.float32) * 0.02
    head_f32, head_i8 = jnp.asarray(head[0]), quantize_int8(head)
    head_q8 = quantize_q8_0(head)

    targets = {"int8": native.TARGET}
    if what == "amx":
        lib = ctypes.cdll.LoadLibrary(str(native.build(
            native.FLAGS + ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"))))
        jax.ffi.register_ffi_target("q8_avx512", jax.ffi.pycapsule(lib.SluiceQ8Linear),
                                    platform="cpu")
        targets["int8_avx512"] = "q8_avx512"

    def layers(target):
        def run(x):
            def body(acc, i):
                for k, (_, n_in) in SHAPES.items():
                    if target == "q4":
                        y = q4_linear(x[:n_in], q4[k].q, i, feature_major=True)
                    elif target:
                        m = i8[k]
                        y = q8_linear(x[:n_in], m.q, m.scale, i, feature_major=True,
                                      layout=m.layout, target=target)
                    else:
                        y = f32[k][i] @ x[:n_in]
                    acc = acc + y[0, 0]
                return acc, None
            return jax.lax.scan(body, jnp.float32(0), jnp.arange(30))[0]
        return jax.jit(run)

    heads = {"f32": jax.jit(lambda x: (head_f32 @ x[:576])[0, 0])}
    for name, target in targets.items():
        heads[name] = jax.jit(lambda x, t=target: q8_linear(
            x[:576], head_i8.q, head_i8.scale, 0, feature_major=True,
            layout=head_i8.layout, target=t)[0, 0])
    heads["q8_0"] = jax.jit(lambda x: q4_linear(x[:576], head_q8.q, 0, feature_major=True,
                                                format=head_q8.format)[0, 0])
    runs = {"f32": layers(None), **{name: layers(t) for name, t in targets.items()},
            "q4": layers("q4")}
    out = []
    for rows in map(int, args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((1536, rows)).astype(np.float32))
        out.append({"rows": rows,
                    "projections_ms": {k: timed(f, x) for k, f in runs.items()},
                    "lm_head_ms": {k: timed(f, x) for k, f in heads.items()}})
    print(json.dumps({"kernel": what, "cases": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
