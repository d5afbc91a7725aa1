"""How fast the door says no while the model computes: N requests at once, each on a new
connection, against a server that already streams to 16 polite clients
(benchmarks/polite_load.py's shared-prefix load), with /health probed on new connections
before and during the flood.

Every flood request and probe is its own TCP connection with a hand-written HTTP/1.1
request (``Connection: close``), timed from the connect to the status line, so the
figures hold the accept, the HTTP parse, the body decode, the tokenizer and the door:
what a client waits for a 429. Admitted flood requests (16-token answers) are read to the
end. Prints one JSON line: the flood's statuses, 429 latency p50/p95/p99/max, how many
429s carried a Retry-After, 5xx, /health p50/p99 before (the baseline, same streams),
during the flood, and while its refusals were being answered (probes sent before the last
429 came: the same moment, without an admitted answer's streaming after it), /health
requests started among the flood's own (`--health-in-flood`, the same start as the
refusals) and the 429 p99 over theirs, and the 16 streams' output tok/s and ITL p95 over
the run.

    .venv/bin/python benchmarks/flood.py URL [--flood 300] [--streams 16] [--warm-s 20]
        [--probe-interval-s 0.01] [--health-in-flood 15]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from polite_load import Load, dist, options  # noqa: E402  (a script beside this one)


async def http_once(host: str, port: int, method: str, path: str, body: bytes = b"",
                    read_all: bool = False) -> tuple[int, float, dict[str, str]]:
    """One request on a new connection: (status, seconds to the status line, headers)."""
    t0 = time.perf_counter()
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        head = (f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        await stream.send_all(head.encode() + body)
        buf, seconds = b"", None
        while b"\r\n\r\n" not in buf:
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            buf += chunk
            if seconds is None and b"\r\n" in buf:
                seconds = time.perf_counter() - t0  # the status line is in
        if seconds is None:
            seconds = time.perf_counter() - t0
        lines = buf.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split()[1])
        except (IndexError, ValueError):
            return 0, seconds, {}
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(":") for line in lines[1:])}
        if read_all:  # to the end of the body by its framing: a Quart response to a
            # "Connection: close" request leaves the connection open (hypercorn 0.18 with
            # quart-trio), so EOF may never come
            rest = buf.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in buf else b""
            length = headers.get("content-length")
            while True:
                if length is not None and len(rest) >= int(length):
                    break
                if length is None and rest.endswith(b"0\r\n\r\n"):
                    break
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                rest += chunk
        return status, seconds, headers


class Flood:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        u = urlsplit(args.url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.results: list[tuple[int, float, bool]] = []  # status, seconds, retry-after
        self.health: dict[str, list[float]] = {"baseline": [], "flood": []}
        # flood-phase probes: (sent at, seconds); compared with the refusals' own moment
        self.flood_probes: list[tuple[float, float]] = []
        self.last_refusal_at = 0.0  # when the flood's last 429 status line came
        self.in_flood: list[float] = []  # /health requests sent among the flood's own
        self.phase = "warm"

    async def probe(self) -> None:
        """A /health request every `probe_interval_s`, each on its own connection and
        not waiting for the last: a slow answer does not thin out the samples."""

        async def once(phase: str) -> None:
            sent = time.perf_counter()
            status, s, _ = await http_once(self.host, self.port, "GET", "/health")
            if status == 200:
                self.health[phase].append(s)
                if phase == "flood":
                    self.flood_probes.append((sent, s))

        async with trio.open_nursery() as nursery:
            while True:
                if self.phase in self.health:
                    nursery.start_soon(once, self.phase)
                await trio.sleep(self.args.probe_interval_s)

    async def one(self, body: bytes) -> None:
        sent = time.perf_counter()
        try:
            status, s, headers = await http_once(self.host, self.port, "POST",
                                                 "/v1/chat/completions", body, read_all=True)
        except OSError:
            status, s, headers = -1, 0.0, {}
        if status == 429:
            self.last_refusal_at = max(self.last_refusal_at, sent + s)
        retry = "retry-after" in headers or "retry-after-ms" in headers
        self.results.append((status, s, retry))

    async def health_among(self) -> None:
        """A /health request started among the flood's (`--health-in-flood` of them,
        spread over it): the same moment as the refusals, the same client's clock."""
        status, s, _ = await http_once(self.host, self.port, "GET", "/health")
        if status == 200:
            self.in_flood.append(s)

    async def run(self) -> dict:
        a = self.args
        load = Load(options(a.url, concurrency=a.streams, requests=10**9, warmup_requests=0))
        conns = a.streams + 8
        limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
        async with httpx.AsyncClient(base_url=a.url, timeout=600, limits=limits) as http:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
            body = load.body(10**6, model)
            body.update(stream=True, max_tokens=16)
            flood_body = json.dumps(body).encode()
            async with trio.open_nursery() as nursery:
                counter = iter(range(10**9))

                async def stream_worker() -> None:
                    for i in counter:
                        await load.one(http, i, model, True)

                for _ in range(a.streams):
                    nursery.start_soon(stream_worker)
                nursery.start_soon(self.probe)
                await trio.sleep(a.warm_s)  # the system prompt in, the streams steady
                self.phase = "baseline"
                await trio.sleep(a.baseline_s)
                self.phase = "flood"
                async with trio.open_nursery() as flood:
                    every = max(1, a.flood // a.health_in_flood) if a.health_in_flood else 0
                    for i in range(a.flood):
                        flood.start_soon(self.one, flood_body)
                        if every and i % every == every // 2:
                            flood.start_soon(self.health_among)
                self.phase = "done"
                await trio.sleep(a.tail_s)
                nursery.cancel_scope.cancel()
        streams = load.report(model)
        refused = [s for st, s, _ in self.results if st == 429]
        statuses: dict[str, int] = {}
        for st, _, _ in self.results:
            statuses[str(st)] = statuses.get(str(st), 0) + 1
        return {
            "url": a.url, "flood": a.flood, "streams": a.streams, "statuses": statuses,
            "server_errors_5xx": sum(1 for st, _, _ in self.results if st >= 500),
            "connect_errors": statuses.get("-1", 0),
            "refused": len(refused),
            "refused_with_retry_after": sum(1 for st, _, r in self.results if st == 429 and r),
            "latency_429_s": dist(refused),
            "latency_admitted_s": dist([s for st, s, _ in self.results if st == 200]),
            "health_baseline_s": dist(self.health["baseline"]),
            "health_during_flood_s": dist(self.health["flood"]),
            # the probes sent while the refusals were being answered (before the last 429
            # came): the same moment, without the admitted answers' streaming after it
            "health_while_refusing_s": dist([s for sent, s in self.flood_probes
                                             if sent <= self.last_refusal_at]),
            "health_among_flood_s": dist(self.in_flood),
            "ratio_429_p99_over_health_among_flood_p99": _ratio(refused, self.in_flood),
            "streams_output_tok_s": streams["output_tok_s"],
            "streams_itl_s": streams["itl_s"],
            "streams_ttft_s": streams["ttft_from_first_send_s"],
        }


def _ratio(a: list[float], b: list[float]) -> float | None:
    """p99 of a over p99 of b (None where either is empty)."""
    if not a or not b:
        return None
    return round(dist(a)["p99"] / dist(b)["p99"], 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("--flood", type=int, default=300)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--warm-s", type=float, default=20.0)
    ap.add_argument("--baseline-s", type=float, default=5.0)
    ap.add_argument("--tail-s", type=float, default=5.0)
    # 10 ms: a probe waits behind the flood's connections like a refusal, so its latency
    # is the drain time less its offset into the flood; 50 ms apart, 2-4 probes landed in
    # a 150-250 ms drain and the first one's offset alone moved the 429 / /health ratio
    # between 1.0 and 1.4x (docs/benchmarks.md, "A door that says no in milliseconds").
    ap.add_argument("--probe-interval-s", type=float, default=0.01)
    # /health requests started among the flood's own requests, spread evenly: a probe on
    # the interval starts after the flood has begun and waits only for its rest, while
    # these start with it (the front door answers both /health and the refusals).
    ap.add_argument("--health-in-flood", type=int, default=15)
    args = ap.parse_args(argv)
    print(json.dumps(trio.run(Flood(args).run)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
