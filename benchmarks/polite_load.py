"""Polite clients against any OpenAI-compatible server: a closed loop of C streams that wait
out every 429 exactly as told (retry-after-ms, else Retry-After) and retry the same request,
so that a refusal costs the user its wait, and TTFT is counted from the request's first send.

It imports nothing of Sluice (httpx, trio and numpy only): the same client measures
llama.cpp's server and Sluice. Every request carries one ~2,000-token system prompt and its
own 30-100-token question (the shared-prefix workload), answers of 128-400 tokens
(`ignore_eos`, which llama.cpp's server and Sluice both honour, so both write the same
lengths). Two uses:

- the steady state: ``--concurrency 16 --requests 48 --warmup-requests 16`` (the first 16
  through the same loop warm the prefix cache and are not counted);
- the first burst after a start: ``--concurrency 64 --requests 64 --warmup-requests 0
  --max-tokens 128`` (benchmarks/burst_polite.sh);
- ``--workload repeat``: no system prompt, each request asks to copy a passage or reprint
  a code block with a rename (`REPEAT_PROMPTS`), answers that repeat the prompt, where
  speculative decoding pays (benchmarks/llamacpp_vs_sluice.sh's `repeat`).

Prints one JSON line: TTFT from the first send and of the admitted attempt, inter-token
gaps (every gap between two content chunks), output tok/s over the measured window,
refusals a request, 429 latency, statuses, and `reconnects`: requests sent again because
a kept-alive connection closed before any status line came back (llama.cpp's server
drops idle ones: 14 of 48 errored before this retry).

    .venv/bin/python benchmarks/polite_load.py URL [--concurrency 16] [--requests 48]
        [--warmup-requests 16] [--max-tokens N] [--seed 0] [--workload repeat]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time

import httpx
import numpy as np
import trio

_WORDS = """time year people way day thing life world school state family group country
problem hand part place case week company system program question work number night point
home water room area money story fact month right study book job word business issue side
kind head house service friend power hour game line end member law car city community name
team minute idea body information back level office door health person art history party
result change morning reason research moment air force education river market bridge engine
winter summer letter window table garden mountain valley forest ocean island village harbor
station library museum theater the the the a a of of to to and and in is that it for on with
as was be by this are or from at have not but which can all their will one has more when""".split()


PASSAGE = (
    "The river sluice at the old mill was built in 1820 to hold back the spring floods. "
    "Each gate is raised by a wooden wheel, and the keeper opens them one at a time so "
    "that the water below never rises faster than the banks can take. In dry summers the "
    "gates stay shut and the pond behind them feeds the mill wheel for weeks. The keeper "
    "writes the water level in a book every morning, and the oldest books are kept in "
    "the town library, where anyone may read them.")
CODE = '''def merge_intervals(intervals):
    intervals = sorted(intervals, key=lambda iv: iv[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def total_covered(intervals):
    return sum(end - start for start, end in merge_intervals(intervals))
'''
# Requests whose answers repeat their prompt (copying, editing, renaming in code).
REPEAT_PROMPTS = [
    f"Copy this text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite this code with the function `merge_intervals` renamed to `merge`, "
    f"nothing else changed:\n\n{CODE}",
    f"Repeat the following paragraph, then stop:\n\n{PASSAGE}",
    f"Here is a Python module. Print it again unchanged.\n\n{CODE}",
]


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


def dist(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    a = np.asarray(values)
    return {"n": len(values), "p50": round(float(np.percentile(a, 50)), 4),
            "p95": round(float(np.percentile(a, 95)), 4),
            "p99": round(float(np.percentile(a, 99)), 4), "max": round(float(a.max()), 4)}


async def polite_request(http: httpx.AsyncClient, body: dict,
                         headers: dict[str, str] | None = None) -> dict:
    """One streamed chat completion by a polite client: a 429 is waited out as told
    (`retry-after-ms`, else `Retry-After`) and the same request sent again. Its record:
    status ("ok", "http_N", an error event's code, "client_<httpx error>"), refusals and
    each one's latency and Retry-After, `ttft_s` (of the admitted attempt),
    `ttft_from_first_s` (from the first send), the gaps between content chunks, tokens
    (the usage's, else the chunks), prompt tokens, and `start` / `end` (monotonic)."""
    rec: dict = {"refusals": 0, "refused_s": [], "retry_after_s": [], "status": None,
                 "ttft_s": None, "ttft_from_first_s": None, "gaps_s": [], "tokens": 0,
                 "prompt_tokens": None, "reconnects": 0}
    first = time.monotonic()
    try:
        while True:
            t0 = time.monotonic()
            request = http.build_request("POST", "/v1/chat/completions", json=body,
                                         headers=headers)
            try:
                r = await http.send(request, stream=True)
            except (httpx.RemoteProtocolError, httpx.ConnectError):
                # A kept-alive connection the server closed as the request went out (no
                # status line came back: nothing was processed). Sent again, as the
                # openai client does, up to 3 times.
                if rec["reconnects"] >= 3:
                    raise
                rec["reconnects"] += 1
                continue
            try:
                if r.status_code == 429:
                    await r.aread()
                    rec["refused_s"].append(time.monotonic() - t0)
                    rec["refusals"] += 1
                    ms = r.headers.get("retry-after-ms")
                    wait = float(ms) / 1000 if ms else float(r.headers.get("retry-after", 1))
                    rec["retry_after_s"].append(wait)
                    await trio.sleep(wait)
                    continue
                if r.status_code != 200:
                    await r.aread()
                    rec["status"] = f"http_{r.status_code}"
                    rec["error"] = r.text[:300]
                    break
                rec["admitted_at"] = t0
                last = None
                chunks = 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        rec["status"] = chunk["error"].get("code") or "stream_error"
                        break
                    if chunk.get("usage"):
                        rec["tokens"] = chunk["usage"].get("completion_tokens") or 0
                        rec["prompt_tokens"] = chunk["usage"].get("prompt_tokens")
                    delta = (chunk.get("choices") or [{}])[0].get("delta", {})
                    if not delta.get("content"):
                        continue
                    now = time.monotonic()
                    chunks += 1
                    if last is None:
                        rec["ttft_s"], rec["ttft_from_first_s"] = now - t0, now - first
                        rec["first_token_at"] = now
                    else:
                        rec["gaps_s"].append(now - last)
                    last = now
                rec["tokens"] = rec["tokens"] or chunks
                rec["status"] = rec["status"] or "ok"
                break
            finally:
                await r.aclose()
    except httpx.HTTPError as e:
        rec["status"] = f"client_{type(e).__name__}"
    rec["start"], rec["end"] = first, time.monotonic()
    return rec


class Load:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        rng = random.Random(f"system:{args.seed}")
        # ~0.87 words a token for this vocabulary under SmolLM2's tokenizer
        self.system = ("You are the assistant of a travel and history company. Answer from "
                       "these notes. " + _text(rng, int(args.system_tokens * 0.87)))
        self.records: list[dict] = []
        self.window: list[float] = []  # measured requests' first send and last byte

    def body(self, i: int, model: str) -> dict:
        if self.args.workload == "repeat":
            return {"model": model, "stream": True, "temperature": 0, "ignore_eos": True,
                    "max_tokens": self.args.max_tokens or 160,
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "user",
                                  "content": REPEAT_PROMPTS[i % len(REPEAT_PROMPTS)]}]}
        rng = random.Random(f"request:{self.args.seed}:{i}")
        question = f"Question {i}: " + _text(rng, int(rng.randint(30, 100) * 0.87)) + "?"
        max_tokens = self.args.max_tokens or rng.randint(128, 400)
        return {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": self.system},
                             {"role": "user", "content": question}]}

    async def one(self, http: httpx.AsyncClient, i: int, model: str, measured: bool) -> None:
        rec = await polite_request(http, self.body(i, model))
        rec["index"] = i
        if measured:
            self.records.append(rec)
            self.window += [rec["start"], rec["end"]]

    async def run(self) -> dict:
        a = self.args
        conns = a.concurrency + 8
        limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
        async with httpx.AsyncClient(base_url=a.url, timeout=a.timeout, limits=limits) as http:
            model = a.model or (await http.get("/v1/models")).json()["data"][0]["id"]
            indices = itertools.count()
            total = a.warmup_requests + a.requests

            async def worker() -> None:
                for i in indices:
                    if i >= total:
                        return
                    await self.one(http, i, model, i >= a.warmup_requests)

            async with trio.open_nursery() as nursery:
                for _ in range(a.concurrency):
                    nursery.start_soon(worker)
        return self.report(model)

    def report(self, model: str) -> dict:
        out = self.records
        statuses: dict[str, int] = {}
        for r in out:
            statuses[r["status"]] = statuses.get(r["status"], 0) + 1
        refusals = [r["refusals"] for r in out]
        wall = max(self.window) - min(self.window) if self.window else 0.0
        tokens = sum(r["tokens"] for r in out if r["status"] == "ok")
        a = self.args
        return {
            "url": a.url, "model": model, "workload": a.workload, "concurrency": a.concurrency,
            "requests": a.requests, "warmup_requests": a.warmup_requests,
            "statuses": statuses, "shed_after_admission": statuses.get("shed", 0),
            "output_tok_s": round(tokens / wall, 2) if wall else 0.0,
            "output_tokens": tokens, "wall_s": round(wall, 2),
            "ttft_from_first_send_s": dist([r["ttft_from_first_s"] for r in out
                                            if r["ttft_from_first_s"] is not None]),
            "ttft_admitted_s": dist([r["ttft_s"] for r in out if r["ttft_s"] is not None]),
            "ttft_admitted_over_1s": sum(1 for r in out if (r["ttft_s"] or 0.0) > 1.0),
            "itl_s": dist([g for r in out for g in r["gaps_s"]]),
            "refusals_total": sum(refusals),
            "reconnects": sum(r.get("reconnects", 0) for r in out),
            "refusals_per_request_mean": round(float(np.mean(refusals)), 3) if out else 0.0,
            "refusals_per_request_max": max(refusals, default=0),
            "latency_429_s": dist([s for r in out for s in r["refused_s"]]),
            "retry_after_s": dist([s for r in out for s in r["retry_after_s"]]),
        }


def options(url: str, **overrides) -> argparse.Namespace:
    """The command line's options with their defaults, some overridden: what the scripts
    that drive `Load` themselves (flood.py, slo_sweep.py) pass it, so that an option added
    here reaches them."""
    args = parser().parse_args([url])
    for k, v in overrides.items():
        if not hasattr(args, k):
            raise TypeError(f"polite_load has no option {k!r}")
        setattr(args, k, v)
    return args


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--warmup-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=0, help="fixed answer length "
                    "(default: 128-400 a request)")
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--workload", choices=["shared-prefix", "repeat"], default="shared-prefix")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--records", default=None, help="also write every measured request's "
                    "record (sends, refusals, first token; monotonic seconds) to this file")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    load = Load(args)
    print(json.dumps(trio.run(load.run)))
    if args.records:
        with open(args.records, "w") as f:
            json.dump(sorted(load.records, key=lambda r: r["start"]), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
