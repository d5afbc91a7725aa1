"""The soak: many requests of every kind against one server; does anything leak or hang?

N requests (default 10,000, short answers) from a fixed number of concurrent clients
(default 16), each request drawn from (seed, index) alone: a random tenant (its own API
key) and `priority`, chat or completions, streamed or not, random temperature / top_p /
top_k / seed, some with `logprobs` / `top_logprobs`, some with stop strings, a few with
``n = 2``, about half after one of two shared system prompts (the prefix cache is
exercised). A quarter of the clients disconnect on purpose: right after sending (before
the first byte), during the prefill of a long prompt, or after the k-th streamed event.
One in a hundred reads its stream very slowly. Every answer that arrives is checked
(finish reasons, `n` choices, logprobs where asked, usage where asked, ``[DONE]``). A
client refused with 429 waits as told (at most 2 s) before its next request.

What it reports (one JSON object on stdout, and in ``--out``; progress on stderr):

- requests by outcome (and by tenant, and 429s by reason), and where the disconnects
  actually landed (before the response's headers, before content, after content, or not
  at all: the answer or refusal came first);
- hung streams: a read that waited more than ``--hung-s`` (30 s) for the server (twice
  that for a response not streamed, which comes after the whole answer). Must be 0 (such
  a request is given up and counted);
- the server at rest after the warm-up of a few hundred requests ("start"), after each
  of ``--checkpoints`` equal slices of the rest (2: "middle" and "end"). At each the load
  pauses, every client connection is closed and /v1/stats is polled until nothing runs
  or waits and no tenant holds a lease; then: KV pages in use (must be 0), the page
  allocator's audit of its books against the live page tables (`PageAllocator.audit`:
  reference counts, free + cached + in use == total, the prefix cache's keys; must be
  empty), the process's resident memory and open descriptors (/proc; growth from start to
  end must stay under ``--max-growth-pct``, 5%);
- the process every ``--sample-s`` under load, and the RSS trend (medians of the first
  and last quarter after the warm-up: a leak moves it, allocator noise does not);
- TTFT and ITL (p50 / p95 / p99 / max) of the streamed requests that completed (slow
  readers left out: their gaps are their own), end to end of the others.

By default it starts ``sluice serve`` itself on a free port with the default preset (or
``--config``, and ``--model`` / ``--server-args``) plus four tenants whose keys it makes
up, waits until the server is ready and has compiled every shape (background compiles
would grow its memory), and stops it at the end. ``--url`` soaks a running server instead
(``--api-key`` for each key to use, ``--pid`` to read its memory and descriptors). The
exit status is 0 when every check passed.

(About 760 lines: the request mix, the client that disconnects, reads slowly and checks
every answer, the rest points and the report are one command's parts.)

    .venv/bin/python benchmarks/soak.py [--requests 10000] [--concurrency 16] [--seed 0]
        [--config BASE.toml] [--model SRC] [--server-args '...'] [--workdir DIR]
        [--url URL --api-key KEY... [--pid PID]] [--out FILE]

On the embedded model on a 2-core CPU, 500 requests take ~2 min (~4 requests/s with the
server saturated), so the default 10,000 take ~40 min.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import msgspec
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.bench.spawn import free_port, sluice_command, stop, wait_healthy  # noqa: E402
from app.bench.workloads import DEFAULT_WORDS_PER_TOKEN, calibrate, words  # noqa: E402
from config.settings import DEFAULT_PRESET, load_settings  # noqa: E402

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
STOPS = (".", "\n", " the", ",", "!")
SYSTEM_TOKENS = 100  # each shared system prompt, roughly
# Disconnect moments, each with its share of all requests (together 25%).
DISCONNECTS = (("before_first_byte", 0.08), ("mid_prefill", 0.08), ("mid_decode", 0.09))
SLOW_SHARE = 0.01


@dataclass(frozen=True)
class Tenant:
    name: str
    priority: int
    share: float  # of the requests
    config: dict[str, Any] = field(default_factory=dict)  # TenantConfig's other fields
    key: str = ""


# Four tenants: classes 0-2, fair-share weights, one concurrency limit, one token quota and
# a running cap (both produce some 429s / waits), one sharing its prefix cache.
TENANTS = (
    Tenant("gold", 0, 0.35, {"weight": 3.0}),
    Tenant("silver", 1, 0.25, {"max_concurrency": 6}),
    Tenant("bronze", 2, 0.20, {"tokens_per_minute": 12000, "max_running": 4}),
    Tenant("shared", 1, 0.20, {"weight": 2.0, "share_prefix_cache": True}),
)
# Queued requests are shed before a read could wait `hung_s` on them.
TENANT_QUEUE_DEADLINE_S = 20.0


# -- the requests -----------------------------------------------------------------------------
@dataclass
class Plan:
    """One request, drawn from (seed, index) alone."""

    index: int
    tenant: Tenant
    chat: bool
    stream: bool
    body: dict[str, Any]
    n: int = 1
    shared_prefix: bool = False  # after one of the shared system prompts
    logprobs: bool = False
    include_usage: bool = False
    disconnect: str | None = None  # one of DISCONNECTS' names
    cancel_after_s: float | None = None  # before_first_byte / mid_prefill: leave then
    cut_after_events: int = 0  # mid_decode: give up after this many content events
    slow_read_s: float = 0.0  # > 0: a slow reader, sleeping this long between reads

    @property
    def path(self) -> str:
        return CHAT_PATH if self.chat else COMPLETIONS_PATH


class Requests:
    """The soak's request stream for one model: `plan(i)` depends only on (seed, i)."""

    def __init__(self, seed: int, model: str, tenants: tuple[Tenant, ...],
                 words_per_token: float = DEFAULT_WORDS_PER_TOKEN) -> None:
        self.seed, self.model, self.tenants = seed, model, tenants
        self.wpt = words_per_token
        rng = random.Random(f"soak:{seed}:system")
        self.systems = [f"You are assistant {k} of a shipping company; be brief. "
                        + words(rng, self.words(SYSTEM_TOKENS)) for k in range(2)]

    def words(self, tokens: int) -> int:
        return max(1, round(tokens * self.wpt))

    def plan(self, i: int) -> Plan:
        rng = random.Random(f"soak:{self.seed}:{i}")
        tenant = rng.choices(self.tenants, weights=[t.share for t in self.tenants])[0]
        chat = rng.random() < 0.7
        slow = rng.random() < SLOW_SHARE
        disconnect, r = None, rng.random()
        for name, share in DISCONNECTS:
            if r < share and not slow:
                disconnect = name
                break
            r -= share
        stream = slow or disconnect == "mid_decode" or rng.random() < 0.7
        if slow:
            max_tokens = rng.randint(16, 40)
        elif disconnect == "mid_decode":
            max_tokens = rng.randint(8, 20)
        else:
            max_tokens = rng.randint(4, 16)
        # Prompts of 20-160 tokens, or a shared system prompt and a 10-60-token question;
        # a long prompt (several prefill chunks) to leave in the middle of.
        shared = disconnect != "mid_prefill" and rng.random() < 0.55
        system = self.systems[rng.randrange(2)] if shared else None
        own = rng.randint(300, 700) if disconnect == "mid_prefill" else \
            rng.randint(10, 60) if shared else rng.randint(20, 160)
        text = f"Request {i}: " + words(rng, self.words(own), end="?")

        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens,
                                "stream": stream}
        if chat:
            body["messages"] = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": text}]
        else:
            body["prompt"] = f"{system}\n\n{text}\n" if system else text
        # Sampling: greedy or not, each knob on or off.
        body["temperature"] = 0.0 if rng.random() < 0.3 else round(rng.uniform(0.2, 1.3), 2)
        if rng.random() < 0.4:
            body["top_p"] = round(rng.uniform(0.5, 1.0), 2)
        if rng.random() < 0.3:
            body["top_k"] = rng.randint(1, 50)
        if rng.random() < 0.5:
            body["seed"] = rng.randrange(2**31)
        logprobs = rng.random() < 0.15
        if logprobs and chat:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 5)
        elif logprobs:
            body["logprobs"] = rng.randint(0, 5)
        if rng.random() < 0.2:
            body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
        n = 2 if rng.random() < 0.05 else 1
        if n > 1:
            body["n"] = n
        if rng.random() < 0.6:
            body["priority"] = tenant.priority + rng.randint(0, 2)
        include_usage = stream and rng.random() < 0.5
        if include_usage:
            body["stream_options"] = {"include_usage": True}

        plan = Plan(i, tenant, chat, stream, body, n, shared, logprobs, include_usage,
                    disconnect)
        if disconnect == "before_first_byte":
            plan.cancel_after_s = rng.uniform(0.0005, 0.02)
        elif disconnect == "mid_prefill":
            plan.cancel_after_s = rng.uniform(0.05, 0.8)
        elif disconnect == "mid_decode":
            plan.cut_after_events = rng.randint(1, 3)
        if slow:
            plan.slow_read_s = rng.uniform(0.3, 1.0)
        return plan


# -- one request ------------------------------------------------------------------------------
class Hung(Exception):
    """A read waited longer than the hung limit for the server."""


@dataclass
class Record:
    index: int
    tenant: str
    stream: bool
    slow: bool
    disconnect: str | None  # the plan's disconnect moment
    outcome: str = "pending"
    # Where a planned disconnect landed: before the response's headers, after them but
    # before any content, or after content; None: it did not (the answer came first).
    cut: str | None = None
    http_status: int | None = None
    ttft_s: float | None = None  # streamed: send -> first content-bearing event
    e2e_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)  # between content-bearing events
    max_wait_s: float = 0.0  # the longest a read waited for the server
    retry_after_s: float | None = None
    error: str | None = None


_decode = msgspec.json.Decoder().decode
# What an answer of the wrong shape raises while it is read (an "invalid" outcome).
_MALFORMED = (msgspec.DecodeError, KeyError, TypeError, AttributeError)


async def _read(it: AsyncIterator[bytes], rec: Record, hung_s: float, t0: float) -> bytes:
    """The next bytes of the body (b"" at its end), timing the wait; `Hung` past hung_s."""
    with trio.move_on_after(hung_s) as guard:
        try:
            data = await it.__anext__()
        except StopAsyncIteration:
            data = b""
    rec.max_wait_s = max(rec.max_wait_s, time.perf_counter() - t0)
    if guard.cancelled_caught:
        raise Hung
    return data


async def run_one(http: httpx.AsyncClient, plan: Plan, hung_s: float) -> Record:
    """Send one planned request and fill its record (the outcome is always set).

    A read that waits more than `hung_s` for the server is a hung stream. A response that
    is not streamed comes in one piece after the whole answer (queue, prefill, every
    token): it gets twice that before it counts as hung."""
    if not plan.stream:
        hung_s *= 2
    rec = Record(plan.index, plan.tenant.name, plan.stream, bool(plan.slow_read_s),
                 plan.disconnect)
    headers = {"Content-Type": "application/json"}
    if plan.tenant.key:
        headers["Authorization"] = f"Bearer {plan.tenant.key}"
    request = http.build_request("POST", plan.path, content=msgspec.json.encode(plan.body),
                                 headers=headers)
    start = time.perf_counter()
    with trio.CancelScope() as scope:  # our disconnect: cancelling it drops the connection
        if plan.cancel_after_s is not None:
            scope.deadline = trio.current_time() + plan.cancel_after_s
        try:
            with trio.move_on_after(hung_s) as guard:
                r = await http.send(request, stream=True)
            if guard.cancelled_caught:
                rec.max_wait_s = hung_s
                raise Hung
            rec.max_wait_s = time.perf_counter() - start
            try:
                rec.http_status = r.status_code
                rec.cut = "before_content"
                if plan.disconnect == "before_first_byte":
                    scope.cancel()  # the answer began: go now
                    await trio.lowlevel.checkpoint()
                if r.status_code != 200:
                    await _refused(r, rec, hung_s)
                elif plan.stream:
                    await _read_stream(r, plan, rec, hung_s, start, scope)
                else:
                    await _read_body(r, plan, rec, hung_s)
            finally:
                with trio.CancelScope(shield=True):
                    await r.aclose()
        except Hung:
            rec.outcome = "hung"
            rec.error = f"a read waited more than {hung_s} s for the server"
        except httpx.TimeoutException as e:
            rec.outcome, rec.error = "timeout", f"{type(e).__name__}: {e}"
        except httpx.HTTPError as e:
            rec.outcome, rec.error = "transport_error", f"{type(e).__name__}: {e}"
    rec.e2e_s = time.perf_counter() - start
    if scope.cancelled_caught:
        rec.outcome = "disconnected"
        rec.cut = rec.cut or "before_headers"
    else:
        rec.cut = None  # it ended (answered or refused) before the moment we meant to leave
    return rec


async def _refused(r: httpx.Response, rec: Record, hung_s: float) -> None:
    body = b""
    it = r.aiter_bytes()
    while data := await _read(it, rec, hung_s, time.perf_counter()):
        body += data
    rec.error = body[:300].decode("utf-8", "replace")
    try:  # the OpenAI error shape: keep its code (a 429's reason), else the text
        err = _decode(body)["error"]
        rec.error = err.get("code") or err.get("type") or rec.error
    except (msgspec.DecodeError, KeyError, TypeError, AttributeError):
        pass
    s = r.status_code
    rec.outcome = ("rate_limited" if s == 429 else "unavailable" if s == 503
                   else "http_4xx" if s < 500 else "http_5xx")
    if s == 429:
        ms = r.headers.get("retry-after-ms")
        try:
            rec.retry_after_s = float(ms) / 1000 if ms else float(r.headers["retry-after"])
        except (KeyError, ValueError):
            rec.retry_after_s = None


def _choices_ok(plan: Plan, finished: dict[int, str]) -> str | None:
    """What is wrong with a finished answer's finish reasons (index -> reason), or None."""
    if sorted(finished) != list(range(plan.n)):
        return f"finish_reason for choices {sorted(finished)}, expected {plan.n}"
    bad = {k: v for k, v in finished.items() if v not in ("stop", "length")}
    if bad:
        return f"unexpected finish_reason {bad}"
    return None


async def _read_body(r: httpx.Response, plan: Plan, rec: Record, hung_s: float) -> None:
    body = b""
    it = r.aiter_bytes()
    while data := await _read(it, rec, hung_s, time.perf_counter()):
        body += data
    try:
        choices = _decode(body)["choices"]
        finished = {c["index"]: c["finish_reason"] for c in choices}
        problem = _choices_ok(plan, finished)
        if problem is None and plan.logprobs:
            for c in choices:
                text = c["message"]["content"] if plan.chat else c["text"]
                if text and c.get("logprobs") is None:
                    problem = f"no logprobs in choice {c['index']}"
    except _MALFORMED as e:
        problem = f"malformed answer: {type(e).__name__}: {e}"
    rec.outcome, rec.error = ("ok", None) if problem is None else ("invalid", problem)


async def _read_stream(r: httpx.Response, plan: Plan, rec: Record, hung_s: float,
                       start: float, scope: trio.CancelScope) -> None:
    buf, done, usage, logprobs = b"", False, False, False
    finished: dict[int, str] = {}
    content_events = 0
    last: float | None = None
    it = r.aiter_bytes()
    while True:
        data = await _read(it, rec, hung_s, time.perf_counter())
        if not data:
            break
        now = time.perf_counter() - start
        buf = (buf + data).replace(b"\r\n", b"\n")
        while (end := buf.find(b"\n\n")) >= 0:
            event, buf = buf[:end], buf[end + 2:]
            payload = b"\n".join(line[5:].removeprefix(b" ") for line in event.split(b"\n")
                                 if line.startswith(b"data:"))
            if not payload:
                continue
            if payload == b"[DONE]":
                done = True
                continue
            content = False
            try:
                obj = _decode(payload)
                if obj.get("error") is not None:
                    err = obj["error"]
                    rec.outcome = "error_event"
                    rec.error = str(err.get("message", err) if isinstance(err, dict) else err)
                    return
                usage = usage or obj.get("usage") is not None
                for c in obj.get("choices") or ():
                    text = (c.get("delta") or {}).get("content") if plan.chat else c["text"]
                    content = content or bool(text)
                    logprobs = logprobs or c.get("logprobs") is not None
                    if c.get("finish_reason"):
                        finished[c["index"]] = c["finish_reason"]
            except _MALFORMED as e:
                rec.outcome, rec.error = "invalid", f"bad SSE event: {type(e).__name__}: {e}"
                return
            if content:
                content_events += 1
                if last is None:
                    rec.ttft_s = now
                else:
                    rec.gaps_s.append(now - last)
                last = now
                rec.cut = "after_content"
                if plan.disconnect in ("mid_prefill", "mid_decode") and (
                        content_events >= max(1, plan.cut_after_events)):
                    scope.cancel()  # mid_prefill: the prompt was quicker than our delay
                    await trio.lowlevel.checkpoint()
        if plan.slow_read_s:
            await trio.sleep(plan.slow_read_s)
    problem = None if done else "the stream ended before [DONE]"
    problem = problem or _choices_ok(plan, finished)
    if problem is None and plan.logprobs and content_events and not logprobs:
        problem = "no logprobs in the stream"
    if problem is None and plan.include_usage and not usage:
        problem = "no usage chunk"
    rec.outcome, rec.error = ("ok", None) if problem is None else ("invalid", problem)


# -- the server -------------------------------------------------------------------------------
@dataclass
class Server:
    url: str
    pid: int | None
    tenants: tuple[Tenant, ...]  # with their keys (none: no Authorization)
    log: str | None = None


def tenants_toml(tenants: tuple[Tenant, ...]) -> str:
    """``[[tenants]]`` tables for the soak's tenants (only the keys' SHA-256 goes in)."""
    out = []
    for t in tenants:
        lines = ["[[tenants]]", f'name = "{t.name}"',
                 f'api_key_sha256 = "{hashlib.sha256(t.key.encode()).hexdigest()}"',
                 f"priority = {t.priority}", f"queue_deadline_s = {TENANT_QUEUE_DEADLINE_S}"]
        lines += [f"{k} = {json.dumps(v)}" for k, v in t.config.items()]
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


@asynccontextmanager
async def spawned(args: argparse.Namespace, workdir: Path) -> AsyncIterator[Server]:
    """``sluice serve`` with the base config plus the soak's tenants, ready and warm."""
    tenants = tuple(Tenant(t.name, t.priority, t.share, t.config,
                           key=f"soak-{t.name}-{secrets.token_hex(12)}") for t in TENANTS)
    base = Path(args.config) if args.config else DEFAULT_PRESET
    config = workdir / "soak.toml"
    config.write_text(f"{base.read_text()}\n\n# The soak's tenants\n{tenants_toml(tenants)}")
    load_settings(config)  # a bad base config fails here, naming the key
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [*sluice_command(args.sluice), "serve", "--config", str(config),
           "--host", "127.0.0.1", "--port", str(port)]
    if args.model:
        cmd += ["--model", args.model]
    cmd += shlex.split(args.server_args or "")
    env = {**os.environ, "SLUICE_DATA_DIR": str(workdir / "data")}  # its own batch store
    log = workdir / "server.log"
    with open(log, "wb") as out:
        proc = await trio.lowlevel.open_process(cmd, stdout=out, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env=env)
        try:
            await wait_healthy(url, proc, args.ready_timeout_s, log)
            yield Server(url, proc.pid, tenants, str(log))
        finally:
            with trio.CancelScope(shield=True):
                code = await stop(proc, 30.0)
            note(f"server stopped (exit {code}); log: {log}")


async def wait_warm(url: str, timeout_s: float) -> float:
    """Wait until /health says no shape is left to compile; returns the seconds waited."""
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=10.0, trust_env=False) as h:
        with trio.move_on_after(timeout_s):
            while True:
                r = await h.get("/health")
                if r.status_code == 200 and not r.json().get("warmup_remaining_shapes"):
                    break
                await trio.sleep(1.0)
    return time.perf_counter() - t0


def proc_sample(pid: int | None) -> dict[str, Any] | None:
    """The process's resident memory (all of it, and its anonymous part: the heaps, where
    a leak would show; the rest is mapped files), open descriptors and threads (None:
    unknown)."""
    if pid is None:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)

    def mb(name: str) -> float:
        return round(int(fields[name].split()[0]) / 1024, 1)

    return {"rss_mb": mb("VmRSS"), "rss_anon_mb": mb("RssAnon"), "fds": fds,
            "threads": int(fields["Threads"])}


async def at_rest(server: Server, timeout_s: float = 120.0) -> dict[str, Any]:
    """Poll /v1/stats until nothing runs or waits and no tenant holds a lease (or
    `timeout_s` passed), then read the books and the process.

    Called with every client connection closed; the poll's own connection is closed too
    (and the server given a moment to notice) before /proc is read."""
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=server.url, timeout=30.0, trust_env=False) as h:
        async def stats(key: str | None) -> dict[str, Any]:
            auth = {"Authorization": f"Bearer {key}"} if key else {}
            r = await h.get("/v1/stats", params={"window_s": 5, "audit": 1}, headers=auth)
            r.raise_for_status()
            return r.json()

        async def read() -> dict[str, Any]:
            s = await stats(server.tenants[0].key if server.tenants else None)
            pools = s["pools"]
            if server.tenants:  # a tenant's key shows only its own tenant
                tenants = [x for t in server.tenants for x in (await stats(t.key))["tenants"]]
            else:
                tenants = s["tenants"]
            return dict(
                running=sum(p["running"] for p in pools),
                waiting=sum(p["waiting"] for p in pools),
                kv_pages_in_use=sum(p["kv_pages"]["in_use"] for p in pools),
                kv_pages_cached=sum(p["kv_pages"]["cached"] for p in pools),
                kv_pages_total=sum(p["kv_pages"]["total"] for p in pools),
                kv_audit_problems=[x for p in pools
                                   for x in p["kv_pages"].get("audit_problems", [])],
                tenant_leases_in_flight=sum(x["in_flight"] for x in tenants))

        with trio.move_on_after(timeout_s):
            while True:
                out = await read()
                if not any(out[k] for k in ("running", "waiting", "kv_pages_in_use",
                                            "tenant_leases_in_flight")):
                    break
                await trio.sleep(0.5)
        if not out:
            raise RuntimeError(f"{server.url}/v1/stats did not answer within {timeout_s} s")
    out["settle_s"] = round(time.perf_counter() - t0, 2)
    await trio.sleep(1.0)  # the server closes our connection's socket
    out["process"] = proc_sample(server.pid)
    return out


# -- the run ----------------------------------------------------------------------------------
def note(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def dist(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "p50": None, "p95": None, "p99": None, "max": None}
    v = sorted(values)

    def q(p: float) -> float:
        return round(v[min(len(v) - 1, max(0, math.ceil(p * len(v)) - 1))], 4)

    return {"n": len(v), "p50": q(0.5), "p95": q(0.95), "p99": q(0.99), "max": round(v[-1], 4)}


def growth(a: dict | None, b: dict | None, key: str) -> float | None:
    if not a or not b or not a[key]:
        return None
    return round(100.0 * (b[key] - a[key]) / a[key], 2)


def trend(series: list[dict[str, Any]], after: int, key: str) -> float | None:
    """Growth in % between the medians of the first and the last quarter of the samples
    taken after `after` requests. Under load glibc keeps tens of MB of freed memory in its
    arenas, more or less from one moment to the next; a leak moves the median, that does
    not."""
    values = [s[key] for s in series if s["done"] >= after]
    q = len(values) // 4
    if q < 2:
        return None
    first, last = sorted(values[:q])[q // 2], sorted(values[-q:])[q // 2]
    return round(100.0 * (last - first) / first, 2)


class Soak:
    def __init__(self, server: Server, requests: Requests, args: argparse.Namespace) -> None:
        self.server, self.requests, self.args = server, requests, args
        self.records: list[Record] = []
        self.mix: Counter[str] = Counter()  # what was sent
        self.series: list[dict[str, Any]] = []  # the process under load (sample_process)
        self.warmup = min(args.warmup, args.requests // 4)  # requests before "start"
        self.began = time.perf_counter()
        self.next_note = self.began + args.progress_s

    async def phase(self, first: int, end: int) -> None:
        """Requests [first, end) from `concurrency` clients; every connection closed after."""
        todo = iter(range(first, end))
        limits = httpx.Limits(max_connections=self.args.concurrency,
                              max_keepalive_connections=self.args.concurrency)
        async with httpx.AsyncClient(base_url=self.server.url, limits=limits, trust_env=False,
                                     timeout=httpx.Timeout(None, connect=10.0)) as http:
            async def client() -> None:
                for i in todo:
                    plan = self.requests.plan(i)
                    self.count(plan)
                    rec = await run_one(http, plan, self.args.hung_s)
                    self.records.append(rec)
                    self.progress()
                    if rec.outcome == "rate_limited":  # a polite client waits as told
                        await trio.sleep(min(rec.retry_after_s or 0.5, 2.0))

            async with trio.open_nursery() as nursery:
                for _ in range(self.args.concurrency):
                    nursery.start_soon(client)

    def count(self, p: Plan) -> None:
        mix = self.mix
        mix["chat" if p.chat else "completions"] += 1
        mix["stream" if p.stream else "no_stream"] += 1
        for name, on in (("n2", p.n > 1), ("logprobs", p.logprobs), ("stop", "stop" in p.body),
                         ("seed", "seed" in p.body), ("greedy", p.body["temperature"] == 0),
                         ("priority", "priority" in p.body), ("slow_reader", p.slow_read_s),
                         ("shared_system_prompt", p.shared_prefix)):
            mix[name] += bool(on)
        if p.disconnect:
            mix[f"disconnect_{p.disconnect}"] += 1

    def progress(self) -> None:
        now = time.perf_counter()
        if now < self.next_note:
            return
        self.next_note = now + self.args.progress_s
        done, total = len(self.records), self.args.requests
        rate = done / (now - self.began)
        outcomes = Counter(r.outcome for r in self.records)
        note(f"{done}/{total} in {now - self.began:.0f} s ({rate:.2f}/s, about "
             f"{(total - done) / rate:.0f} s left): {dict(outcomes.most_common())}")

    async def run(self) -> dict[str, Any]:
        """The warm-up, then `checkpoints` (even) equal slices, the server at rest after
        each: "start", ..., "middle", ..., "end" (the others named by their fraction)."""
        a, warmup = self.args, self.warmup
        k = a.checkpoints
        bounds = [(0, warmup)] + [(warmup + (a.requests - warmup) * j // k,
                                   warmup + (a.requests - warmup) * (j + 1) // k)
                                  for j in range(k)]
        names = ["start"] + [f"{j}/{k}" for j in range(1, k)] + ["end"]
        if k % 2 == 0:
            names[k // 2] = "middle"
        rest: dict[str, Any] = {}
        idle_s = 0.0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.sample_process)
            for name, (first, end) in zip(names, bounds):
                await self.phase(first, end)
                t0 = time.perf_counter()
                rest[name] = await at_rest(self.server)
                idle_s += time.perf_counter() - t0
                note(f"{name} (after {end} requests): {rest[name]}")
            nursery.cancel_scope.cancel()
        return self.report(rest, time.perf_counter() - self.began, idle_s)

    async def sample_process(self) -> None:
        """The server's memory and descriptors under load, every `sample_s` (a trend
        between the points at rest tells a leak from noise)."""
        while True:
            sample = proc_sample(self.server.pid)
            if sample is not None:
                self.series.append({"t_s": round(time.perf_counter() - self.began, 1),
                                    "done": len(self.records), **sample})
            await trio.sleep(self.args.sample_s)

    def report(self, rest: dict[str, Any], wall_s: float, idle_s: float) -> dict[str, Any]:
        a, recs = self.args, self.records
        outcomes = Counter(r.outcome for r in recs)
        by_tenant: dict[str, Counter[str]] = {}
        cuts: dict[str, Counter[str]] = {}
        for r in recs:
            by_tenant.setdefault(r.tenant, Counter())[r.outcome] += 1
            if r.disconnect is not None:
                cuts.setdefault(r.disconnect, Counter())[r.cut or f"not_cut_{r.outcome}"] += 1
        timed = [r for r in recs if r.outcome == "ok" and r.stream and not r.slow]
        hung = [r for r in recs if r.outcome == "hung"]
        errors = Counter(f"{r.outcome}: {r.error}"[:200] for r in recs
                         if r.outcome not in ("ok", "disconnected", "rate_limited"))
        refused = Counter(r.error for r in recs if r.outcome == "rate_limited")
        ps = {k: v.get("process") for k, v in rest.items()}
        rss_growth = growth(ps["start"], ps["end"], "rss_mb")
        fd_growth = growth(ps["start"], ps["end"], "fds")
        limit = a.max_growth_pct
        checks = {
            "no_hung_streams": not hung,
            "idle_kv_pages_zero": all(v["kv_pages_in_use"] == 0 for v in rest.values()),
            "kv_audit_clean": not any(v["kv_audit_problems"] for v in rest.values()),
            "idle_leases_zero": all(v["tenant_leases_in_flight"] == 0 for v in rest.values()),
            "rss_growth_ok": rss_growth is None or rss_growth < limit,
            "fd_growth_ok": fd_growth is None or fd_growth < limit,
            # Answers that came back wrong or not at all (4xx and error events are listed
            # under "errors" but may be the server's right answer).
            "no_broken_answers": not any(outcomes[k] for k in (
                "http_5xx", "invalid", "transport_error", "timeout")),
        }
        return {
            "requests": len(recs), "concurrency": a.concurrency, "seed": a.seed,
            "wall_s": round(wall_s, 1), "at_rest_s": round(idle_s, 1),
            "requests_per_s": round(len(recs) / max(1e-9, wall_s - idle_s), 2),
            "server": {"url": self.server.url, "pid": self.server.pid, "log": self.server.log,
                       "model": self.requests.model},
            "words_per_token": round(self.requests.wpt, 3),
            "outcomes": dict(outcomes.most_common()),
            "outcomes_by_tenant": {t: dict(c.most_common()) for t, c in sorted(by_tenant.items())},
            "rate_limited_by": dict(refused.most_common()),
            "disconnects": {m: dict(c.most_common()) for m, c in sorted(cuts.items())},
            "mix": dict(sorted(self.mix.items())),
            "hung_streams": len(hung),
            # The longest a read waited for the server: what `hung_s` bounds in a stream
            # (its first event included); a response not streamed is its whole latency.
            "max_read_wait_s": {
                "stream": round(max((r.max_wait_s for r in recs if r.stream), default=0.0), 3),
                "no_stream": round(max((r.max_wait_s for r in recs if not r.stream),
                                       default=0.0), 3)},
            "at_rest": rest,
            "kv_pages_in_use_end": rest["end"]["kv_pages_in_use"],
            "rss_growth_pct": rss_growth, "fd_growth_pct": fd_growth,
            "rss_growth_pct_middle": growth(ps["start"], ps.get("middle"), "rss_mb"),
            "fd_growth_pct_middle": growth(ps["start"], ps.get("middle"), "fds"),
            "rss_trend_under_load_pct": trend(self.series, self.warmup, "rss_mb"),
            "rss_mb_at_rest": {k: v and v["rss_mb"] for k, v in ps.items()},
            "rss_anon_mb_at_rest": {k: v and v["rss_anon_mb"] for k, v in ps.items()},
            "fds_at_rest": {k: v and v["fds"] for k, v in ps.items()},
            "ttft_s": dist([r.ttft_s for r in timed if r.ttft_s is not None]),
            "itl_s": dist([g for r in timed for g in r.gaps_s]),
            "e2e_s_no_stream": dist([r.e2e_s for r in recs if r.outcome == "ok"
                                     and not r.stream and r.e2e_s is not None]),
            "errors": dict(errors.most_common(10)),
            "process_series": self.series,
            "checks": checks,
            "passed": all(checks.values()),
        }


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    @asynccontextmanager
    async def target() -> AsyncIterator[Server]:
        if args.url:
            keys = tuple(Tenant(f"key{k}", 0, 1.0, key=key)
                         for k, key in enumerate(args.api_key or []))
            yield Server(args.url.rstrip("/"), args.pid, keys)
            return
        with tempfile.TemporaryDirectory(prefix="sluice-soak-") as tmp:
            workdir = Path(args.workdir or tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            note(f"starting the server (work directory {workdir})")
            async with spawned(args, workdir) as server:
                yield server

    async with target() as server:
        waited = await wait_warm(server.url, args.ready_timeout_s)
        note(f"{server.url} ready, every shape compiled ({waited:.0f} s after healthy)")
        auth = {"Authorization": f"Bearer {server.tenants[0].key}"} if server.tenants else {}
        async with httpx.AsyncClient(base_url=server.url, timeout=30.0, trust_env=False,
                                     headers=auth) as h:
            model = args.served_model or (await h.get("/v1/models")).json()["data"][0]["id"]
            wpt = await calibrate(h, model) or DEFAULT_WORDS_PER_TOKEN
        tenants = server.tenants or (Tenant("anonymous", 0, 1.0),)
        result = await Soak(server, Requests(args.seed, model, tenants, wpt), args).run()
        result["warmup_compile_wait_s"] = round(waited, 1)
        if args.workdir is None and not args.url:
            result["server"]["log"] = None  # deleted with the temporary directory
        return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=300,
                   help="requests before the 'start' sample (at most a quarter of them)")
    p.add_argument("--checkpoints", type=int, default=2,
                   help="slices after the warm-up, the server at rest after each (even: "
                        "one of them is the middle)")
    p.add_argument("--hung-s", type=float, default=30.0,
                   help="a read waiting longer than this for the server is a hung stream")
    p.add_argument("--max-growth-pct", type=float, default=5.0)
    p.add_argument("--url", help="soak a running server instead of starting one")
    p.add_argument("--api-key", action="append", help="with --url: a key to send (repeat)")
    p.add_argument("--pid", type=int, help="with --url: the server's process, for /proc")
    p.add_argument("--served-model", help="model name to ask for (default: the first)")
    p.add_argument("--config", help="base TOML for the spawned server (default preset)")
    p.add_argument("--model", help="`sluice serve --model` for the spawned server")
    p.add_argument("--server-args", help="more `sluice serve` options, e.g. '--ttft-target 2'")
    p.add_argument("--sluice", help="command that runs sluice (default: the venv's)")
    p.add_argument("--workdir", help="keep the spawned server's config, log and data here")
    p.add_argument("--ready-timeout-s", type=float, default=900.0)
    p.add_argument("--progress-s", type=float, default=30.0)
    p.add_argument("--sample-s", type=float, default=10.0,
                   help="read the server's memory and descriptors this often under load")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.checkpoints < 2:
        p.error("--requests and --concurrency must be at least 1, --checkpoints 2")
    result = trio.run(soak, args)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
