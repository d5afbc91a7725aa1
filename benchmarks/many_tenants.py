"""Many tenants, each with its own long system prompt, against a small device KV pool: how
much a tiered KV cache (device -> host RAM -> disk) saves over dropping cached prefixes.

What it measures. When the device KV pool is full, the prefix cache must evict: without
tiers an evicted prompt prefix is gone and the tenant's next request computes its whole
~2,000-token system prompt again; with tiers the prefix moves down to host RAM (and on to
disk) and comes back up on the next hit. Per variant the script reports TTFT (p50, p95,
mean, from a request's first send, 429 waits included), prompt tokens the server computed
(prefix-cache tokens looked up minus tokens served from the cache, from /metrics), the
prefix hit rate, refusals (429s), wall time and output tok/s, every `sluice:kv_tier*`
metric the server exports (with labels; none if it has none yet), and the KV fields of
GET /v1/stats. The summary compares the host and disk variants with "off": the goal is a
TTFT p95 ratio <= 0.3 and a computed-prompt-tokens ratio <= 0.2.

The workload. T tenants (default 64), each with its own ~2,000-token system prompt (random
English words, deterministic from the seed, different per tenant); each request is its
tenant's system prompt plus its own 30-100-token question, a short answer (`max_tokens`
16, `ignore_eos`), a streaming chat completion. Tenants are taken round-robin (default)
or Zipf-distributed (`--order zipf --zipf-s 1.1`, seeded). A closed loop of C clients
(default 4) first sends a warm-up of one request a tenant (`--warmup-requests`, not
measured: the steady state is what a fleet lives in, and every variant computes each
prefix once), then the N measured requests (default 192) in that order; a 429 is waited
out as told (`retry-after-ms`, else `Retry-After`) and the same request is retried
(benchmarks/polite_load.py's clients).

Variants (`--variants`, default "off,host"), each on a fresh server that this script
starts from a TOML config it writes (config/default.toml with the `[[pools]]` KV keys
changed, the console off) and stops after:
- off:  `kv_cache_bytes` only (default 128 MiB: 684 pages of the default int8 pool, about
  five of the 2,000-token prefixes, four of them in use at a time), no tiers;
- host: plus `kv_host_bytes` (default 2 GiB);
- pool: no tiers, the host variant's `kv_host_bytes` added to `kv_cache_bytes` instead (on
  the CPU the device pool is host RAM too: the same memory, no copies);
- disk: a small `kv_host_bytes` (default 128 MiB) plus `kv_disk_dir` (a fresh temporary
  folder unless `--disk-dir`) and `kv_disk_bytes` (default 4 GiB). With `--restart`, the
  server is then stopped and started again on the same disk folder, and one request for
  each of the first K tenants (default 8), one at a time, measures the first requests
  after a restart, served from disk.

Compiled programs are shared between the variants' servers through SLUICE_JAX_CACHE
(`--jax-cache`, default ~/.cache/sluice/jax). A server is used once /health is 200 with no
step shape left to compile. It prints one JSON line per variant as each ends, then
{"summary": ...}. The temporary folder (configs, server logs, the disk tier, the batch
store) is removed after a success and kept after a failure or with `--keep-tmp`. It
imports nothing of Sluice (httpx, trio and benchmarks/polite_load.py's client).

    .venv/bin/python benchmarks/many_tenants.py [--tenants 64] [--requests 192]
        [--warmup-requests 64]
        [--concurrency 4] [--variants off,host,disk] [--order round-robin|zipf]
        [--zipf-s 1.1] [--max-tokens 16] [--kv-cache-bytes 134217728]
        [--host-bytes N] [--disk-host-bytes N] [--disk-bytes N] [--disk-dir DIR]
        [--restart] [--restart-tenants 8] [--tenants-with-keys] [--seed 0]

It takes tens of minutes on a 2-core CPU (each variant prefills up to T x 2,000 prompt
tokens, and each server start waits for its warm-up).

(About 700 lines: the config writer, the server's life, the polite clients and the
report, in one standalone script that imports nothing of Sluice.)
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx
import trio

# The polite client and its prompt text (a sibling script, beside this one on sys.path).
from polite_load import _text, polite_request

REPO = Path(__file__).resolve().parent.parent

# This vocabulary under SmolLM2's tokenizer is about one token a word (measured with
# /tokenize: 1,764 tokens for a 1,752-word system prompt in the chat template); the
# prompt's own first words and the template take about 25 tokens.
SYSTEM_OVERHEAD_TOKENS = 25


def _pct(values: list[float], q: float) -> float | None:
    """The q-th percentile, linear between ranks (numpy's default)."""
    if not values:
        return None
    a = sorted(values)
    k = (len(a) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return a[lo] + (a[hi] - a[lo]) * (k - lo)


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 4)


# ----------------------------------------------------------------------------- the workload
class Workload:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self._systems: dict[int, str] = {}
        rng = random.Random(f"order:{args.seed}")
        t, n = args.tenants, args.requests
        # The warm-up (not measured): each tenant in turn, so every prefix has been seen.
        self.warmup = [i % t for i in range(args.warmup_requests)]
        if args.order == "zipf":
            weights = [1.0 / (rank ** args.zipf_s) for rank in range(1, t + 1)]
            # which tenant gets which rank is shuffled too, so tenant 0 is not always hot
            ranked = list(range(t))
            rng.shuffle(ranked)
            measured = [ranked[i] for i in rng.choices(range(t), weights=weights, k=n)]
        else:
            measured = [i % t for i in range(n)]
        self.order = self.warmup + measured

    def system(self, tenant: int) -> str:
        if tenant not in self._systems:
            rng = random.Random(f"system:{self.args.seed}:{tenant}")
            self._systems[tenant] = (
                f"You are the assistant of company number {tenant}. Answer from these "
                "notes. " + _text(rng, max(0, self.args.system_tokens
                                           - SYSTEM_OVERHEAD_TOKENS)))
        return self._systems[tenant]

    def body(self, i: int, tenant: int, model: str) -> dict:
        rng = random.Random(f"request:{self.args.seed}:{i}")
        question = f"Question {i}: " + _text(rng, rng.randint(30, 100) - 5) + "?"
        return {"model": model, "stream": True, "max_tokens": self.args.max_tokens,
                "temperature": 0, "ignore_eos": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": self.system(tenant)},
                             {"role": "user", "content": question}]}

    def headers(self, tenant: int) -> dict[str, str]:
        if self.args.tenants_with_keys:
            return {"Authorization": f"Bearer key-{tenant}"}
        return {}


async def one_request(http: httpx.AsyncClient, body: dict, headers: dict[str, str]) -> dict:
    """One polite streaming request (benchmarks/polite_load.py's client): 429s waited out
    and retried; `ttft_s` from the first send to the first content delta."""
    rec = await polite_request(http, body, headers)
    rec["ttft_s"] = rec.pop("ttft_from_first_s")
    return rec


async def closed_loop(http: httpx.AsyncClient, work: Workload, model: str,
                      concurrency: int, start: int = 0, end: int | None = None) -> list[dict]:
    """Requests `work.order[start:end]` through `concurrency` clients."""
    records: list[dict] = []
    indices = itertools.count(start)
    n = len(work.order) if end is None else end

    async def client() -> None:
        for i in indices:
            if i >= n:
                return
            tenant = work.order[i]
            rec = await one_request(http, work.body(i, tenant, model), work.headers(tenant))
            rec["index"], rec["tenant"] = i, tenant
            records.append(rec)

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client)
    return sorted(records, key=lambda r: r["index"])


def summarize(records: list[dict], warmed: list[int] = ()) -> dict:
    ok = [r for r in records if r["status"] == "ok"]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    statuses: dict[str, int] = {}
    for r in records:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    wall = (max(r["end"] for r in records) - min(r["start"] for r in records)) if records else 0
    tokens = sum(r["tokens"] for r in ok)
    prompts = [r["prompt_tokens"] for r in ok if r.get("prompt_tokens")]
    seen: set[int] = set(warmed)
    first_of_tenant, repeat = [], []  # a tenant's first request: its prefix is not cached
    for r in records:
        first = r["tenant"] not in seen
        seen.add(r["tenant"])
        if r["status"] == "ok" and r["ttft_s"] is not None:
            (first_of_tenant if first else repeat).append(r["ttft_s"])
    return {
        "requests": len(records), "ok": len(ok), "statuses": statuses,
        "refusals": sum(r["refusals"] for r in records),
        "ttft_p50_s": _r(_pct(ttft, 50)), "ttft_p95_s": _r(_pct(ttft, 95)),
        "ttft_mean_s": _r(sum(ttft) / len(ttft)) if ttft else None,
        "ttft_max_s": _r(max(ttft)) if ttft else None,
        "ttft_first_of_tenant_p50_s": _r(_pct(first_of_tenant, 50)),
        "ttft_repeat_p50_s": _r(_pct(repeat, 50)),
        "ttft_repeat_p95_s": _r(_pct(repeat, 95)),
        "prompt_tokens_mean": round(sum(prompts) / len(prompts), 1) if prompts else None,
        "output_tokens": tokens, "wall_s": round(wall, 2),
        "output_tok_s": round(tokens / wall, 2) if wall else 0.0,
    }


# ----------------------------------------------------------------------------- metrics
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text -> {name: {label string: value}}."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = ",".join(f'{k}="{v}"' for k, v in _LABEL.findall(m.group(2) or ""))
        out.setdefault(m.group(1), {})[labels] = value
    return out


def _sum(metrics: dict, name: str) -> float:
    return sum(metrics.get(name, {}).values())


def tier_samples(metrics: dict) -> dict[str, float]:
    return {f"{name}{{{labels}}}" if labels else name: value
            for name, samples in sorted(metrics.items()) if name.startswith("sluice:kv_tier")
            for labels, value in sorted(samples.items())}


def metric_delta(before: dict, after: dict) -> dict:
    queries = _sum(after, "sluice:prefix_cache_queries_total") - \
        _sum(before, "sluice:prefix_cache_queries_total")
    hits = _sum(after, "sluice:prefix_cache_hits_total") - \
        _sum(before, "sluice:prefix_cache_hits_total")
    t0, t1 = tier_samples(before), tier_samples(after)
    return {
        "prefix_cache_queries": int(queries), "prefix_cache_hits": int(hits),
        "prompt_tokens_computed": int(queries - hits),
        "prefix_hit_rate": round(hits / queries, 4) if queries else None,
        "preemptions": int(_sum(after, "sluice:num_preemptions_total")
                           - _sum(before, "sluice:num_preemptions_total")),
        "kv_tier": t1,
        "kv_tier_delta": {k: v - t0.get(k, 0.0) for k, v in t1.items()
                          if v - t0.get(k, 0.0) != 0},
    }


def stats_kv(stats: Any) -> dict:
    """The KV parts of GET /v1/stats, whatever the server's version has: top-level keys
    naming kv/tier, and each pool's (per-pool series left out)."""
    if not isinstance(stats, dict):
        return {}
    out: dict[str, Any] = {k: v for k, v in stats.items()
                           if "kv" in k.lower() or "tier" in k.lower()}
    pools = []
    for p in stats.get("pools") or []:
        if not isinstance(p, dict):
            continue
        keep = {k: v for k, v in p.items() if "kv" in k.lower() or "tier" in k.lower()
                or k == "prefix_cache_hit_rate"}
        if isinstance(keep.get("kv_pages"), dict):
            keep["kv_pages"].pop("audit_problems", None)
        pools.append({"name": p.get("name"), **keep})
    if pools:
        out["pools"] = pools
    return out


# ----------------------------------------------------------------------------- TOML
def _toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k, ensure_ascii=False)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # JSON's escapes are TOML basic string's
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _is_table_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def toml_dumps(data: dict, _prefix: str = "") -> str:
    """A small TOML writer for what tomllib reads from a config: scalars and arrays,
    tables, arrays of tables (nested ones included)."""
    lines: list[str] = []
    later: list[str] = []
    for k, v in data.items():
        path = f"{_prefix}.{_toml_key(k)}" if _prefix else _toml_key(k)
        if isinstance(v, dict):
            later.append(f"\n[{path}]\n" + toml_dumps(v, path))
        elif _is_table_list(v):
            for item in v:
                later.append(f"\n[[{path}]]\n" + toml_dumps(item, path))
        else:
            lines.append(f"{_toml_key(k)} = {_toml_value(v)}")
    return "\n".join(lines) + ("\n" if lines else "") + "".join(later)


def write_config(args: argparse.Namespace, variant: str, folder: Path, port: int,
                 disk_dir: Path | None) -> tuple[Path, dict]:
    with open(args.base_config, "rb") as f:
        cfg = tomllib.load(f)
    server = cfg.setdefault("server", {})
    server.update(host="127.0.0.1", port=port, console=False)
    cfg.setdefault("batches", {})["data_dir"] = str(folder / "data")  # not the user's
    kv: dict[str, Any] = {"kv_cache_bytes": args.kv_cache_bytes}
    # The off variant writes no tier key at all (a server without tiers refuses them).
    if variant == "host":
        kv["kv_host_bytes"] = args.host_bytes
    elif variant == "pool":  # the host tier's RAM given to the device pool instead
        kv["kv_cache_bytes"] = args.kv_cache_bytes + args.host_bytes
    elif variant == "disk":
        assert disk_dir is not None
        kv.update(kv_host_bytes=args.disk_host_bytes, kv_disk_dir=str(disk_dir),
                  kv_disk_bytes=args.disk_bytes)
    for pool in cfg.get("pools") or []:
        pool.update(kv)
    if args.tenants_with_keys:
        cfg["tenants"] = [{"name": f"t{i}", "api_key_sha256":
                           hashlib.sha256(f"key-{i}".encode()).hexdigest()}
                          for i in range(args.tenants)]
    path = folder / f"{variant}.toml"
    text = toml_dumps(cfg)
    tomllib.loads(text)  # what we wrote reads back
    path.write_text(text)
    return path, kv


# ----------------------------------------------------------------------------- the server
class ServerError(Exception):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(log: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Server:
    def __init__(self, args: argparse.Namespace, config: Path, port: int, log: Path) -> None:
        self.args, self.config, self.port, self.log = args, config, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc: trio.Process | None = None
        self._log_file = None

    async def start(self) -> float:
        """Start it and wait until it is ready with every shape compiled; the seconds."""
        cmd = [self.args.sluice, "serve", "--config", str(self.config), "--port",
               str(self.port)]
        env = {**os.environ, "SLUICE_JAX_CACHE": str(self.args.jax_cache)}
        self._log_file = open(self.log, "ab")
        self._log_file.write(f"$ {' '.join(cmd)}\n".encode())
        self._log_file.flush()
        t0 = time.monotonic()
        self.proc = await trio.lowlevel.open_process(
            cmd, stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env)
        async with httpx.AsyncClient(base_url=self.url, timeout=5.0, trust_env=False) as h:
            with trio.move_on_after(self.args.ready_timeout):
                while True:
                    self.check_alive()
                    try:
                        r = await h.get("/health")
                        if r.status_code == 200 and r.json().get("warmup_remaining_shapes") == 0:
                            return time.monotonic() - t0
                    except (httpx.HTTPError, ValueError):
                        pass  # not listening yet
                    await trio.sleep(1.0)
        raise ServerError(f"{self.url}/health was not 200 with warmup_remaining_shapes 0 "
                          f"within {self.args.ready_timeout} s; log {self.log} ends:\n"
                          f"{_tail(self.log)}")

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise ServerError(f"the server exited with {self.proc.returncode}; its log "
                              f"({self.log}) ends:\n{_tail(self.log)}")

    async def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGINT, up to grace_s to exit, then SIGKILL."""
        proc = self.proc
        if proc is not None:
            with trio.CancelScope(shield=True):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
                    with trio.move_on_after(grace_s):
                        await proc.wait()
                if proc.poll() is None:
                    proc.kill()
                    await proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return proc.returncode if proc is not None else None


async def _get_metrics(http: httpx.AsyncClient) -> dict:
    r = await http.get("/metrics")
    r.raise_for_status()
    return parse_metrics(r.text)


async def _get_stats(http: httpx.AsyncClient, headers: dict) -> Any:
    try:
        r = await http.get("/v1/stats", headers=headers)
        return r.json() if r.status_code == 200 else {"status": r.status_code}
    except (httpx.HTTPError, ValueError) as e:
        return {"error": repr(e)}


def _client(url: str, args: argparse.Namespace) -> httpx.AsyncClient:
    conns = args.concurrency + 8
    return httpx.AsyncClient(base_url=url, timeout=args.timeout, trust_env=False,
                             limits=httpx.Limits(max_connections=conns,
                                                 max_keepalive_connections=conns))


async def _model(http: httpx.AsyncClient, work: Workload) -> str:
    if work.args.model:
        return work.args.model
    r = await http.get("/v1/models", headers=work.headers(0))
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def _system_tokens(http: httpx.AsyncClient, work: Workload, model: str) -> int | None:
    """Tenant 0's system prompt in the chat template, in tokens (None if /tokenize fails)."""
    try:
        r = await http.post("/tokenize", headers=work.headers(0), json={
            "model": model, "messages": [{"role": "system", "content": work.system(0)}]})
        return r.json().get("count") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def note(msg: str) -> None:
    print(f"[many_tenants {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


async def run_variant(args: argparse.Namespace, variant: str, work: Workload,
                      tmp: Path) -> dict:
    folder = tmp / variant
    folder.mkdir(parents=True, exist_ok=True)
    disk_dir = None
    if variant == "disk":
        disk_dir = Path(args.disk_dir) if args.disk_dir else folder / "kv-disk"
        disk_dir.mkdir(parents=True, exist_ok=True)
    port = args.port or free_port()
    config, kv = write_config(args, variant, folder, port, disk_dir)
    log = folder / "server.log"
    out: dict[str, Any] = {"variant": variant, **kv, "tenants": args.tenants,
                           "concurrency": args.concurrency, "order": args.order,
                           "max_tokens": args.max_tokens, "config": str(config),
                           "server_log": str(log)}
    server = Server(args, config, port, log)
    try:
        note(f"{variant}: starting the server on port {port} (log {log})")
        out["server_ready_s"] = round(await server.start(), 1)
        note(f"{variant}: ready after {out['server_ready_s']} s; "
             f"{len(work.order)} requests, {args.concurrency} clients")
        async with _client(server.url, args) as http:
            model = await _model(http, work)
            out["system_prompt_tokens"] = await _system_tokens(http, work, model)
            warm = len(work.warmup)
            if warm:
                note(f"{variant}: {warm} warm-up requests (not measured)")
                await closed_loop(http, work, model, args.concurrency, 0, warm)
            before = await _get_metrics(http)
            records = await closed_loop(http, work, model, args.concurrency, warm)
            server.check_alive()
            after = await _get_metrics(http)
            out.update(model=model, warmup_requests=warm,
                       **summarize(records, work.warmup), **metric_delta(before, after))
            out["stats_kv"] = stats_kv(await _get_stats(http, work.headers(0)))
        if variant == "disk" and args.restart:
            out["restart"] = await restart(args, work, server, model)
    except Exception as e:
        if not isinstance(e, ServerError) and server.proc is not None \
                and server.proc.poll() is not None:
            print(f"server log {log} ends:\n{_tail(log)}", file=sys.stderr, flush=True)
        raise
    finally:
        code = await server.stop(args.stop_grace)
        note(f"{variant}: server stopped ({code})")
    return out


async def restart(args: argparse.Namespace, work: Workload, server: Server,
                  model: str) -> dict:
    """Stop the server, start it again on the same disk folder, and send one request for
    each of the first K tenants, one at a time: their prefixes can only come from disk."""
    code = await server.stop(args.stop_grace)
    note(f"disk: server stopped ({code}) for the restart; starting it again")
    out: dict[str, Any] = {"stop_returncode": code,
                           "server_ready_s": round(await server.start(), 1)}
    k = min(args.restart_tenants, args.tenants)
    async with _client(server.url, args) as http:
        before = await _get_metrics(http)
        records = []
        for t in range(k):
            i = len(work.order) + t  # a question not asked before
            rec = await one_request(http, work.body(i, t, model), work.headers(t))
            rec["index"], rec["tenant"] = i, t
            records.append(rec)
        server.check_alive()
        after = await _get_metrics(http)
        stats = await _get_stats(http, work.headers(0))
    ttft = [r["ttft_s"] for r in records if r["status"] == "ok" and r["ttft_s"] is not None]
    out.update(tenants=k, ttft_s=[_r(r["ttft_s"]) for r in records],
               statuses=[r["status"] for r in records],
               refusals=sum(r["refusals"] for r in records),
               ttft_p50_s=_r(_pct(ttft, 50)), ttft_max_s=_r(max(ttft)) if ttft else None,
               ttft_mean_s=_r(sum(ttft) / len(ttft)) if ttft else None,
               **metric_delta(before, after), stats_kv=stats_kv(stats))
    return out


SUMMARY_KEYS = ("ttft_p50_s", "ttft_p95_s", "ttft_mean_s", "requests", "refusals",
                "prompt_tokens_computed", "prefix_hit_rate", "wall_s", "output_tok_s")


def summary(results: dict[str, dict]) -> dict:
    out: dict[str, Any] = {}
    off = results.get("off")
    for name, r in results.items():
        s = {k: r.get(k) for k in SUMMARY_KEYS}
        if "error" in r:
            s["error"] = r["error"]
        if off is not None and name != "off" and "error" not in off and "error" not in r:
            s["ttft_p95_ratio"] = _ratio(r.get("ttft_p95_s"), off.get("ttft_p95_s"))
            s["prompt_tokens_ratio"] = _ratio(r.get("prompt_tokens_computed"),
                                              off.get("prompt_tokens_computed"))
            s["goal_met"] = (s["ttft_p95_ratio"] is not None and s["ttft_p95_ratio"] <= 0.3
                             and s["prompt_tokens_ratio"] is not None
                             and s["prompt_tokens_ratio"] <= 0.2)
        if "restart" in r:
            s["restart_ttft_p50_s"] = r["restart"].get("ttft_p50_s")
            s["restart_prefix_hit_rate"] = r["restart"].get("prefix_hit_rate")
        out[name] = s
    out["goal"] = {"ttft_p95_ratio_max": 0.3, "prompt_tokens_ratio_max": 0.2}
    return out


async def run(args: argparse.Namespace) -> int:
    work = Workload(args)
    tmp = Path(tempfile.mkdtemp(prefix="sluice-many-tenants-"))
    note(f"temporary folder {tmp}")
    results: dict[str, dict] = {}
    failed = False
    for variant in args.variants:
        try:
            res = await run_variant(args, variant, work, tmp)
        except (ServerError, httpx.HTTPError, OSError) as e:
            failed = True
            res = {"variant": variant, "error": f"{type(e).__name__}: {e}"}
            print(res["error"], file=sys.stderr, flush=True)
        results[variant] = res
        print(json.dumps(res), flush=True)
    print(json.dumps({"summary": summary(results)}), flush=True)
    if not args.keep_tmp and not failed:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        note(f"kept {tmp} (server logs, configs)")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--tenants", type=int, default=64)
    ap.add_argument("--requests", type=int, default=192, help="measured requests")
    ap.add_argument("--warmup-requests", type=int, default=None,
                    help="requests before the measured ones, each tenant in turn, not "
                    "counted (default: one a tenant)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--variants", default="off,host",
                    help="comma-separated, of off, host, disk, pool (default: off,host)")
    ap.add_argument("--order", choices=("round-robin", "zipf"), default="round-robin")
    ap.add_argument("--zipf-s", type=float, default=1.1)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=2000,
                    help="about this many tokens of system prompt a tenant")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-bytes", type=int, default=128 * 2**20,
                    help="the device KV pool (default 128 MiB)")
    ap.add_argument("--host-bytes", type=int, default=2 * 2**30,
                    help="kv_host_bytes of the host variant (default 2 GiB)")
    ap.add_argument("--disk-host-bytes", type=int, default=128 * 2**20,
                    help="kv_host_bytes of the disk variant (default 128 MiB)")
    ap.add_argument("--disk-bytes", type=int, default=4 * 2**30,
                    help="kv_disk_bytes of the disk variant (default 4 GiB)")
    ap.add_argument("--disk-dir", default=None,
                    help="kv_disk_dir of the disk variant (default: a fresh temporary "
                    "folder; a given one is used as it is, not emptied)")
    ap.add_argument("--restart", action="store_true",
                    help="disk variant: restart the server on the same disk folder and "
                    "time one request for each of the first --restart-tenants tenants")
    ap.add_argument("--restart-tenants", type=int, default=8)
    ap.add_argument("--tenants-with-keys", action="store_true",
                    help="configure a [[tenants]] entry a tenant (t{i}, key key-{i}) and "
                    "send its key")
    ap.add_argument("--base-config", default=str(REPO / "config" / "default.toml"))
    ap.add_argument("--jax-cache", default=os.path.expanduser("~/.cache/sluice/jax"),
                    help="SLUICE_JAX_CACHE for the servers (compiles shared between them)")
    ap.add_argument("--sluice", default=None,
                    help="the sluice executable (default: the one beside this Python)")
    ap.add_argument("--port", type=int, default=0, help="default: a free port")
    ap.add_argument("--model", default=None, help="default: the server's first model")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--stop-grace", type=float, default=30.0)
    ap.add_argument("--timeout", type=float, default=600.0, help="a request's HTTP timeout")
    ap.add_argument("--keep-tmp", action="store_true",
                    help="keep the temporary folder (configs, server logs) after a success")
    args = ap.parse_args(argv)
    if args.warmup_requests is None:
        args.warmup_requests = args.tenants
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in ("off", "host", "disk", "pool")]
    if bad or not args.variants:
        ap.error(f"--variants: unknown {bad}; choose from off, host, disk, pool")
    if args.sluice is None:
        script = Path(sys.executable).parent / "sluice"
        args.sluice = str(script) if script.exists() else str(REPO / ".venv" / "bin" / "sluice")
    return trio.run(run, args)


if __name__ == "__main__":
    sys.exit(main())
