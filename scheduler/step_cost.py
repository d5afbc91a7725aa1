"""How long steps take, learned online, so prefill never slows decoding past a bound.

A step that carries prefill tokens beside the running decodes makes every decoding
stream's next token late by the prefill's cost. The policy therefore caps the prefill
tokens of a step that also decodes: the step may take at most
``max(itl_target_s, decode_time * (1 + prefill_slowdown))``, where `decode_time` is what a
decode-only step of that size takes. Prefill always gets at least `min_prefill_tokens`, so
a long prompt keeps moving even when decoding alone already misses the target.

The model is two running averages fed with measured step times: decode-only step time
by number of decoding sequences, and the marginal cost of one prefill token. Until a
step with prefill has been measured, the budget is the floor (and with no decode-only
step measured yet, there is no limit). Pure Python, no clocks of
its own: the engine reports each step's duration.
"""

from __future__ import annotations

_ALPHA = 0.2  # weight of the newest measurement in the running averages


class StepCostModel:
    def __init__(self, *, itl_target_s: float, prefill_slowdown: float,
                 min_prefill_tokens: int) -> None:
        self.itl_target_s = itl_target_s
        self.prefill_slowdown = prefill_slowdown
        self.min_prefill_tokens = min_prefill_tokens
        self._decode_s: dict[int, float] = {}  # decoding sequences -> decode-only step time
        self.prefill_token_s: float | None = None  # marginal seconds per prefill token
        # Figures from the runner's warm-up (every compiled shape run once, timed): used
        # until the first real step of their kind replaces them outright.
        self._seeded: set[int] = set()
        self._prefill_seeded = False

    def decode_time(self, num_decode: int) -> float | None:
        if num_decode in self._decode_s:
            return self._decode_s[num_decode]
        if not self._decode_s:
            return None
        # Nearest measured size at or above (steps pad up to buckets), else the largest.
        above = [n for n in self._decode_s if n >= num_decode]
        return self._decode_s[min(above) if above else max(self._decode_s)]

    def observe(self, num_decode: int, prefill_tokens: int, seconds: float) -> None:
        if prefill_tokens == 0:
            if num_decode:
                old = self._decode_s.get(num_decode)
                if num_decode in self._seeded:
                    self._seeded.discard(num_decode)
                    old = None
                self._decode_s[num_decode] = seconds if old is None else (
                    old + _ALPHA * (seconds - old))
            return
        base = self.decode_time(num_decode) if num_decode else 0.0
        if base is None:
            return
        per_token = max(seconds - base, 0.0) / prefill_tokens
        old = None if self._prefill_seeded else self.prefill_token_s
        self._prefill_seeded = False
        self.prefill_token_s = per_token if old is None else old + _ALPHA * (per_token - old)

    def seed(self, num_decode: int, prefill_tokens: int, seconds: float) -> None:
        """A warm-up measurement of one compiled shape (`num_decode` decode rows beside
        `prefill_tokens` prompt tokens): an estimate from the first second, before any
        request ran, so admission can predict the first burst like any later one. A real
        step of the same kind replaces it; a shape already measured for real ignores it."""
        if prefill_tokens == 0:
            if num_decode and num_decode not in self._decode_s:
                self._decode_s[num_decode] = seconds
                self._seeded.add(num_decode)
            return
        if self.prefill_token_s is not None and not self._prefill_seeded:
            return
        base = self.decode_time(num_decode) if num_decode else 0.0
        if base is None:
            return
        per_token = max(seconds - base, 0.0) / prefill_tokens
        old = self.prefill_token_s  # several shapes seed it: their running average
        self.prefill_token_s = per_token if old is None else old + _ALPHA * (per_token - old)
        self._prefill_seeded = True

    def estimate(self, num_decode: int, prefill_tokens: int) -> float:
        """Expected seconds of a step with these decodes and prefill tokens (0 for the
        parts not measured yet)."""
        decode = self.decode_time(num_decode) if num_decode else None
        return (decode or 0.0) + prefill_tokens * (self.prefill_token_s or 0.0)

    def prefill_budget(self, num_decode: int) -> int | None:
        """Prefill tokens a step with `num_decode` decodes may carry; None: no limit."""
        if num_decode == 0:
            return None
        base = self.decode_time(num_decode)
        if base is None:
            return None  # nothing measured (a runner that reports no times): no limit
        if not self.prefill_token_s:
            return self.min_prefill_tokens
        allowed = max(self.itl_target_s, base * (1.0 + self.prefill_slowdown)) - base
        return max(self.min_prefill_tokens, int(allowed / self.prefill_token_s + 1e-6))
