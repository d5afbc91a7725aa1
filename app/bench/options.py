"""Command lines of `sluice bench` and `sluice bench-sweep`, and the settings they make.

Every flag maps to one `BenchConfig` field; the sweep reuses them for each point and
adds its own (targets, concurrencies, spawning). Defaults aim at the embedded model on
a small CPU: a run that nobody bounds still ends (100 requests, or 30 s for overload).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .workloads import NAMES


@dataclass(frozen=True)
class BenchConfig:
    url: str = "http://127.0.0.1:8000"
    label: str = ""
    workload: str = "shared-prefix"
    seed: int = 0
    concurrency: int = 16
    ramp_up_s: float = 0.0  # closed loop: stream k starts at k * ramp_up_s / concurrency
    rate: float | None = None  # requests/s: an open loop instead of a closed one
    duration_s: float | None = None
    requests: int | None = None
    start_index: int = 0
    warmup_requests: int = 0
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 300.0
    slo_ttft: float | None = 1.0
    slo_itl: float | None = None
    ignore_eos: bool = False
    temperature: float | None = 0.0
    max_tokens: int | None = None
    calibrate: bool = True
    words_per_token: float | None = None
    system_tokens: int | None = None
    long_prompt_tokens: int | None = None
    long_max_tokens: int | None = None
    short_streams: int = 4
    warmup_s: float = 10.0
    tail_s: float = 5.0
    overload_factor: float = 5.0
    capacity_concurrency: int | None = None
    capacity_requests: int | None = None
    capacity_duration_s: float = 120.0
    max_inflight: int = 512
    metrics_interval_s: float = 1.0
    adapters: int = 0  # spread requests over this many LoRA adapters of the model
    extra_body: dict | None = None  # more fields for every request body
    adapter_dist: str = "uniform"
    progress: bool = True
    out: Path | None = None

    def bounded(self) -> BenchConfig:
        """This config with a default bound when the command line gave none."""
        if self.requests is not None or self.duration_s is not None:
            return self
        if self.workload == "overload":
            return dataclasses.replace(self, duration_s=30.0)
        return dataclasses.replace(self, requests=100)


def _pair(text: str) -> tuple[str, str]:
    label, sep, url = text.partition("=")
    if not sep or not label or not url:
        raise argparse.ArgumentTypeError(f"expected LABEL=URL, got {text!r}")
    return label, url.rstrip("/")


def _spawn(text: str) -> tuple[str, str]:
    label, sep, args = text.partition(":")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"expected LABEL:ARGS, got {text!r}")
    return label, args


def _numbers(text: str, kind: type, low: float, example: str, what: str) -> list:
    """A comma- or space-separated list of `kind`, each at least `low` (argparse type)."""
    try:
        out = [kind(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {example}, got {text!r}")
    if not out or min(out) < low:
        raise argparse.ArgumentTypeError(f"{what} must be >= {low}, got {text!r}")
    return out


def _seconds(text: str) -> list[float]:
    return _numbers(text, float, 0, "seconds like 0,0.1,0.2", "targets")


def itl_label(target: float) -> str:
    """A sweep target's label for an ITL target (seconds; 0: off)."""
    return "itl-off" if target == 0 else f"itl-{target * 1000:g}ms"


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object, e.g. '{\"seed\": 1}'")
    return value


def _ints(text: str) -> list[int]:
    return _numbers(text, int, 1, "numbers like 1,4,8", "concurrencies")


def _common(p: argparse.ArgumentParser) -> None:
    """Flags that `bench` and `bench-sweep` share."""
    a = p.add_argument
    a("--seed", type=int, default=0, help="the workload's seed (default 0)")
    a("--ramp-up", dest="ramp_up_s", type=float, default=0.0, metavar="S",
      help="closed loop: start the streams evenly over S seconds instead of all at "
           "once, so TTFT reflects a steady state rather than one burst (default 0)")
    a("--duration", dest="duration_s", metavar="S", type=float, help="seconds to send for")
    a("--requests", type=int, help="requests to send (default 100 if --duration is unset)")
    a("--warmup-requests", type=int, default=0,
      help="requests sent one by one before measuring, not counted (e.g. to fill a cache)")
    a("--model", help="model name to ask for (default: the first of GET /v1/models)")
    a("--api-key", default=os.environ.get("SLUICE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
      help="Bearer key (default: $SLUICE_API_KEY or $OPENAI_API_KEY)")
    a("--timeout", dest="timeout_s", metavar="S", type=float, default=300.0,
      help="seconds one request may take (default 300)")
    a("--slo-ttft", type=float, default=1.0, help="SLO on TTFT, seconds (default 1.0)")
    a("--slo-itl", type=float, help="SLO on a request's p95 ITL, seconds (default: none)")
    a("--ignore-eos", action="store_true",
      help='send "ignore_eos": true so that answers run to max_tokens (vLLM, Sluice)')
    a("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    a("--max-tokens", type=int, help="fixed answer cap instead of the workload's range")
    a("--extra-body", type=_json_object, metavar="JSON",
      help='more request fields for every request, e.g. \'{"response_format": {"type": '
           '"json_object"}}\' (structured output\'s cost)')
    a("--no-calibrate", dest="calibrate", action="store_false",
      help="do not call POST /tokenize; assume 0.75 words a token")
    a("--words-per-token", type=float, help="use this ratio instead of calibrating")
    a("--system-tokens", type=int, help="shared-prefix: system prompt length (2000)")
    a("--adapters", type=int, default=0, metavar="N",
      help="spread the requests over N LoRA adapters of the model (the first N that "
           "GET /v1/models lists with it as parent), asked for by name; warm-up "
           "requests visit them in turn")
    a("--adapter-dist", choices=("uniform", "zipf"), default="uniform",
      help="how requests pick an adapter (zipf: adapter k gets 1/(k+1) of the share)")
    a("--metrics-interval", dest="metrics_interval_s", metavar="S", type=float, default=1.0,
      help="seconds between /metrics samples (default 1)")
    a("--out", type=Path, metavar="DIR",
      help="directory for the JSON, per-request records and PNG plots")
    a("--no-progress", dest="progress", action="store_false", help="no progress bar")


def bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sluice bench",
        description="Load-test an OpenAI-compatible server with streaming chat completions. "
                    "The last line of stdout is the result as one JSON object.")
    a = p.add_argument
    a("--url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    a("--label", default="", help="a name for this target in the report")
    a("--workload", choices=NAMES, default="shared-prefix")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=16,
                      help="closed loop: streams in flight (default 16)")
    load.add_argument("--rate", type=float,
                      help="open loop: Poisson arrivals a second (overload: skips measuring)")
    _common(p)
    a("--long-prompt-tokens", type=int, help="long-interference: the long prompt (6000)")
    a("--long-max-tokens", type=int, help="long-interference: its answer cap (16)")
    a("--short-streams", type=int, default=4, help="long-interference: short streams (4)")
    a("--warmup", dest="warmup_s", metavar="S", type=float, default=10.0,
      help="long-interference: seconds of short streams before the long prompt (10)")
    a("--tail", dest="tail_s", metavar="S", type=float, default=5.0,
      help="long-interference: seconds to go on after the long request ends (5)")
    a("--overload-factor", type=float, default=5.0,
      help="overload: arrival rate as a multiple of the measured capacity (5)")
    a("--capacity-concurrency", type=int,
      help="overload: closed-loop concurrency that measures capacity (--concurrency)")
    a("--capacity-requests", type=int,
      help="overload: requests that measure capacity (2 x that concurrency)")
    a("--capacity-duration", dest="capacity_duration_s", metavar="S", type=float, default=120.0,
      help="overload: at most this many seconds measuring capacity (120)")
    a("--max-inflight", type=int, default=512,
      help="open loop: arrivals beyond this many in flight are dropped (512)")
    return p


def sweep_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sluice bench-sweep",
        description="Run a closed-loop workload at several concurrencies against one or "
                    "more targets and chart throughput against latency.")
    a = p.add_argument
    a("targets", nargs="*", type=_pair, metavar="LABEL=URL",
      help="running servers, e.g. continuous=http://127.0.0.1:8000")
    a("--spawn", action="append", type=_spawn, default=[], metavar="LABEL:ARGS",
      help='start `sluice serve --host 127.0.0.1 --port P ARGS` for this target, e.g. '
           '"static:--scheduling static" (repeatable; one server at a time, measured once '
           'every step shape has compiled)')
    a("--itl-targets", type=_seconds, metavar="S,S,...",
      help="spawn one server per strict ITL target (`sluice serve --itl-target S "
           "--itl-strict SERVE_ARGS`; 0 = off), e.g. 0,0.1,0.15,0.2,0.3, and chart latency, "
           "throughput and refusals against the target")
    a("--serve-args", default="", metavar="ARGS",
      help="with --itl-targets: more `sluice serve` flags for each of those servers")
    a("--workload", choices=("shared-prefix", "mixed"), default="shared-prefix")
    a("--concurrencies", type=_ints, default=[1, 4, 8, 16, 32],
      help="comma-separated (default 1,4,8,16,32)")
    a("--requests-per-stream", type=int, default=4,
      help="without --requests/--duration: requests = this x concurrency (default 4)")
    a("--sluice", default=None,
      help="command that starts a server (default: the `sluice` beside this Python)")
    a("--spawn-timeout", type=float, default=900.0,
      help="seconds to wait for a spawned server's /health (default 900: it compiles)")
    a("--grace", type=float, default=30.0,
      help="seconds a spawned server may drain after SIGINT before it is killed (30)")
    _common(p)
    return p


def config_from(args: argparse.Namespace, **override: object) -> BenchConfig:
    """A BenchConfig from parsed flags (those it has no field for are ignored)."""
    names = {f.name for f in dataclasses.fields(BenchConfig)}
    values = {k: v for k, v in vars(args).items() if k in names and v is not None}
    values.update(override)
    return BenchConfig(**values)  # type: ignore[arg-type]
