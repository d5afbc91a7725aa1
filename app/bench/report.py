"""Where results go: a table on stderr, one JSON line on stdout, files under ``--out``.

The JSON line is the last line of stdout so that scripts can take ``tail -n1``; NaN and
infinities are written as null (msgspec does this), which keeps it strict JSON. Under
``--out DIR``: ``summary.json``, ``requests.jsonl`` (one record per request, every phase,
for any analysis not foreseen here) and the PNG charts.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping

import msgspec
from rich.console import Console
from rich.table import Table

from .run import Result


def to_json(obj: Any, *, indent: int = 0) -> str:
    raw = msgspec.json.encode(obj)
    return (msgspec.json.format(raw, indent=indent) if indent else raw).decode()


def write_run(result: Result, out: Path, *, plots: bool = True) -> list[str]:
    """Write one run's files under ``out``; returns their names (also put in the summary)."""
    out.mkdir(parents=True, exist_ok=True)
    s = result.summary
    names = ["summary.json", "requests.jsonl"]
    with open(out / "requests.jsonl", "wb") as f:
        for rec in result.records:
            f.write(msgspec.json.encode(rec) + b"\n")
    if plots and not have_matplotlib():
        print("sluice bench: no matplotlib, so no charts (pip install 'sluice[bench]')",
              file=sys.stderr)
        plots = False
    if plots:
        from . import plots as p

        title = f"{s.get('label') or s.get('target')}: {s.get('workload')}"
        main = [r for r in result.records if r.tag not in ("capacity", "long")]
        p.latency_cdfs(main, out / "latency_cdf.png", title)
        names.append("latency_cdf.png")
        li = s.get("long_interference")
        if li:
            shorts = [r for r in result.records if r.tag == "short"]
            p.itl_timeline(shorts, li["window_s"], out / "itl_timeline.png", title)
            names.append("itl_timeline.png")
    s["files"] = [str(out / n) for n in names]
    (out / "summary.json").write_text(to_json(s, indent=2) + "\n")
    return names


def have_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def print_json(summary: Mapping[str, Any]) -> None:
    sys.stdout.write(to_json(summary) + "\n")
    sys.stdout.flush()


def _ms(x: Any) -> str:
    return "-" if x is None else f"{1000 * x:.1f}"


def _pct(x: Any) -> str:
    return "-" if x is None else f"{x:.0%}"


def print_table(summary: Mapping[str, Any]) -> None:
    """A human summary on stderr."""
    c = Console(stderr=True)
    load = summary.get("load") or {}
    shape = (f"rate {load['rate_rps']:.2f}/s" if load.get("mode") == "open"
             else f"concurrency {load.get('concurrency')}")
    t = Table(title=f"{summary.get('label') or summary.get('target')}: "
                    f"{summary.get('workload')}, {shape}")
    t.add_column("ms")
    for q in ("p50", "p90", "p95", "p99", "max"):
        t.add_column(q, justify="right")
    for key, name in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("tpot_s", "TPOT"),
                      ("e2e_s", "E2E")):
        d = summary.get(key) or {}
        t.add_row(name, *(_ms(d.get(q)) for q in ("p50", "p90", "p95", "p99", "max")))
    c.print(t)
    thr, req, slo = summary["throughput"], summary["requests"], summary["slo"]
    c.print(f"{req['ok']}/{req['total']} ok, {req['rate_limited']} x 429, "
            f"{req['server_errors_5xx']} x 5xx in {summary['duration_s']:.1f} s: "
            f"{thr['requests_per_s']:.2f} req/s, {thr['output_tokens_per_s']:.1f} out tok/s; "
            f"SLO attainment {_pct(slo['attainment'])}")
    full = thr.get("full_concurrency")
    if full:
        a, b = full["window_s"]
        c.print(f"at full concurrency ({a:.1f}-{b:.1f} s): "
                f"{full['output_tokens_per_s']:.1f} out tok/s")
    server = summary.get("server")
    if server:
        kv = server["kv_cache_usage"]
        c.print(f"server: prefix-cache hits {_pct(server['prefix_cache_hit_rate'])}, "
                f"KV use mean {_pct(kv['mean'])} max {_pct(kv['max'])}, "
                f"engine busy {_pct(server['engine_busy_fraction_run'])}, "
                f"preemptions {server['preemptions']:.0f}")
        ratio, host = server.get("step_time_prediction_ratio"), server.get("step_host_seconds")
        if ratio:
            c.print(f"step time measured/predicted p50 {ratio['p50']:.2f} p95 "
                    f"{ratio['p95']:.2f} ({ratio['count']:.0f} steps)")
        if host:
            c.print(f"host work per step p50 {_ms(host['p50'])} ms p95 {_ms(host['p95'])} ms; "
                    f"computation idle between steps "
                    f"{_pct(server.get('device_idle_between_steps'))}")
    li = summary.get("long_interference")
    if li:
        c.print(f"long prompt TTFT {_ms(li['long']['ttft_s'])} ms; short p95 ITL before "
                f"{_ms(li['short_itl_before_s']['p95'])} ms, during "
                f"{_ms(li['short_itl_during_s']['p95'])} ms, while it decodes "
                f"{_ms(li['short_itl_while_long_decodes_s'].get('p95'))} ms")
    for err, n in (summary.get("errors") or {}).items():
        c.print(f"{n} x {err}", style="red", markup=False, highlight=False)
