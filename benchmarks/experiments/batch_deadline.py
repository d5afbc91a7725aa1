"""A batch whose window is too short for background-only progress, on a busy server.

Against a running Sluice (URL): interactive shared-prefix traffic at concurrency 8 for
the whole window, and a batch of N requests with `completeWithin` = WINDOW submitted as it
starts. Polls the batch every 2 s (status, counts, the level it was raised to, its
estimated completion). Prints one JSON line: whether it completed within its window, when,
and the level timeline.

    .venv/bin/python benchmarks/experiments/batch_deadline.py URL OUT [--batch 120] [--window 4m]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("out", type=Path)
    ap.add_argument("--batch", type=int, default=120)
    ap.add_argument("--window", default="4m")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    http = httpx.Client(base_url=args.url, timeout=60)
    model = http.get("/v1/models").json()["data"][0]["id"]
    seconds = float(args.window[:-1]) * {"s": 1, "m": 60, "h": 3600}[args.window[-1]]
    load = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "bench", "--url", args.url, "--workload",
         "shared-prefix", "--concurrency", "8", "--duration", str(seconds + 30),
         "--no-progress", "--label", "interactive", "--out", str(args.out / "interactive")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    time.sleep(15)  # the interactive load is up before the batch arrives
    r = http.post("/v1/batches", json={"completeWithin": args.window, "requests": [
        {"model": model, "max_tokens": 48, "temperature": 0, "messages": [
            {"role": "user", "content": f"Write one sentence about the number {i}."}]}
        for i in range(args.batch)]})
    r.raise_for_status()
    b = r.json()
    t0, timeline = time.time(), []
    while b["status"] not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(2)
        b = http.get(f"/v1/batches/{b['id']}").json()
        s = b.get("sluice") or {}
        timeline.append({"t": round(time.time() - t0, 1), "status": b["status"],
                         "done": b["request_counts"]["completed"],
                         "level": s.get("priority_level"), "at_risk": s.get("at_risk"),
                         "eta_s": (s["estimated_completion_at"] - t0)
                         if s.get("estimated_completion_at") else None})
    end = b.get("completed_at") or b.get("expired_at")
    out, _ = load.communicate()
    inter = json.loads(out.strip().splitlines()[-1])
    result = {"batch": args.batch, "window_s": seconds, "status": b["status"],
              "finished_after_s": end - b["created_at"] if end else None,
              "counts": b["request_counts"],
              "max_level": max((x["level"] or 0) for x in timeline),
              "raised_at_s": [x["t"] for a, x in zip(timeline, timeline[1:])
                              if (x["level"] or 0) > (a["level"] or 0)],
              "interactive": {"ttft_p95": inter["ttft_s"]["p95"],
                              "itl_p95": inter["itl_s"]["p95"],
                              "ok": inter["requests"]["ok"]}}
    (args.out / "timeline.json").write_text(json.dumps(timeline))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
