"""The figures of `benchmarks/guidellm_vs_bench.sh`'s three runs side by side, as one JSON
line: GuideLLM's report (OUT/guidellm.json) against `sluice bench`'s before and after it.

What is compared with what: GuideLLM's TTFT is `sluice bench`'s TTFT. GuideLLM's
"inter-token latency" is per request, (end - first token) / (output tokens - 1), so it is
`sluice bench`'s `tpot_s`; `sluice bench`'s `itl_s` (every gap between streamed tokens)
has no GuideLLM counterpart. Output tok/s: output tokens of the measured requests over
the measured window, for both.

    .venv/bin/python benchmarks/guidellm_compare.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def guidellm(path: Path) -> dict:
    b = json.loads(path.read_text())["benchmarks"][0]
    m = b["metrics"]

    def dist(name: str, scale: float = 1e-3) -> dict:
        s = m[name]["successful"]
        p = s["percentiles"]
        return {"mean": round(s["mean"] * scale, 4), "p50": round(p["p50"] * scale, 4),
                "p95": round(p["p95"] * scale, 4)}

    totals = m["request_totals"]
    out_tokens = m["output_token_count"]["successful"]["total_sum"]
    return {"requests": {k: totals[k] for k in ("successful", "errored", "incomplete")},
            "output_tokens_per_s": round(out_tokens / b["duration"], 2),
            "ttft_s": dist("time_to_first_token_ms"),
            "tpot_s": dist("inter_token_latency_ms")}


def bench(path: Path) -> dict:
    d = json.loads(path.read_text())

    def dist(name: str) -> dict:
        return {k: round(d[name][k], 4) for k in ("mean", "p50", "p95")}

    r = d["requests"]
    return {"requests": {"successful": r["ok"], "errored": r["total"] - r["ok"]},
            "output_tokens_per_s": round(d["throughput"]["output_tokens_per_s"], 2),
            "ttft_s": dist("ttft_s"), "tpot_s": dist("tpot_s"), "itl_s": dist("itl_s")}


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    print(json.dumps({"guidellm": guidellm(out / "guidellm.json"),
                      "bench_before": bench(out / "bench-before.json"),
                      "bench_after": bench(out / "bench-after.json")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
