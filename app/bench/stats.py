"""From request records to the numbers a benchmark reports. Pure functions, no I/O.

Conventions, chosen to match vLLM's benchmark_serving so numbers compare:
- Percentiles are numpy's linear interpolation over all samples pooled; ITL pools every
  gap of every successful request (so long answers weigh more, as they do for users).
- Latency and throughput count successful (``ok``) requests only; refusals have their
  own section. Throughput divides by the run's wall time (first send to last answer).
- A request is *good* under the SLO when it is ok, its TTFT meets ``slo_ttft`` and the
  95th percentile of its own gaps meets ``slo_itl`` (each check only if given).
  Attainment is good / sent (sent excludes requests the run cancelled or dropped);
  ``attainment_admitted`` is good / ok, what an overload test asks of admitted requests.
- TPOT is per request: (last chunk - first chunk) / (tokens after the first chunk). It is
  the per-token pace whatever the server's chunking; ITL is the per-delivery gap.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

import numpy as np

from .client import RequestRecord

PERCENTILES = (50, 90, 95, 99)
STATUSES = ("ok", "rate_limited", "http_error", "stream_error", "timeout",
            "transport_error", "cancelled", "dropped")


def distribution(values: Iterable[float]) -> dict[str, float | int | None]:
    """count, mean, p50/p90/p95/p99 and max of ``values`` (None for each when empty)."""
    a = np.asarray(list(values), dtype=float)
    out: dict[str, float | int | None] = {"count": int(a.size)}
    if a.size == 0:
        out.update({"mean": None, **{f"p{q}": None for q in PERCENTILES}, "max": None})
        return out
    out["mean"] = float(a.mean())
    for q, v in zip(PERCENTILES, np.percentile(a, PERCENTILES)):
        out[f"p{q}"] = float(v)
    out["max"] = float(a.max())
    return out


def tpot(rec: RequestRecord) -> float | None:
    after_first = (rec.output_tokens or 0) - (rec.chunk_tokens[0] if rec.chunk_tokens else 0)
    if len(rec.chunk_times) < 2 or after_first <= 0:
        return None
    return (rec.chunk_times[-1] - rec.chunk_times[0]) / after_first


def is_good(rec: RequestRecord, slo_ttft: float | None, slo_itl: float | None) -> bool:
    if rec.status != "ok":
        return False
    if slo_ttft is not None and (rec.ttft is None or rec.ttft > slo_ttft):
        return False
    gaps = rec.gaps
    return slo_itl is None or not gaps or float(np.percentile(gaps, 95)) <= slo_itl


def wall_time(records: Sequence[RequestRecord]) -> float:
    """First send to last end, over the records that were sent."""
    sent = [r for r in records if r.status != "dropped"]
    if not sent:
        return 0.0
    return max(r.start + (r.e2e or 0.0) for r in sent) - min(r.start for r in sent)


def counts(records: Sequence[RequestRecord]) -> dict[str, int]:
    c = Counter(r.status for r in records)
    out = {"total": len(records), **{s: c.get(s, 0) for s in STATUSES}}
    out["server_errors_5xx"] = sum(1 for r in records
                                   if r.http_status is not None and r.http_status >= 500)
    out["client_errors_4xx"] = sum(1 for r in records if r.http_status is not None
                                   and 400 <= r.http_status < 500 and r.http_status != 429)
    return out


def refusals(records: Sequence[RequestRecord]) -> dict[str, object]:
    """429s: how many, how fast they came, and whether they said when to come back."""
    refused = [r for r in records if r.status == "rate_limited"]
    sent = [r for r in records if r.status not in ("cancelled", "dropped")]
    return {
        "count": len(refused),
        "fraction": len(refused) / len(sent) if sent else 0.0,
        "latency_s": distribution(r.e2e for r in refused if r.e2e is not None),
        "with_retry_after": sum(1 for r in refused if r.retry_after is not None),
        "retry_after_s": distribution(r.retry_after for r in refused
                                      if r.retry_after is not None),
    }


def full_concurrency(records: Sequence[RequestRecord], concurrency: int
                     ) -> dict[str, object] | None:
    """Output tokens/s while a closed loop held all ``concurrency`` streams in flight.

    The run's own throughput divides by first send to last answer, so it includes the
    ramp-up (streams still starting) and the drain (streams with nothing left to send).
    Between the ``concurrency``-th send and the last send every worker is busy: each one
    that finished a request sent its next at once. Tokens are counted by when their chunk
    arrived (with `chunk_tokens`' apportioning). None when the run never filled up.
    """
    sends = sorted(r.start for r in records if r.status not in ("dropped",))
    if concurrency < 1 or len(sends) <= concurrency:
        return None
    begin, end = sends[concurrency - 1], sends[-1]
    if end - begin <= 0:
        return None
    tokens = sum(n for r in records if r.status == "ok"
                 for t, n in zip(r.chunk_times, r.chunk_tokens) if begin <= r.start + t < end)
    return {"window_s": [begin, end], "output_tokens_per_s": tokens / (end - begin)}


def summarize(records: Sequence[RequestRecord], *, wall_s: float | None = None,
              slo_ttft: float | None = None, slo_itl: float | None = None,
              concurrency: int | None = None) -> dict[str, object]:
    """The benchmark's headline numbers for ``records`` (one phase, one tag). With the
    closed loop's `concurrency`, also the throughput at full concurrency."""
    wall = wall_time(records) if wall_s is None else wall_s
    ok = [r for r in records if r.status == "ok"]
    sent = [r for r in records if r.status not in ("cancelled", "dropped")]
    good = [r for r in ok if is_good(r, slo_ttft, slo_itl)]
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    chunks = sum(len(r.chunk_times) for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]

    def per_s(x: float) -> float:
        return x / wall if wall > 0 else 0.0

    errors = Counter(f"{r.status}: {r.error}" for r in records
                     if r.error and r.status not in ("ok", "rate_limited"))
    return {
        "duration_s": wall,
        "requests": counts(records),
        "throughput": {
            "requests_per_s": per_s(len(ok)),
            "output_tokens_per_s": per_s(out_tokens),
            "prompt_tokens_per_s": per_s(prompt_tokens),
            "full_concurrency": (full_concurrency(records, concurrency)
                                 if concurrency else None),
        },
        "tokens": {
            "prompt": prompt_tokens,
            "output": out_tokens,
            "cached_prompt": sum(cached) if cached else None,
            "per_chunk_mean": out_tokens / chunks if chunks else None,
            "usage_reported": all(r.usage_reported for r in ok),
        },
        "ttft_s": distribution(r.ttft for r in ok if r.ttft is not None),
        "itl_s": distribution(g for r in ok for g in r.gaps),
        "e2e_s": distribution(r.e2e for r in ok if r.e2e is not None),
        "tpot_s": distribution(t for r in ok if (t := tpot(r)) is not None),
        "slo": {
            "ttft_s": slo_ttft,
            "itl_p95_s": slo_itl,
            "good": len(good),
            "attainment": len(good) / len(sent) if sent else None,
            "attainment_admitted": len(good) / len(ok) if ok else None,
            "goodput_requests_per_s": per_s(len(good)),
            "goodput_output_tokens_per_s": per_s(sum(r.output_tokens or 0 for r in good)),
        },
        "refusals": refusals(records),
        "reconnects": sum(r.reconnects for r in records),
        "errors": dict(errors.most_common(5)),
    }


def gap_intervals(records: Iterable[RequestRecord]) -> list[tuple[float, float, int]]:
    """Every gap as (begin, end, request index) in run time (seconds since the run began)."""
    out = []
    for r in records:
        t = [r.start + x for x in r.chunk_times]
        out += [(a, b, r.index) for a, b in zip(t, t[1:])]
    return out


def interference(shorts: Sequence[RequestRecord], long: RequestRecord) -> dict[str, object]:
    """The short streams' ITL before, during and after the long request's prefill, and
    over the whole of its decode.

    The window is from the long request's send to its first token. A gap belongs to
    *during* if it overlaps the window at all: a decode step stalled by the prefill shows
    up as one gap that began before the long request's first token and may end just
    after it, in the same engine step. *Before* gaps end before the send; *after* gaps
    begin after the first token. Cancelled short streams (the run ends them) count: their
    gaps were real. A short request *sent* during the window waits in its TTFT, not in a
    gap, so those TTFTs are reported apart (``short_ttft_sent_during_s``).
    """
    send = long.start
    first = long.start + long.ttft if long.ttft is not None else None
    end = first if first is not None else long.start + (long.e2e or 0.0)
    done = long.start + long.e2e if long.e2e is not None else end
    gaps = gap_intervals(shorts)
    before = [b - a for a, b, _ in gaps if b <= send]
    during = [b - a for a, b, _ in gaps if a < end and b > send]
    after = [b - a for a, b, _ in gaps if a >= end]
    # The whole of the long request's decode: gaps that begin after its first token and
    # end by its last (each of these steps carried its row of ~6,000 keys).
    decoding = [b - a for a, b, _ in gaps if a >= end and b <= done]
    d_before, d_during = distribution(before), distribution(during)
    d_decoding = distribution(decoding)

    def over_before(d):
        if d_before["p95"] and d["p95"] is not None:
            return float(d["p95"]) / float(d_before["p95"])  # type: ignore[arg-type]
        return None

    return {
        "long": {"status": long.status, "ttft_s": long.ttft, "e2e_s": long.e2e,
                 "prompt_tokens": long.prompt_tokens, "output_tokens": long.output_tokens,
                 "error": long.error},
        "window_s": [send, end],
        "short_itl_before_s": d_before,
        "short_itl_during_s": d_during,
        "short_itl_after_s": distribution(after),
        "short_itl_while_long_decodes_s": d_decoding,
        "long_decode_window_s": [end, done],
        "short_ttft_sent_during_s": distribution(
            r.ttft for r in shorts if send <= r.start < end and r.ttft is not None),
        "p95_during_over_before": over_before(d_during),
        "p95_while_long_decodes_over_before": over_before(d_decoding),
    }
