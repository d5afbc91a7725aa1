"""Interactive traffic beside a batch backlog, one server, side by side in one session.

Against a running Sluice (URL): `sluice bench --workload shared-prefix --concurrency 8`
(`--concurrency`) alone; then a batch of N requests is submitted (platform form) and the same bench runs
again while the backlog is queued. /metrics is sampled every second throughout, for the
plot of interactive vs batch tokens over time. Prints one JSON line (both runs' TTFT and
ITL p50/p95, useful-busy, batch progress) and writes batch_interference.png under OUT.

    .venv/bin/python benchmarks/experiments/batch_interference.py URL OUT [--batch 500] [--requests 48]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

METRICS = ("sluice:generation_tokens_total", "sluice:batch_tokens_total")


def scrape(http: httpx.Client) -> dict[str, float]:
    out = {}
    for line in http.get("/metrics").text.splitlines():
        for name in METRICS:
            if line.startswith(name):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def bench(url: str, out: Path, label: str, requests: int, concurrency: int) -> dict:
    cmd = [sys.executable, "-m", "app.cli", "bench", "--url", url, "--workload",
           "shared-prefix", "--concurrency", str(concurrency), "--ramp-up", "10",
           "--warmup-requests",
           "2", "--requests", str(requests), "--no-progress", "--label", label,
           "--out", str(out / label)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("out", type=Path)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    http = httpx.Client(base_url=args.url, timeout=60)
    samples: list[tuple[float, dict]] = []
    t0 = time.time()
    stop = False

    def sampler() -> None:
        while not stop:
            samples.append((time.time() - t0, scrape(http)))
            time.sleep(1.0)

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    alone = bench(args.url, args.out, "alone", args.requests, args.concurrency)
    t_alone = time.time() - t0
    words = "Summarise the quarterly report for the operations team in three bullet points."
    r = http.post("/v1/batches", json={"completeWithin": "24h", "requests": [
        {"model": alone["model"], "max_tokens": 64, "temperature": 0, "messages": [
            {"role": "system", "content": words},
            {"role": "user", "content": f"Report {i}: revenue {i * 7 % 100} units."}]}
        for i in range(args.batch)]})
    r.raise_for_status()
    bid = r.json()["id"]
    t_batch = time.time() - t0
    time.sleep(5)  # the backlog is queued and running in idle capacity
    beside = bench(args.url, args.out, "with-batch", args.requests, args.concurrency)
    t_end = time.time() - t0
    time.sleep(5)
    stop = True
    thread.join()
    b = http.get(f"/v1/batches/{bid}").json()

    def pick(s: dict) -> dict:
        return {"ttft_p50": s["ttft_s"]["p50"], "ttft_p95": s["ttft_s"]["p95"],
                "itl_p50": s["itl_s"]["p50"], "itl_p95": s["itl_s"]["p95"],
                "ok": s["requests"]["ok"], "rate_limited": s["requests"]["rate_limited"],
                "out_tok_s": s["throughput"]["output_tokens_per_s"],
                "useful_busy": (s.get("server") or {}).get("useful_busy_fraction")}

    result = {"alone": pick(alone), "with_batch": pick(beside), "batch": {
        "id": bid, "requests": args.batch, "status": b["status"],
        "counts": b["request_counts"], "sluice": b.get("sluice")},
        "ratios": {k: pick(beside)[k] / pick(alone)[k] for k in
                   ("ttft_p95", "itl_p95", "out_tok_s")},
        "phases_s": {"alone_end": t_alone, "batch_submitted": t_batch, "with_end": t_end}}
    (args.out / "samples.json").write_text(json.dumps(samples))
    (args.out / "result.json").write_text(json.dumps(result))
    _plot(samples, result["phases_s"], args.out / "batch_interference.png")
    print(json.dumps(result))
    return 0


def _plot(samples, phases, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s[0] for s in samples]
    gen = [s[1].get(METRICS[0], 0.0) for s in samples]
    bat = [s[1].get(METRICS[1], 0.0) for s in samples]
    w = 10  # samples per window: batch tokens are counted when a request ends

    def rate(xs):
        return [max(0.0, (xs[i] - xs[max(0, i - w)]) / max(t[i] - t[max(0, i - w)], 1e-9))
                for i in range(len(xs))]

    inter = [g - b for g, b in zip(gen, bat)]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(t, rate(inter), label="interactive tokens/s")
    ax.plot(t, rate(bat), label="batch tokens/s")
    for name, x in phases.items():
        ax.axvline(x, color="grey", lw=0.8, ls="--")
        ax.text(x, ax.get_ylim()[1] * 0.95, name, fontsize=7, rotation=90, va="top")
    ax.set_xlabel("seconds")
    ax.set_ylabel("generated tokens/s (10 s windows)")
    ax.set_title("shared-prefix alone, then beside a batch backlog")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
