"""The console under `sluice bench` load: what it costs the engine, and whether it tells the truth.

Against a running Sluice (URL), shared-prefix closed loop at concurrency 16 (the issue's
workload), runs in turn:
- `none`: nobody watches;
- `poll`: a client makes exactly the dashboard's requests (GET /v1/stats with
  `steps_since`, twice a second) - the serving cost alone;
- `browser`: headless Chromium shows /dashboard (two updates a second); a screenshot of
  it mid-run goes to OUT/dashboard.png. On this 2-core box the browser's own rendering
  competes with the engine for the cores, which on a real deployment it would not (the
  operator's laptop draws the page): the `poll` runs are the serving cost.
For every watched run the dashboard's figures over the measured phase are compared with
the bench's own report and with /metrics' histograms (the same requests): TTFT and ITL
p95 (ratio), and the mean (= /metrics' sum / count). Finally, with the server idle, the
chat page answers two questions and is photographed mid-answer (OUT/chat.png).
Prints one JSON line.

    .venv/bin/python benchmarks/experiments/console_under_load.py URL OUT [--order none,poll,browser,none,poll]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

CHROMIUM = "/usr/bin/chromium"
HIST = {"ttft": "sluice:time_to_first_token_seconds", "itl": "sluice:inter_token_latency_seconds"}


def bench(url: str, out: Path, label: str, requests: int) -> dict:
    cmd = [sys.executable, "-m", "app.cli", "bench", "--url", url, "--workload",
           "shared-prefix", "--concurrency", "16", "--ramp-up", "20", "--warmup-requests", "2",
           "--requests", str(requests), "--no-progress", "--label", label,
           "--out", str(out / label)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def histograms(http: httpx.Client) -> dict[str, dict[str, float]]:
    """{kind: {le: cumulative count, "sum": s, "count": n}} summed over pools."""
    out: dict[str, dict[str, float]] = {k: {} for k in HIST}
    for line in http.get("/metrics").text.splitlines():
        for kind, name in HIST.items():
            m = re.match(rf'{re.escape(name)}_(bucket|sum|count)\{{(.*)\}} (\S+)$', line)
            if not m:
                continue
            part, labels, value = m.groups()
            key = re.search(r'le="([^"]+)"', labels).group(1) if part == "bucket" else part
            out[kind][key] = out[kind].get(key, 0.0) + float(value)
    return out


def hist_bucket(q: float, before: dict, after: dict) -> tuple[float, float] | None:
    """The /metrics bucket (lower, upper bound) that holds the q-quantile's rank: what the
    histogram knows for certain about it."""
    bounds = sorted((float(k), after[k] - before.get(k, 0.0)) for k in after
                    if k not in ("sum", "count"))
    if not bounds or not bounds[-1][1]:
        return None
    lo = 0.0
    for le, cum in bounds:
        if cum >= q * bounds[-1][1]:
            return lo, le
        lo = le
    return lo, float("inf")


def hist_quantile(q: float, before: dict, after: dict) -> float | None:
    """Prometheus' histogram_quantile over the difference of two scrapes."""
    bounds = sorted((float(k), after[k] - before.get(k, 0.0)) for k in after
                    if k not in ("sum", "count"))
    total = bounds[-1][1] if bounds else 0
    if not total:
        return None
    rank, lo, below = q * total, 0.0, 0.0
    for le, cum in bounds:
        if cum >= rank:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * (rank - below) / max(cum - below, 1e-12)
        lo, below = le, cum
    return lo


class Poller:
    """The dashboard's requests: GET /v1/stats twice a second, steps since the last seen."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=30)
        self.stop = threading.Event()
        self.latency: list[float] = []
        self.busy_until = 0.0  # the last time a request was running or waiting
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        since: dict[str, int] = {}
        while not self.stop.is_set():
            t0 = time.monotonic()
            q = ",".join(f"{k}:{v}" for k, v in since.items())
            body = self.http.get("/v1/stats", params={"window_s": 60, "steps_since": q}).json()
            self.latency.append(time.monotonic() - t0)
            for p in body["pools"]:
                if p["running"] or p["waiting"]:
                    self.busy_until = time.monotonic()
                for r in p["replicas"]:
                    since[f"{p['name']}/{r['replica']}"] = r["last_step_index"]
            self.stop.wait(max(0.0, 0.5 - (time.monotonic() - t0)))


class Browser:
    """Headless Chromium on /dashboard; a screenshot `shot_after_s` into the run."""

    def __init__(self, url: str, shot: Path, shot_after_s: float) -> None:
        self.url, self.shot, self.after = url, shot, shot_after_s
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = b.new_page(viewport={"width": 1280, "height": 800})
            page.on("console", lambda m: self.errors.append(m.text)
                    if m.type == "error" else None)
            page.goto(self.url + "/dashboard")
            if not self.stop.wait(self.after):
                page.screenshot(path=str(self.shot), full_page=True)
            self.stop.wait()
            b.close()


def measured(url: str, poller: Poller, duration_s: float) -> dict:
    """The dashboard's figures over the bench's measured phase (which ended when the server
    last had a request running or waiting)."""
    window = duration_s + (time.monotonic() - poller.busy_until)
    body = httpx.get(url + "/v1/stats", params={"window_s": window}, timeout=30).json()
    p = body["pools"][0]
    return {"window_s": window, "ttft": p["ttft"], "itl": p["itl"]}


def chat_shot(url: str, path: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = b.new_page(viewport={"width": 1280, "height": 800})
        page.goto(url + "/")
        page.wait_for_function("document.querySelectorAll('#model option').length > 0")
        page.fill("#system", "You are a concise geography tutor.")
        page.fill("#temperature", "0")
        page.fill("#prompt", "What is the capital of France?")
        page.press("#prompt", "Enter")
        page.wait_for_selector("body[data-state=idle]", timeout=120_000)
        page.fill("#max-tokens", "300")
        page.fill("#prompt", "Describe Paris in a few paragraphs: its river, its history "
                  "and what a visitor should see.")
        page.press("#prompt", "Enter")
        page.wait_for_function("""() => {
            const m = [...document.querySelectorAll('.message.assistant')].pop();
            return document.body.dataset.state === 'idle'
                || m.querySelector('.content').textContent.length > 200; }""",
                               timeout=120_000)
        page.screenshot(path=str(path))
        if page.is_enabled("#stop"):
            page.click("#stop")
        b.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("out", type=Path)
    ap.add_argument("--order", default="none,poll,browser,none,poll")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--shot-after", type=float, default=45.0)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    http = httpx.Client(base_url=args.url, timeout=60)
    runs = []
    for i, mode in enumerate(args.order.split(",")):
        label = f"{i}-{mode}"
        poller = Poller(args.url) if mode in ("poll", "browser") else None
        browser = (Browser(args.url, args.out / "dashboard.png", args.shot_after)
                   if mode == "browser" else None)
        before = histograms(http)
        for w in (poller, browser):
            if w is not None:
                w.thread.start()
        s = bench(args.url, args.out, label, args.requests)
        row = {"mode": mode, "out_tok_s": s["throughput"]["output_tokens_per_s"],
               "ttft_p95": s["ttft_s"]["p95"], "itl_p95": s["itl_s"]["p95"],
               "ttft_mean": s["ttft_s"]["mean"], "itl_mean": s["itl_s"]["mean"],
               "ok": s["requests"]["ok"], "rate_limited": s["requests"]["rate_limited"]}
        if poller is not None:
            dash = measured(args.url, poller, s["duration_s"])
            after = histograms(http)
            lat = np.asarray(poller.latency)
            row["stats_request_s"] = {"p50": float(np.percentile(lat, 50)),
                                      "p95": float(np.percentile(lat, 95)), "n": len(lat)}
            row["dashboard"] = dash
            row["metrics"] = {k: {"p95": hist_quantile(0.95, before[k], after[k]),
                                  "p95_bucket": hist_bucket(0.95, before[k], after[k]),
                                  "mean": (after[k]["sum"] - before[k].get("sum", 0)) /
                                  max(1.0, after[k]["count"] - before[k].get("count", 0)),
                                  "count": after[k]["count"] - before[k].get("count", 0)}
                              for k in HIST}
            row["agreement"] = {
                f"{k}_p95_dashboard_over_bench": dash[k]["p95"] / row[f"{k}_p95"]
                for k in ("ttft", "itl")} | {
                f"{k}_p95_dashboard_over_metrics": dash[k]["p95"] / row["metrics"][k]["p95"]
                for k in ("ttft", "itl")} | {
                f"{k}_mean_dashboard_over_bench": dash[k]["mean"] / row[f"{k}_mean"]
                for k in ("ttft", "itl")} | {
                f"{k}_p95_dashboard_in_metrics_bucket":
                row["metrics"][k]["p95_bucket"][0] <= dash[k]["p95"]
                <= row["metrics"][k]["p95_bucket"][1] for k in ("ttft", "itl")}
        for w in (poller, browser):
            if w is not None:
                w.stop.set()
                w.thread.join()
        if browser is not None:
            row["browser_console_errors"] = browser.errors
        runs.append(row)
        print(json.dumps(row), file=sys.stderr)
    chat_shot(args.url, args.out / "chat.png")
    by_mode: dict[str, list[float]] = {}
    for r in runs:
        by_mode.setdefault(r["mode"], []).append(r["out_tok_s"])
    result = {"runs": runs, "out_tok_s_by_mode": by_mode,
              "mean_out_tok_s": {m: sum(v) / len(v) for m, v in by_mode.items()}}
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
