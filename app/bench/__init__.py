"""`sluice bench` and `sluice bench-sweep`: a serving benchmark for any OpenAI-compatible
server, with Sluice's own metrics when the target is Sluice.

Modules, one job each:
    workloads.py       deterministic request streams (shared-prefix, mixed, ...) and calibration
    client.py          one streaming chat completion, parsed and timed chunk by chunk
    loops.py           closed loop at a concurrency, open (Poisson) loop at a rate
    run.py             one run against one target: phases per workload, the summary
    stats.py           percentiles, throughput, goodput, refusals, interference windows
    server_metrics.py  Sluice's /metrics before, during and after a run
    progress.py        the progress bar (stderr)
    report.py          table on stderr, JSON line on stdout, files under --out
    plots.py           PNG charts (matplotlib, Agg)
    sweep.py, spawn.py the sweep over concurrencies and targets; spawned servers

Importing this package loads neither matplotlib nor JAX.
"""

from __future__ import annotations

import sys

import trio

from .options import bench_parser, config_from, sweep_parser

__all__ = ["main", "sweep_main"]


def main(argv: list[str] | None = None) -> int:
    """`sluice bench [flags]`; 0 if at least one request succeeded."""
    from .report import print_json, print_table, write_run
    from .run import BenchError, run_bench

    p = bench_parser()
    cfg = config_from(p.parse_args(sys.argv[1:] if argv is None else argv))
    _check(p, concurrency=cfg.concurrency, short_streams=cfg.short_streams,
           max_inflight=cfg.max_inflight, requests=cfg.requests)
    if cfg.rate is not None and cfg.rate <= 0:
        p.error("--rate must be positive")
    try:
        result = trio.run(run_bench, cfg)
    except BenchError as e:
        print(f"sluice bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if cfg.out:
        write_run(result, cfg.out)
    print_table(result.summary)
    print_json(result.summary)
    return 0 if result.summary["requests"]["ok"] else 1


def sweep_main(argv: list[str] | None = None) -> int:
    """`sluice bench-sweep LABEL=URL... [--spawn LABEL:ARGS]... [flags]`; 0 unless one failed."""
    from .report import print_json
    from .sweep import check_labels, run_sweep

    p = sweep_parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    check_labels(p, args)
    _check(p, requests_per_stream=args.requests_per_stream, requests=args.requests)
    try:
        result = trio.run(run_sweep, args)
    except KeyboardInterrupt:
        return 130
    print_json(result)
    return 1 if result["errors"] else 0


def _check(p, **values: int | None) -> None:  # type: ignore[no-untyped-def]
    for name, v in values.items():
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
