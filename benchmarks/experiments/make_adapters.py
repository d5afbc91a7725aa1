"""Write N random LoRA adapters in the PEFT layout for a model's shapes (benchmarks, demos).

    .venv/bin/python benchmarks/experiments/make_adapters.py --model embedded --n 4 --rank 16 --out DIR

Each adapter trains all seven projections (q/k/v/o/gate/up/down) of every layer with
random A and B (tests/model/peft.py writes them); the directories are DIR/lora-0 ...
Prints a TOML snippet declaring them for a pool (`max_loras`, `[[pools.adapters]]`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.weights import load_model  # noqa: E402
from tests.model.peft import write_peft  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded", help="model source (its shapes)")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--std", type=float, default=0.05, help="scale of the random A and B")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    config = load_model(args.model, progress=False).config
    print(f"max_loras = {args.n}\nmax_lora_rank = {args.rank}")
    for i in range(args.n):
        path = args.out / f"lora-{i}"
        write_peft(path, config, rank=args.rank, seed=i, std=args.std)
        print(f'[[pools.adapters]]\nname = "lora-{i}"\npath = "{path.resolve()}"')
    return 0


if __name__ == "__main__":
    sys.exit(main())
