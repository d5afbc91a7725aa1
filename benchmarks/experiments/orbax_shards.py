"""What one process of a multi-host tensor-parallel replica reads of an orbax checkpoint
(model/loaders/orbax_ckpt.py `Shards`), and how long restoring takes, whole and by shards.

    .venv/bin/python benchmarks/experiments/orbax_shards.py [--model embedded] [--rounds 2]

Converts the model to a checkpoint in a temporary folder, then restores it whole and as
the last process of TP = 2 and TP = 4 replicas would; prints one JSON line: the save's
seconds, each restore's seconds per round and the (read, stored) megabytes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from model.loaders.orbax_ckpt import Shards, save_orbax
from model.weights import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    src = load_model(args.model, progress=False)
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        dst = save_orbax(src, f"{d}/ckpt", progress=False)
        out: dict = {"save_s": round(time.perf_counter() - t, 2)}
        for _ in range(args.rounds):
            t = time.perf_counter()
            load_model(str(dst), progress=False)
            out.setdefault("whole_s", []).append(round(time.perf_counter() - t, 2))
            for n in (2, 4):
                t = time.perf_counter()
                m = load_model(str(dst), progress=False,
                               shards=lambda cfg, n=n: Shards(n, (n - 1,)))
                out.setdefault(f"tp{n}_s", []).append(round(time.perf_counter() - t, 2))
                out[f"tp{n}_read_mb"] = [round(x / 1e6, 1) for x in m.read_bytes]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
