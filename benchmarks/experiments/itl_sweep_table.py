"""The table of an ITL-target sweep (`benchmarks/experiments/itl_sweep.sh OUT`), from OUT/*/c16:
per target, the admitted requests' latency (and the worst request's own p95 ITL), output
tokens/s, refusals, and the step-cost model's error and host work that the server reported.

    .venv/bin/python benchmarks/experiments/itl_sweep_table.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def row(folder: Path) -> dict:
    s = json.loads((folder / "summary.json").read_text())
    per_request = []
    for line in (folder / "requests.jsonl").read_text().splitlines():
        r = json.loads(line)
        times = r.get("chunk_times") or []
        gaps = np.diff(times)
        if r["status"] == "ok" and len(gaps) >= 2:
            per_request.append(float(np.percentile(gaps, 95)))
    server = s.get("server") or {}
    ratio = server.get("step_time_prediction_ratio") or {}
    host = server.get("step_host_seconds") or {}
    req = s["requests"]
    return {
        "ok": req["ok"], "refused": req["rate_limited"], "duration_s": s["duration_s"],
        "ttft_p50": s["ttft_s"]["p50"], "ttft_p95": s["ttft_s"]["p95"],
        "itl_p50": s["itl_s"]["p50"], "itl_p95": s["itl_s"]["p95"], "itl_p99": s["itl_s"]["p99"],
        "worst_request_itl_p95": max(per_request) if per_request else None,
        "out_tok_s": s["throughput"]["output_tokens_per_s"],
        "out_tok_s_full": (s["throughput"].get("full_concurrency") or {}).get(
            "output_tokens_per_s"),
        "pred_p50": ratio.get("p50"), "pred_p95": ratio.get("p95"),
        "host_p50_ms": 1e3 * host["p50"] if host else None,
        "host_p95_ms": 1e3 * host["p95"] if host else None,
        "idle": server.get("device_idle_between_steps"),
        "preemptions": server.get("preemptions"),
        "rejected": server.get("rejected"),
    }


def main() -> int:
    out = Path(sys.argv[1])
    rows = {d.name: row(d / "c16") for d in sorted(out.iterdir()) if (d / "c16").is_dir()}
    print(json.dumps(rows, indent=1))
    fmt = lambda v, k=1e3: "-" if v is None else f"{v * k:.0f}"  # noqa: E731
    print("| target | ok / 429 | TTFT p50 / p95 (s) | ITL p50 / p95 / p99 (ms) | worst request's p95 ITL (ms) | out tok/s (full conc.) | measured/predicted p50 / p95 | host ms/step p50 / p95 | idle between steps | preemptions |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['ok']} / {r['refused']} | {r['ttft_p50']:.2f} / {r['ttft_p95']:.2f} | "
              f"{fmt(r['itl_p50'])} / {fmt(r['itl_p95'])} / {fmt(r['itl_p99'])} | "
              f"{fmt(r['worst_request_itl_p95'])} | {r['out_tok_s']:.1f} ({r['out_tok_s_full'] or 0:.1f}) | "
              f"{r['pred_p50'] or 0:.2f} / {r['pred_p95'] or 0:.2f} | "
              f"{r['host_p50_ms'] or 0:.1f} / {r['host_p95_ms'] or 0:.1f} | "
              f"{fmt(r['idle'], 100)}% | {r['preemptions'] or 0:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
