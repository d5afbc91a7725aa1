"""PNG charts with matplotlib's Agg backend (no display; imported only when drawing).

- `latency_cdfs`: empirical CDFs of TTFT, ITL and E2E of one run's successful requests.
- `itl_timeline`: long-interference; every short-stream gap at the time it ended, with
  the long request's send and first token marked and the window between them shaded.
- `sweep_chart`: one line per target: output tokens/s against p95 TTFT and p95 ITL (the
  throughput-latency curve, each point a concurrency), and throughput and p95 latency
  against concurrency.
- `itl_target_chart`: one point per ITL target (a server each) at one offered load:
  achieved p95 ITL and TTFT, output tokens/s, and refusals against the target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .client import RequestRecord


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> Path:
    """Lay out, write as a PNG at `path` and close the figure; returns `path`."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def latency_cdfs(records: Sequence[RequestRecord], path: Path, title: str = "") -> Path:
    plt = _pyplot()
    ok = [r for r in records if r.status == "ok"]
    series = {
        "TTFT": [r.ttft for r in ok if r.ttft is not None],
        "ITL (per chunk)": [g for r in ok for g in r.gaps],
        "E2E": [r.e2e for r in ok if r.e2e is not None],
    }
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (name, values) in zip(axes, series.items()):
        v = np.sort(np.asarray(values, dtype=float))
        if v.size:
            ax.step(v, np.arange(1, v.size + 1) / v.size, where="post")
            for q, style in ((50, ":"), (95, "--")):
                x = float(np.percentile(v, q))
                ax.axvline(x, color="gray", linestyle=style, linewidth=0.8)
                ax.annotate(f"p{q} {x:.3g}s", (x, 0.05 if q == 50 else 0.15), fontsize=7)
        ax.set_title(f"{name} (n={v.size})")
        ax.locator_params(axis="x", nbins=5)
        ax.set_xlabel("seconds")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of samples")
    fig.suptitle(title)
    return _save(plt, fig, path)


def itl_timeline(shorts: Sequence[RequestRecord], window: Sequence[float], path: Path,
                 title: str = "") -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 4))
    positive = False
    for r in shorts:
        t = [r.start + x for x in r.chunk_times]
        if len(t) > 1:
            ax.plot(t[1:], np.diff(t), ".", markersize=3, alpha=0.7)
            positive = positive or bool(np.any(np.diff(t) > 0))
    send, first = window
    ax.axvspan(send, first, color="tab:red", alpha=0.12, label="long prefill")
    ax.axvline(send, color="tab:red", linestyle="--", linewidth=1, label="long sent")
    ax.axvline(first, color="tab:red", linewidth=1, label="long first token")
    ax.set_xlabel("run time (s)")
    ax.set_ylabel("short streams' ITL (s)")
    if positive:  # (matplotlib warns when nothing is positive)
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(title)
    return _save(plt, fig, path)


def sweep_chart(points: Mapping[str, Sequence[Mapping[str, Any]]], path: Path,
                title: str = "") -> Path:
    """``points``: label -> one summary per concurrency (as `sweep` collects them)."""
    plt = _pyplot()
    from matplotlib.ticker import NullLocator

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (a_ttft, a_itl), (a_thr, a_lat) = axes

    def col(rows: Sequence[Mapping[str, Any]], *keys: str) -> list[float]:
        out = []
        for row in rows:
            v: Any = row
            for k in keys:
                v = v.get(k) if isinstance(v, Mapping) else None
            out.append(float("nan") if v is None else float(v))
        return out

    latencies: list[float] = []
    for i, (label, rows) in enumerate(points.items()):
        color = f"C{i}"
        conc = col(rows, "load", "concurrency")
        tput = col(rows, "throughput", "output_tokens_per_s")
        ttft, itl = col(rows, "ttft_s", "p95"), col(rows, "itl_s", "p95")
        latencies += ttft + itl
        for ax, lat in ((a_ttft, ttft), (a_itl, itl)):
            ax.plot(lat, tput, "o-", color=color, label=label)
            for c, x, y in zip(conc, lat, tput):
                ax.annotate(f"{c:.0f}", (x, y), fontsize=7, textcoords="offset points",
                            xytext=(3, 3))
        a_thr.plot(conc, tput, "o-", color=color, label=label)
        a_lat.plot(conc, ttft, "o-", color=color, label=f"{label} p95 TTFT")
        a_lat.plot(conc, itl, "s--", color=color, label=f"{label} p95 ITL")
    a_ttft.set(xlabel="p95 TTFT (s)", ylabel="output tokens/s", title="throughput vs TTFT")
    a_itl.set(xlabel="p95 ITL (s)", ylabel="output tokens/s", title="throughput vs ITL")
    a_thr.set(xlabel="concurrency", ylabel="output tokens/s", title="throughput")
    a_lat.set(xlabel="concurrency", ylabel="seconds", title="p95 latency")
    if any(y > 0 for y in latencies):  # (matplotlib warns when nothing is positive)
        a_lat.set_yscale("log")
    levels = sorted({c for rows in points.values() for c in col(rows, "load", "concurrency")
                     if c == c})  # (not NaN)
    for ax in (a_thr, a_lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [f"{c:.0f}" for c in levels])
        ax.xaxis.set_minor_locator(NullLocator())
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title + "  (point labels: concurrency)" if title else
                 "point labels: concurrency")
    return _save(plt, fig, path)


def itl_target_chart(points: Mapping[float, Sequence[Mapping[str, Any]]], path: Path,
                     title: str = "") -> Path:
    """``points``: ITL target (s; 0 = off) -> one summary per concurrency. The target off
    is drawn at the right edge, past the largest one."""
    plt = _pyplot()
    targets = sorted(t for t in points if t > 0)
    off_x = (max(targets) * 1.3) if targets else 1.0
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.9))
    levels = sorted({row["load"].get("concurrency") for rows in points.values()
                     for row in rows})
    for i, c in enumerate(levels):
        xs, itl, ttft, tput, refused = [], [], [], [], []
        for t in sorted(points, key=lambda t: off_x if t == 0 else t):
            row = next((r for r in points[t] if r["load"].get("concurrency") == c), None)
            if row is None:
                continue
            xs.append(off_x if t == 0 else t)
            itl.append(row["itl_s"]["p95"] or float("nan"))
            ttft.append(row["ttft_s"]["p95"] or float("nan"))
            tput.append(row["throughput"]["output_tokens_per_s"])
            req = row["requests"]
            refused.append(req["rate_limited"] / max(1, req["total"]))
        style = dict(marker="o", color=f"C{i}", label=f"concurrency {c}")
        axes[0].plot(xs, itl, **style)
        axes[1].plot(xs, ttft, **style)
        axes[2].plot(xs, tput, **style)
        axes[3].plot(xs, refused, **style)
    lim = [0, off_x * 1.08]
    axes[0].plot(lim, lim, ":", color="grey", label="achieved = target")
    for ax, (name, unit) in zip(axes, (("p95 ITL", "s"), ("p95 TTFT", "s"),
                                       ("output tokens/s", ""), ("refused (429) / sent", ""))):
        ax.set(xlabel="ITL target (s)", ylabel=f"{name} ({unit})" if unit else name,
               title=name, xlim=lim)
        ticks = [*targets, off_x]
        ax.set_xticks(ticks, [f"{t:g}" for t in targets] + ["off"])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    return _save(plt, fig, path)
