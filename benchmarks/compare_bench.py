"""The headline figures of several `sluice bench` result files, one JSON line: output
tok/s, TTFT and ITL p50/p95, and for long-interference the short streams' ITL before,
during the long prefill and while the long request decodes, and the long TTFT.

    .venv/bin/python benchmarks/compare_bench.py OUT/*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _r(x, nd=4):
    return None if x is None else round(x, nd)


def summary(d: dict) -> dict:
    out = {"ok": d["requests"]["ok"], "of": d["requests"]["total"],
           "rate_limited": d["requests"]["rate_limited"],
           "output_tok_s": _r(d["throughput"]["output_tokens_per_s"], 2),
           "ttft_p50": _r(d["ttft_s"]["p50"]), "ttft_p95": _r(d["ttft_s"]["p95"]),
           "itl_p50": _r(d["itl_s"]["p50"]), "itl_p95": _r(d["itl_s"]["p95"])}
    li = d.get("long_interference")
    if li:
        out.update(long_ttft=_r(li["long"]["ttft_s"]),
                   short_itl_p95_before=_r(li["short_itl_before_s"]["p95"]),
                   short_itl_p95_during=_r(li["short_itl_during_s"]["p95"]),
                   short_itl_p95_after=_r(li["short_itl_after_s"]["p95"]))
    return out


def main(paths: list[str]) -> int:
    print(json.dumps({Path(p).stem: summary(json.loads(Path(p).read_text()))
                      for p in paths}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
