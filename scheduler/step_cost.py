"""How long steps take, learned online: what the policy plans every step with.

Two uses:

- **The ITL budget** (`itl_budget_s`, the config's `itl_target_s`): a step that carries
  prompt tokens beside decodes may take at most ``max(itl_budget_s, decode_time * (1 +
  prefill_slowdown))`` (`itl_budget`, `prefill_budget`), at least `min_prefill_tokens` a
  step: the target where the decodes alone leave room under it, else a budget derived
  from what the decodes are measured to cost (prompts must move even where the hardware
  cannot hold the target with them).
- **A strict ITL target** (`itl_target_s` > 0 here: the config's `itl_strict`): every
  step is planned so that its *predicted* duration stays within the target (`predict`,
  `fits`), because a step's duration is the gap between two tokens of every stream in it.
  The policy asks how many prompt tokens fit beside the decodes, and whether one more
  running sequence still leaves a step that fits.

A step runs in a compiled *shape* (decode rows, prefill tokens): the smallest one that
holds it, so its cost moves in steps, not per token; the runner says which shapes exist
(`StepLimits.shapes`). Within a shape the cost grows with the attention's work, the keys
each query reads (``work``: the sum over chunks of each token's context length). The
model keeps, per shape, exponentially weighted means and (co)variances of (work, seconds),
and one slope shared by all shapes fitted within shapes (a fixed-effects regression, each
shape weighted by the inverse of its unexplained time variance; ridge towards 0 while the
contexts barely vary): ``predict = mean_s(shape) + slope * (work -
mean_work(shape))``. A shape the warm-up timed (every shape, in a pool with an ITL
target) starts from that figure, scaled by how the shapes that have run compare with
their own warm-up figures (the warm-up ran each on a dummy context: a shape the plan
never chooses because its seed looks too slow would otherwise never be corrected); one
never measured is estimated from the coarse model below at its padded size (decode-only
time by number of rows, plus a marginal cost per prefill token, seeded by the warm-up
too). The first real step of a shape replaces its seed. A shape not measured for a while
(`_STALE_STEPS` steps of others) is predicted at its figure times how the shapes measured
since have moved (`_drift`): the machine got slower or faster for all of them.

Under an ITL target a shape not yet run is predicted at the smaller of its scaled seed and
what the steps measured so far say (`_measured_guess`): the warm-up's dummy context (every
row its own 2,048 keys, no prefix shared) is the dear case, and a workload whose rows share
a system prompt runs its steps at a fraction of it, more so for some shapes than others, so
a scaled seed alone could keep the running set from ever growing into the shape that would
show it fits (measured: a 0.15 s target held one stream of a shared-prefix load). A guess
that is too low costs a step or two past the target, then that shape's own figure rules.

Pure Python, no clocks of its own: the engine reports each step's duration. (About 360
lines: the learning and the predictions read the same per-shape fits; split, each half
would reach into the other's state.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_ALPHA = 0.2  # weight of the newest measurement in the running averages
_RIDGE = 0.02  # within-shape spread of work (as a fraction of its mean) that counts as none
_NOISE_FLOOR = 0.01  # step times within a shape are taken to spread at least this much
# A shape's figure counts as stale after this many steps of other shapes since its last
# measurement; it then moves with how the shapes measured since have moved (`_drift`),
# within these bounds.
_STALE_STEPS = 16
_DRIFT_BOUNDS = (0.5, 2.0)


def chunk_work(start: int, n: int) -> int:
    """Keys read by the attention of a chunk of `n` tokens from position `start` (each
    token attends to itself and everything before it)."""
    return n * start + n * (n + 1) // 2


@dataclass(slots=True)
class _ShapeFit:
    """Exponentially weighted (work, seconds) statistics of one compiled shape."""

    n: int = 0  # real steps measured (0 with only a warm-up seed)
    seeded: bool = False  # `seconds` is the warm-up's figure (replaced by the first step)
    seed: float = 0.0  # the warm-up's figure (0: none), kept to calibrate the others
    work: float = 0.0
    seconds: float = 0.0
    var_work: float = 0.0
    cov: float = 0.0
    var_s: float = 0.0
    # When it was last measured (the model's step count) and the other measured shapes'
    # figures then: how far they have moved since says how far a stale one would have.
    stamp: int = 0
    others: dict = field(default_factory=dict)
    first: tuple[float, float] = (0.0, 0.0)  # (seconds, work) of its first real step
    drift: tuple[int, float] = (-1, 1.0)  # (step count, factor): `_drift`'s cache

    def add(self, work: float, seconds: float) -> None:
        if self.n == 0:
            self.work, self.seconds, self.seeded, self.first = work, seconds, False, (seconds, work)
        else:
            dx, dy = work - self.work, seconds - self.seconds
            self.work += _ALPHA * dx
            self.seconds += _ALPHA * dy
            self.var_work = (1 - _ALPHA) * (self.var_work + _ALPHA * dx * dx)
            self.cov = (1 - _ALPHA) * (self.cov + _ALPHA * dx * dy)
            self.var_s = (1 - _ALPHA) * (self.var_s + _ALPHA * dy * dy)
        self.n += 1

    @property
    def noise(self) -> float:
        """Variance of this shape's step times that its work does not explain (at least
        that of a 1% spread): the weight of its evidence on the slope is 1 / noise."""
        explained = self.cov * self.cov / self.var_work if self.var_work > 0 else 0.0
        return max(self.var_s - explained, (_NOISE_FLOOR * self.seconds) ** 2, 1e-12)


class StepCostModel:
    def __init__(self, *, itl_target_s: float = 0.0, itl_budget_s: float = 0.05,
                 prefill_slowdown: float = 0.4, min_prefill_tokens: int = 16,
                 shapes: tuple[tuple[int, int], ...] = (), block_q: int = 1) -> None:
        self.itl_target_s = itl_target_s  # the strict target (0: none)
        self.itl_budget_s = itl_budget_s  # 0: prompt chunks not paced
        self.prefill_slowdown = prefill_slowdown
        self.min_prefill_tokens = min_prefill_tokens
        self.block_q = max(1, block_q)
        # Compiled shapes, cheapest first (the runner picks the first that holds a step).
        self.shapes = sorted(set(shapes), key=lambda s: (s[0] + s[1], s[0]))
        self._fits: dict[tuple[int, int], _ShapeFit] = {}
        self._decode_s: dict[int, float] = {}  # decoding sequences -> decode-only step time
        self.prefill_token_s: float | None = None  # marginal seconds per prefill token
        # ... measured on steps whose prompt chunks are all short prompts' (questions):
        # a long prompt's chunks read a long context, and their token cost said nothing
        # of a question's (the door refused short questions through a 6,000-token
        # prefill that served them well within the TTFT target).
        self.question_token_s: float | None = None
        # Figures from the runner's warm-up (every compiled shape run once, timed): used
        # until the first real step of their kind replaces them outright.
        self._seeded: set[int] = set()
        self._prefill_seeded = False
        # Measured / warm-up time of the shapes that ran: the warm-up ran each shape on a
        # dummy context (every row its own 2,048 keys), so a shape that has not run yet
        # is predicted at its seed times what the others turned out to be.
        self._seed_ratio: float | None = None
        self._steps = 0  # real steps observed in a known shape (the fits' clock)

    # -- the coarse model: decode time by rows, one prefill token's marginal cost --------
    def decode_time(self, num_decode: int) -> float | None:
        if num_decode in self._decode_s:
            return self._decode_s[num_decode]
        if not self._decode_s:
            return None
        # Nearest measured size at or above (steps pad up to buckets), else the largest.
        above = [n for n in self._decode_s if n >= num_decode]
        return self._decode_s[min(above) if above else max(self._decode_s)]

    def estimate(self, num_decode: int, prefill_tokens: int) -> float:
        """Expected seconds of a step with these decodes and prefill tokens by the coarse
        model (0 for the parts not measured yet)."""
        decode = self.decode_time(num_decode) if num_decode else None
        return (decode or 0.0) + prefill_tokens * (self.prefill_token_s or 0.0)

    # -- learning --------------------------------------------------------------------
    def observe(self, num_decode: int, prefill_tokens: int, seconds: float, *,
                shape: tuple[int, int] | None = None, work: float = 0.0,
                questions: bool = False) -> None:
        """A step ran: `num_decode` decode rows and `prefill_tokens` prompt tokens (real,
        not padded) in compiled `shape` (None: not known), reading `work` keys;
        `questions`: its prompt chunks were all short prompts'."""
        if shape is not None:
            fit = self._fits.setdefault(tuple(shape), _ShapeFit())
            if fit.seed > 0:  # how the warm-up's figures compare with real steps
                ratio = min(4.0, max(0.25, seconds / fit.seed))
                old = self._seed_ratio
                self._seed_ratio = ratio if old is None else old + _ALPHA * (ratio - old)
            fit.add(work, seconds)
            self._steps += 1
            fit.stamp = self._steps
            fit.others = {k: (f.seconds, f.work) for k, f in self._fits.items()
                          if f.n and f is not fit}
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
        if questions:
            old = self.question_token_s
            self.question_token_s = per_token if old is None else (
                old + _ALPHA * (per_token - old))

    def question_seconds(self, tokens: float) -> float:
        """Seconds a short prompt's `tokens` take to prefill: at the cost measured on
        questions' steps, else on any prompt's."""
        return tokens * (self.question_token_s or self.prefill_token_s or 0.0)

    def seed(self, num_decode: int, prefill_tokens: int, seconds: float) -> None:
        """A warm-up measurement of one compiled shape (`num_decode` decode rows beside
        `prefill_tokens` prompt tokens): an estimate from the first second, before any
        request ran, so admission can predict the first burst like any later one. A real
        step of the same kind replaces it; a shape already measured for real ignores it."""
        shape = (num_decode, prefill_tokens)
        if shape not in self._fits:  # this shape's own figure, until it runs for real
            self._fits[shape] = _ShapeFit(seconds=seconds, seeded=True, seed=seconds)
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

    # -- prediction ------------------------------------------------------------------
    def padded(self, tokens: int) -> int:
        """A prefill chunk's tokens as the step computes them (whole query blocks)."""
        return -(-tokens // self.block_q) * self.block_q

    def shape_of(self, num_decode: int, prefill_padded: int) -> tuple[int, int]:
        """The compiled shape a step of this size runs in (itself when none is known)."""
        for d, p in self.shapes:
            if d >= num_decode and p >= prefill_padded:
                return (d, p)
        return (num_decode, prefill_padded)

    def measured(self, num_decode: int, prefill_padded: int) -> bool:
        """Whether the shape a step of this size runs in has run a real step (its time is
        known, not only the warm-up's on a made-up context)."""
        fit = self._fits.get(self.shape_of(num_decode, prefill_padded))
        return fit is not None and fit.n > 0

    @property
    def slope(self) -> float:
        """Seconds per key read, fitted within shapes (never negative), each shape's
        evidence weighted by the inverse of its unexplained time variance (weighted least
        squares): a shape whose work barely varies while its times jitter (a decode and a
        16-token chunk on a busy host: +-30 ms over +-800 keys) would otherwise set a
        slope several times the real one by chance covariance, and every prediction at a
        larger context would then refuse what fits. Steps over a wide range of work (a
        long prompt's chunks) carry the fit."""
        var = cov = ridge = 0.0
        for f in self._fits.values():
            if f.n >= 2:
                w = 1.0 / f.noise
                var += w * f.var_work
                cov += w * f.cov
                ridge += w * (_RIDGE * f.work) ** 2
        return max(0.0, cov / (var + ridge)) if var + ridge > 0 else 0.0

    def predict(self, num_decode: int, prefill_padded: int,
                work: float | None = None) -> float:
        """Expected seconds of a step of `num_decode` decode rows and `prefill_padded`
        prompt tokens (whole query blocks) reading `work` keys (None: as many as such
        steps usually read); 0 while nothing of the kind has been measured."""
        if num_decode == 0 and prefill_padded == 0:
            return 0.0
        shape = self.shape_of(num_decode, prefill_padded)
        fit = self._fits.get(shape)
        if fit is not None and (fit.n or fit.seeded):
            if not fit.n:
                seeded = fit.seconds * (self._seed_ratio or 1.0)
                guess = self._measured_guess(*shape) if self.itl_target_s > 0 else None
                return seeded if guess is None else min(seeded, guess)
            own = fit.seconds if work is None else fit.seconds + self.slope * (work - fit.work)
            return max(0.0, own * self._drift(fit))
        return self.estimate(shape[0], shape[1])

    def _drift(self, fit: _ShapeFit) -> float:
        """How much a shape's figure has likely moved since it was last measured, when
        that is `_STALE_STEPS` steps or more ago: the geometric mean of how the shapes
        measured since have moved (1 when none has). A figure measured once in a slow
        moment (the first steps under a burst of arrivals, a noisy neighbour) would
        otherwise stand for good under an ITL target, whose plan then never chooses that
        shape again to correct it: measured, a 0.15 s target held 4 streams for a whole
        run where 16 fitted."""
        if self._steps - fit.stamp < _STALE_STEPS:
            return 1.0
        at, factor = fit.drift
        if at == self._steps:
            return factor
        logs, slope = [], self.slope
        for k, f in self._fits.items():
            if f is fit or f.stamp <= fit.stamp:
                continue  # not measured since
            # Its figure then, and now at the same context (longer contexts are not the
            # machine's speed); first measured after `fit`: from its first step.
            then, work = fit.others.get(k, f.first)
            now = f.seconds + slope * (work - f.work)
            if then > 0 and now > 0:
                logs.append(math.log(now / then))
        lo, hi = _DRIFT_BOUNDS
        factor = min(hi, max(lo, math.exp(sum(logs) / len(logs)))) if logs else 1.0
        fit.drift = (self._steps, factor)
        return factor

    def _measured_guess(self, num_decode: int, prefill_padded: int) -> float | None:
        """A step of this size by the coarse model from real steps only (None until a
        decode step, and for a shape with prompt tokens a prefill, has been measured): the
        decode time of the nearest measured size at or above, else of the largest (so it
        errs low: a guess, to be corrected by the step it lets run)."""
        real = {n: s for n, s in self._decode_s.items() if n not in self._seeded}
        if not real:
            return None
        if prefill_padded and (self.prefill_token_s is None or self._prefill_seeded):
            return None
        above = [n for n in real if n >= num_decode]
        base = real[min(above)] if above else real[max(real)]
        return base + prefill_padded * (self.prefill_token_s or 0.0)

    def fits(self, num_decode: int, prefill_padded: int, work: float | None = None) -> bool:
        """Whether such a step is predicted to stay within the ITL target (always, with
        no target)."""
        target = self.itl_target_s
        return target <= 0 or self.predict(num_decode, prefill_padded, work) <= target

    def largest_prefill(self, num_decode: int, limit: int) -> int:
        """The most prompt tokens (whole query blocks, at most `limit`) a step beside
        `num_decode` decodes can carry within the ITL target; 0 if not even one block."""
        bq = self.block_q
        lo, hi = 0, limit // bq
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fits(num_decode, mid * bq):
                lo = mid
            else:
                hi = mid - 1
        return lo * bq

    def itl_budget(self, num_decode: int,
                   work: float | None = None) -> tuple[float, str, float] | None:
        """Seconds a step with `num_decode` decodes (reading `work` keys; None: as usual)
        may take with prompt chunks beside them, which rule set it, and the decodes' own
        seconds: ``"itl-target"``, the target, where the decodes alone take at
        most 1 / (1 + prefill_slowdown) of it; else ``"itl-derived"``, the decode step *
        (1 + prefill_slowdown): the target yields a share to prompts. None: no budget (no
        decodes, no target, or nothing measured yet)."""
        if num_decode == 0 or self.itl_budget_s <= 0:
            return None
        # The decode-only steps of this many rows as measured lately (what the pace was
        # tuned on: docs/benchmarks.md, "Both SLOs at once"), else the shape's prediction
        # at this work.
        base = self.decode_time(num_decode) or self.predict(num_decode, 0, work)
        if not base:
            return None  # nothing measured (a runner that reports no times): no limit
        derived = base * (1.0 + self.prefill_slowdown)
        if self.itl_budget_s >= derived:
            return self.itl_budget_s, "itl-target", base
        return derived, "itl-derived", base

    def prefill_budget(self, num_decode: int, work: float | None = None) -> int | None:
        """Prompt tokens a step with `num_decode` decodes may carry within `itl_budget`
        (None: no limit)."""
        budget = self.itl_budget(num_decode, work)
        if budget is None:
            return None
        if not self.prefill_token_s:
            return self.min_prefill_tokens
        allowed = budget[0] - budget[2]
        return max(self.min_prefill_tokens, int(allowed / self.prefill_token_s + 1e-6))
