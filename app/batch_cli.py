"""`sluice batch`: batch jobs on a running server, from the terminal (httpx; no JAX).

    sluice batch submit FILE.jsonl [--window 24h] [--endpoint /v1/chat/completions] [--wait]
    sluice batch status ID
    sluice batch results ID [-o out.jsonl] [--errors]
    sluice batch list [--limit N]
    sluice batch cancel ID

FILE.jsonl holds OpenAI batch lines (`{"custom_id", "method", "url", "body"}`). `submit`
uploads it (`POST /v1/files`), creates the batch and prints its id; with `--wait` it shows
a progress bar until the batch ends. Errors from the server print its message.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx

TERMINAL = ("completed", "failed", "expired", "cancelled")


def add_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("batch", help="batch jobs on a running server (submit, status, ...)")
    b.add_argument("--url", default="http://127.0.0.1:8000")
    b.add_argument("--api-key", help="Bearer key (default: $SLUICE_API_KEY)")
    bs = b.add_subparsers(dest="batch_command", required=True)
    s = bs.add_parser("submit", help="upload a JSONL file and start a batch")
    s.add_argument("file", type=Path)
    s.add_argument("--window", default="24h", help="completion window: 90m, 24h, 7d")
    s.add_argument("--endpoint", default="/v1/chat/completions",
                   choices=("/v1/chat/completions", "/v1/completions"))
    s.add_argument("--wait", action="store_true", help="show progress until it ends")
    st = bs.add_parser("status", help="a batch's status and counts")
    st.add_argument("id")
    r = bs.add_parser("results", help="download a batch's output (or error) file")
    r.add_argument("id")
    r.add_argument("-o", "--output", type=Path, help="write here (default: stdout)")
    r.add_argument("--errors", action="store_true", help="the error file instead")
    ls = bs.add_parser("list", help="your batches, newest first")
    ls.add_argument("--limit", type=int, default=20)
    c = bs.add_parser("cancel", help="cancel a batch (finished results are kept)")
    c.add_argument("id")
    b.set_defaults(run=run)


class CliError(Exception):
    pass


def _check(r: httpx.Response) -> httpx.Response:
    if r.status_code >= 400:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:300]
        raise CliError(f"{r.status_code}: {message}")
    return r


def run(args: argparse.Namespace) -> int:
    key = args.api_key or os.environ.get("SLUICE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with httpx.Client(base_url=args.url.rstrip("/"), headers=headers,
                          timeout=httpx.Timeout(30, read=300)) as http:
            return {"submit": _submit, "status": _status, "results": _results,
                    "list": _list, "cancel": _cancel}[args.batch_command](http, args)
    except CliError as e:
        print(f"sluice batch: {e}", file=sys.stderr)
        return 1
    except httpx.HTTPError as e:
        print(f"sluice batch: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1


def _summary(b: dict) -> str:
    n = b["request_counts"]
    eta = (b.get("sluice") or {}).get("estimated_completion_at")
    more = f", done by ~{time.strftime('%H:%M:%S', time.localtime(eta))}" if eta else ""
    return (f"{b['id']} {b['status']}: {n['completed']} completed, {n['failed']} failed of "
            f"{n['total']}{more}")


def _submit(http: httpx.Client, args: argparse.Namespace) -> int:
    try:
        content = args.file.read_bytes()
    except OSError as e:
        raise CliError(f"{args.file}: {e.strerror or e}") from None
    f = _check(http.post("/v1/files", files={"file": (args.file.name, content)},
                         data={"purpose": "batch"})).json()
    b = _check(http.post("/v1/batches", json={
        "input_file_id": f["id"], "endpoint": args.endpoint,
        "completion_window": args.window})).json()
    print(b["id"])
    if not args.wait:
        return 0
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), transient=False) as bar:
        task = bar.add_task(b["id"], total=b["request_counts"]["total"])
        while b["status"] not in TERMINAL:
            time.sleep(1.0)
            b = _check(http.get(f"/v1/batches/{b['id']}")).json()
            n = b["request_counts"]
            bar.update(task, completed=n["completed"] + n["failed"],
                       description=f"{b['id']} {b['status']}")
    print(_summary(b), file=sys.stderr)
    return 0 if b["status"] == "completed" else 1


def _status(http: httpx.Client, args: argparse.Namespace) -> int:
    print(json.dumps(_check(http.get(f"/v1/batches/{args.id}")).json(), indent=2))
    return 0


def _results(http: httpx.Client, args: argparse.Namespace) -> int:
    b = _check(http.get(f"/v1/batches/{args.id}")).json()
    fid = b["error_file_id" if args.errors else "output_file_id"]
    if fid is None:
        raise CliError(f"{_summary(b)}: no {'error' if args.errors else 'output'} file "
                       "(yet)")
    data = _check(http.get(f"/v1/files/{fid}/content")).content
    if args.output:
        args.output.write_bytes(data)
        lines = data.count(b"\n")
        print(f"{args.output}: {lines} lines", file=sys.stderr)
    else:
        sys.stdout.buffer.write(data)
    return 0


def _list(http: httpx.Client, args: argparse.Namespace) -> int:
    page = _check(http.get("/v1/batches", params={"limit": args.limit})).json()
    for b in page["data"]:
        print(_summary(b))
    return 0


def _cancel(http: httpx.Client, args: argparse.Namespace) -> int:
    print(_summary(_check(http.post(f"/v1/batches/{args.id}/cancel")).json()))
    return 0
