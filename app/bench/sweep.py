"""`sluice bench-sweep`: one workload, several concurrencies, several targets, one chart.

Each (target, concurrency) point is a full closed-loop `run_bench`. Point ``k`` starts at
request index ``k * LEVEL_STRIDE``: every point sends fresh questions (a prefix cache
must not be credited with answers it kept from the previous point), and point ``k`` sends
the same requests to every target, so the targets are compared on identical traffic.
Targets run one after another; spawned servers start just before their points and stop
just after. A target that fails is reported and the sweep goes on with the others.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from .options import config_from, itl_label
from .report import have_matplotlib, print_table, to_json, write_run
from .run import BenchError, run_bench
from .spawn import SpawnError, sluice_command, spawned

LEVEL_STRIDE = 100_000


def headline(s: dict[str, Any]) -> dict[str, Any]:
    """The few numbers of one point that the sweep's JSON line carries."""
    server = s.get("server") or {}
    return {
        "concurrency": s["load"].get("concurrency"),
        "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
        "output_tokens_per_s_full_concurrency": (
            s["throughput"].get("full_concurrency") or {}).get("output_tokens_per_s"),
        "requests_per_s": s["throughput"]["requests_per_s"],
        "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p95_s": s["ttft_s"]["p95"],
        "itl_p95_s": s["itl_s"]["p95"], "e2e_p95_s": s["e2e_s"]["p95"],
        "ok": s["requests"]["ok"], "rate_limited": s["requests"]["rate_limited"],
        "step_time_prediction_ratio": server.get("step_time_prediction_ratio"),
        "slo_attainment": s["slo"]["attainment"],
        "prefix_cache_hit_rate": server.get("prefix_cache_hit_rate"),
    }


async def _points(args: argparse.Namespace, label: str, url: str) -> list[dict[str, Any]]:
    out = []
    for k, c in enumerate(args.concurrencies):
        bound: dict[str, Any] = {}
        if args.requests is None and args.duration_s is None:
            bound["requests"] = args.requests_per_stream * c
        cfg = config_from(args, url=url, label=label, concurrency=c,
                          start_index=k * LEVEL_STRIDE, **bound)
        result = await run_bench(cfg)
        print_table(result.summary)
        if args.out:
            write_run(result, args.out / label / f"c{c}", plots=False)
        out.append(result.summary)
    return out


async def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    console = Console(stderr=True)
    points: dict[str, list[dict[str, Any]]] = {}
    errors: dict[str, str] = {}
    command = sluice_command(args.sluice)
    jobs = [(label, url, None) for label, url in args.targets]
    jobs += [(label, None, spawn_args) for label, spawn_args in args.spawn]
    for label, url, spawn_args in jobs:
        try:
            if url is not None:
                points[label] = await _points(args, label, url)
                continue
            console.print(f"starting {label}: sluice serve {spawn_args}")
            async with spawned(label, spawn_args, command=command, log_dir=args.out,
                               ready_timeout_s=args.spawn_timeout, grace_s=args.grace) as u:
                points[label] = await _points(args, label, u)
        except (BenchError, SpawnError) as e:
            console.print(f"{label}: {e}", style="red", markup=False, highlight=False)
            errors[label] = str(e)
    result: dict[str, Any] = {
        "workload": args.workload, "concurrencies": args.concurrencies, "seed": args.seed,
        "targets": {label: [headline(s) for s in rows] for label, rows in points.items()},
        "errors": errors,
    }
    if args.out and points:
        args.out.mkdir(parents=True, exist_ok=True)
        full = {**result, "points": points}
        (args.out / "sweep.json").write_text(to_json(full, indent=2) + "\n")
        result["files"] = [str(args.out / "sweep.json")]
        if not have_matplotlib():
            console.print("no matplotlib, so no chart (pip install 'sluice[bench]')")
        else:
            from .plots import sweep_chart

            chart = sweep_chart(points, args.out / "sweep.png",
                                f"{args.workload}, seed {args.seed}")
            result["files"].append(str(chart))
            targets = {itl_label(t): t for t in args.itl_targets or ()}
            if any(label in points for label in targets):
                from .plots import itl_target_chart

                chart = itl_target_chart(
                    {t: points[label] for label, t in targets.items() if label in points},
                    args.out / "itl_targets.png", f"{args.workload}, seed {args.seed}")
                result["files"].append(str(chart))
    return result


def check_labels(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for t in args.itl_targets or ():  # one spawned server per ITL target
        strict = " --itl-strict" if t else ""
        args.spawn.append((itl_label(t), f"--itl-target {t:g}{strict} {args.serve_args}".strip()))
    labels = [label for label, _ in args.targets] + [label for label, _ in args.spawn]
    if not labels:
        p.error("give at least one LABEL=URL target or --spawn LABEL:ARGS")
    if len(set(labels)) != len(labels):
        p.error(f"labels must be distinct: {labels}")
    if any("/" in label or label in (".", "..") for label in labels):
        p.error("labels name folders under --out: no '/'")
