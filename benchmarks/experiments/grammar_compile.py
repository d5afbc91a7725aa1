"""What a new JSON schema costs before its first token: requests with schemas the server
has not seen (compiled on arrival) against the same schemas again (cached), one at a time,
max_tokens 1, against a running server. Prints one JSON line: median seconds to the whole
response, new and cached, and their difference (the compile).

    .venv/bin/python benchmarks/experiments/grammar_compile.py --url http://127.0.0.1:8000 [--n 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid

import httpx


def schema(i: int, tag: str) -> dict:
    """A schema of a typical tool-ish size (a dozen fields), unique per (i, tag)."""
    props = {f"{tag}_{i}_{k}": {"type": t} for k, t in enumerate(
        ["string", "integer", "number", "boolean"] * 3)}
    props["items"] = {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "qty": {"type": "integer", "minimum": 0}},
        "required": ["name", "qty"]}}
    return {"type": "object", "properties": props, "required": sorted(props)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--n", type=int, default=10)
    args = ap.parse_args(argv)
    tag = uuid.uuid4().hex[:6]
    with httpx.Client(base_url=args.url, timeout=120) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]

        def once(s: dict) -> float:
            body = {"model": model, "max_tokens": 1, "temperature": 0,
                    "messages": [{"role": "user", "content": "Fill the form."}],
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "form", "schema": s}}}
            t = time.perf_counter()
            r = http.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            return time.perf_counter() - t

        once(schema(-1, tag))  # the tokenizer's one-time build, not counted
        new = [once(schema(i, tag)) for i in range(args.n)]
        cached = [once(schema(i, tag)) for i in range(args.n)]
    out = {"schemas": args.n, "new_s": round(statistics.median(new), 4),
           "cached_s": round(statistics.median(cached), 4),
           "compile_s": round(statistics.median(new) - statistics.median(cached), 4)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
