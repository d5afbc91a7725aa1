"""Both SLOs over concurrency: the polite shared-prefix load (benchmarks/polite_load.py) at
1, 4, 8, 16 and 32 streams against one server, plotted: TTFT p95 counted from the first
send, ITL p95, output tok/s and refusals a request, with the targets drawn.

Each point sends max(8, 3 x C) requests after C of warm-up (the system prompt cached once,
then the streams in their steady state). Prints one JSON line; writes OUT/slo_sweep.png
and OUT/slo_sweep.json.

    .venv/bin/python benchmarks/slo_sweep.py URL --out DIR [--concurrencies 1,4,8,16,32]
        [--ttft-target 1.0] [--itl-target 0.05] [--label sluice-default]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from polite_load import Load, options  # noqa: E402  (a script beside this one)


def point(url: str, c: int, seed: int) -> dict:
    args = options(url, concurrency=c, requests=max(8, 3 * c), warmup_requests=c, seed=seed)
    return trio.run(Load(args).run)


def plot(rows: list[dict], out: Path, ttft_target: float, itl_target: float,
         label: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(2, 2, figsize=(10, 7))
    panels = (
        (ax[0][0], "TTFT p95 from the first send (s)",
         [r["ttft_from_first_send_s"].get("p95") for r in rows], ttft_target),
        (ax[0][1], "ITL p95 (ms)", [1000 * r["itl_s"].get("p95", 0) for r in rows],
         1000 * itl_target),
        (ax[1][0], "output tok/s", [r["output_tok_s"] for r in rows], None),
        (ax[1][1], "refusals a request (429s waited out)",
         [r["refusals_per_request_mean"] for r in rows], None),
    )
    for a, title, ys, target in panels:
        a.plot(cs, ys, marker="o", color="#1f5fa8", label=label)
        if target is not None:
            a.axhline(target, color="#b42318", linestyle="--", linewidth=1, label="target")
        a.set_title(title, fontsize=10)
        a.set_xlabel("concurrent streams")
        a.set_xscale("log", base=2)
        a.set_xticks(cs, [str(c) for c in cs])
        a.grid(alpha=0.3)
        a.set_ylim(bottom=0)
        a.legend(fontsize=8)
    fig.suptitle("Shared-prefix load (2,000-token system prompt), polite clients", fontsize=11)
    fig.tight_layout()
    path = out / "slo_sweep.png"
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--concurrencies", default="1,4,8,16,32")
    ap.add_argument("--ttft-target", type=float, default=1.0)
    ap.add_argument("--itl-target", type=float, default=0.05)
    ap.add_argument("--label", default="sluice")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for c in (int(x) for x in args.concurrencies.split(",")):
        rows.append(point(args.url, c, args.seed))
        (args.out / "slo_sweep.json").write_text(json.dumps(rows))
    png = plot(rows, args.out, args.ttft_target, args.itl_target, args.label)
    print(json.dumps({"label": args.label, "png": str(png), "points": [
        {"concurrency": r["concurrency"], "ok": r["statuses"].get("ok", 0),
         "of": r["requests"], "ttft_p95_from_first_send_s": r["ttft_from_first_send_s"].get("p95"),
         "itl_p95_s": r["itl_s"].get("p95"), "output_tok_s": r["output_tok_s"],
         "refusals_per_request": r["refusals_per_request_mean"]} for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
