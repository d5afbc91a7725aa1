"""Speculative decoding: a decode step that may yield several tokens of a sequence.

Decoding reads every weight for a handful of rows; verifying k proposed tokens costs k
more rows of the same step, so each proposal the model agrees with is a token nearly for
free. A proposer guesses the next tokens of a sequence (`Proposer`; the n-gram one here
matches the last tokens against the prompt and output so far, vLLM's and llama.cpp's
prompt lookup; a draft model's greedy guesses, model/draft.py); the policy turns a decode chunk into a verify chunk (`SeqChunk.draft`:
the last known token and k proposals, each position a decode row of the same step,
scheduler/protocol.py); the runner samples at every position as if the proposals before
it were the sequence's tokens.

Exactness: the proposals are a point guess (a deterministic proposer), so verification is
sampling itself. Row i draws from the target distribution given the proposals before it,
with the key non-speculative decoding would use for that token (`num_generated + i`); a
proposal is accepted while it equals the row's draw, and the first draw that differs is
the next token. Every emitted token is thus a draw of the target distribution given the
tokens before it, which is rejection sampling for a point proposal (accept with
probability p(d); on rejection the draw conditioned on differing is p without d,
renormalised). Greedy output is token for token what plain decoding gives, and so is
seeded sampling, as far as a row's logits do not depend on the rows beside it: exactly
with f32 weights; with the CPU's int8 weights a verify's rows round as batched rows do,
and an answer can part from the plain one where a batched answer parts from an alone
one (docs/benchmarks.md, "Speculative decoding"). Penalties count the proposals before a row, a grammar masks each row as
it would be after them (a proposal it refuses is cut before verification), logprobs are
the rows' own.

Pages: the positions of the proposals get pages only where the pool has them free; once
the verify is committed, pages past the sequence's new end go back, and only pages full
of accepted tokens join the prefix cache (a rejected proposal never reaches it).

When it pays (`Speculation._speculate`, per step): each sequence keeps a decayed count of
its proposals accepted and rejected, beside the pool's (a new sequence's prior); its k is
as long as each further proposal still has a fair chance (`_k_for`). The step takes the
prefix of the proposals, most likely first, with the most tokens expected a second
(`_step_rate`: a step's time jumps at its bucket's edges, so several verifies may pay
where one does not), counting an overlapped step as the longer of its computation and the
engine's host work a step, and a verify's step, which is not overlapped, as their sum;
within the ITL target (or the plain step's time where that is already past it). A step
carrying a prompt chunk carries no proposals (a first token is not delayed for them). A
sequence whose proposals are refused is retried with one proposal every `_PROBE_STEPS`
steps.

`Speculation` is a mixin of `Scheduler` (scheduler/policy.py). (About 420 lines: the
proposer, the per-step choice and the books of a verify share one set of estimates.)
"""

from __future__ import annotations

import math
from typing import Protocol

from .batch import Batch
from .protocol import SampledToken
from .request import Phase, Sequence

_DECAY = 0.7  # weight of a sequence's earlier verifies in its acceptance estimate
_MIN_GAIN = 0.15  # a further proposal is worth a row while it is this likely to be accepted
_PROBE_STEPS = 16  # a sequence not worth speculating on is retried after this many steps
_MARGIN = 1.02  # a step's expected tokens per second must improve this much
_KEEP_STARTS = 4  # occurrences of an n-gram the lookup remembers (the latest)
_POOL_DECAY = 0.95  # weight of the pool's earlier verifies in a new sequence's prior


class Proposer(Protocol):
    """Guesses a sequence's next tokens (on the engine's thread, while a step is planned).
    One that computes them on a device (a draft model: model/draft.py; an EAGLE head)
    also has `prepare(wanted)`, which the engine runs in its worker thread before the
    plan for `Speculation.spec_wanted`'s (sequence, k), and `forget(seq)`."""

    name: str

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to `k` tokens to follow `seq.token_ids` (empty: no guess)."""
        ...


class SpecState:
    """One sequence's speculation: its n-gram index for lookups and its acceptance."""

    __slots__ = ("index", "indexed", "accepted", "trials", "idle", "found")

    def __init__(self) -> None:
        # The last few starts of each `min_n`-gram of the sequence's tokens (those before
        # its last `min_n`), kept as the tokens grow: a lookup is a dict read, whatever
        # the context's length.
        self.index: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0  # n-grams starting before this position are in `index`
        self.accepted = 0.0  # decayed counts of proposals accepted and tried
        self.trials = 0.0
        self.idle = 0  # steps since its last verify
        self.found = 1.0  # decayed share of lookups that found a proposal

    def rate(self, prior: float) -> float:
        """Estimated chance that a proposal is accepted: its own record, and `prior` (the
        pool's recent acceptance) worth one trial, so a new sequence starts where the
        others are and one whose proposals keep failing falls under `_MIN_GAIN`."""
        return (self.accepted + prior) / (self.trials + 1.0)

    def grow(self, toks: list[int], n: int) -> None:
        """Index the `n`-grams of `toks` up to (not including) the last one."""
        end = len(toks) - n
        if end < self.indexed:  # (tokens only grow; start over if that ever changes)
            self.index.clear()
            self.indexed = 0
        index = self.index
        for s in range(self.indexed, end):
            key = tuple(toks[s:s + n])
            starts = index.get(key)
            if starts is None:
                index[key] = [s]
            else:
                starts.append(s)
                if len(starts) > _KEEP_STARTS:
                    del starts[0]
        self.indexed = max(self.indexed, end)


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the last
    n tokens (n from `max_n` down to `min_n`) in the prompt and the output so far."""

    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seq: Sequence, k: int) -> list[int]:
        if seq.spec is None:
            seq.spec = SpecState()
        return lookup(seq.token_ids, k, self.min_n, self.max_n, seq.spec)


def lookup(toks: list[int], k: int, min_n: int, max_n: int,
           state: SpecState | None = None) -> list[int]:
    """Up to `k` tokens following an earlier match of `toks`' last n tokens (the longest
    n that has one): the latest match with `k` tokens after it, else the one with most
    (in a run that repeats, the latest match ends at the sequence's end). Candidates are
    the last `_KEEP_STARTS` occurrences of the last `min_n` tokens (`SpecState.index`)."""
    total = len(toks)
    if total <= min_n:
        return []
    state = state or SpecState()
    state.grow(toks, min_n)
    starts = state.index.get(tuple(toks[total - min_n:]))
    if not starts:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        longer = toks[total - n:total - min_n]  # what must precede the min_n-gram too
        best: list[int] = []
        for p in reversed(starts):
            if p < n - min_n or (longer and toks[p - len(longer):p] != longer):
                continue
            follow = toks[p + min_n:p + min_n + k]
            if len(follow) > len(best):
                best = follow
                if len(best) == k:
                    break
        if best:
            return best
    return []


def make_proposer(config) -> Proposer | None:
    """The pool's proposer (`SchedulerConfig.speculative`); None: speculation off, or a
    draft model, which the loader builds (model/draft.py) and hands the engine."""
    if config.speculative in ("off", "draft"):
        return None
    if config.speculative == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    raise ValueError(f"speculative = {config.speculative!r}: 'off' or 'ngram'")


def _k_for(rate: float, k_max: int) -> int:
    """Proposals worth a row each: while the j-th is accepted with chance >= _MIN_GAIN."""
    if rate <= _MIN_GAIN:
        return 0
    if rate >= 0.99:
        return k_max
    return max(1, min(k_max, int(math.log(_MIN_GAIN) / math.log(rate))))


def _gain(rate: float, k: int) -> float:
    """Expected accepted proposals of k (each accepted only after the ones before it)."""
    return sum(rate ** j for j in range(1, k + 1))


class SpecCounters:
    """Totals with vLLM's meanings (`sluice:spec_decode_*`)."""

    def __init__(self, k_max: int) -> None:
        self.drafts = 0  # verifies (sequences x steps that carried proposals)
        self.draft_tokens = 0  # proposals verified
        self.accepted_tokens = 0  # proposals accepted
        self.accepted_per_pos = [0] * k_max  # accepted at position i of a verify
        self.emitted_tokens = 0  # tokens the verifies produced (accepted + one each)
        self.steps = 0  # steps that carried a verify


class Speculation:
    """The policy's side of speculative decoding (a mixin of `Scheduler`)."""

    def _init_speculation(self, config) -> None:
        self.proposer = None if self.static else make_proposer(config)
        self.spec_k = config.num_speculative_tokens
        self.spec = SpecCounters(self.spec_k)
        # The pool's recent acceptance (decayed counts over verifies): a new sequence's
        # prior (`SpecState.rate`).
        self._pool_accepted = 0.0
        self._pool_trials = 0.0
        # Seconds a step that cannot overlap the next one's planning costs beyond its
        # computation (the engine's host work per step, as measured): a verify's price.
        self.spec_sync_s = 0.0

    def _speculate(self, batch: Batch) -> None:
        """Turn some of the step's decode chunks into verifies (see the module doc)."""
        proposer = self.proposer
        nd = batch.num_decode
        spare = min(self.limits.max_decode_seqs, self.config.max_step_tokens) - nd
        if proposer is None or nd == 0 or spare <= 0 or self._prompts_ready():
            return
        base = self._spec_step_time(nd)
        prior = (self._pool_accepted + 1.0) / (self._pool_trials + 2.0)
        interactive = any(not s.batch for s in batch.seqs[:nd])
        # (expected accepted per row, chunk index, proposals; pending: their count, None)
        cands: list[tuple[float, int, int, float, list[int] | None]] = []
        for i in range(nd):
            seq, chunk = batch.seqs[i], batch.plan.chunks[i]
            if len(chunk.token_ids) != 1 or seq.phase is not Phase.DECODE:
                continue
            if seq.batch and interactive:
                continue  # batch jobs take only what interactive work leaves (background.py)
            if seq.spec is None:
                seq.spec = SpecState()
            st = seq.spec
            rate = st.rate(prior)
            st.idle += 1
            k = self._wanted_k(seq, rate, chunk.start_pos, spare)
            if k <= 0:
                continue
            if chunk.pending:
                # Its last token is still on the device: it can propose once this step
                # is committed, before the next is planned (overlap given up once), if
                # a verify would pay (counted at the chance it finds a proposal).
                st.idle -= 1
                g = st.found * _gain(rate, k)
                cands.append((g / k, i, k, g, None))
                continue
            props = proposer.propose(seq, k)
            st.found = _DECAY * st.found + (1 - _DECAY) * bool(props)
            if props and seq.constraint is not None:
                props = props[:seq.constraint.valid_prefix(props)]
            if props:
                g = _gain(rate, len(props))
                cands.append((g / len(props), i, len(props), g, props))
        if not cands:
            return
        # The best prefix of the candidates, most promising first: a step's time jumps at
        # its bucket's edge, so several verifies may pay where one alone does not.
        cands.sort(key=lambda c: -c[0])
        best = self._step_rate(nd, base, 0, 0.0) * _MARGIN
        rows, gain, take, guess = 0, 0.0, 0, False
        for m, (_, i, n, g, props) in enumerate(cands, 1):
            if rows + n > spare:
                break
            rows, gain = rows + n, gain + g
            guess = guess or props is None
            rate = self._step_rate(nd, base, rows, gain, explore=not guess)
            if rate > best or rate == math.inf:  # (a shape not measured yet: try them all)
                best, take = rate, m
        for _, i, n, g, props in cands[:take]:
            if props is None:
                batch.spec_sync = True
            else:
                self._verify_chunk(batch, i, props)

    def _wanted_k(self, seq: Sequence, rate: float, start: int, spare: int) -> int:
        """How many tokens to guess for `seq`, whose last token is at `start` (0: none):
        what its acceptance makes worth a row each, or a probe of one after
        `_PROBE_STEPS` steps without; within max_tokens, the context and `spare` rows."""
        st = seq.spec
        k = _k_for(rate, self.spec_k)
        if k == 0 or st.found < _MIN_GAIN:
            if st.idle < _PROBE_STEPS:
                return 0
            k = 1
        # (this step's own token is one of max_tokens)
        return min(k, seq.max_tokens - seq.num_generated - 1 - seq.inflight,
                   (self.max_context or 1 << 30) - 1 - start, spare)

    def spec_wanted(self) -> list[tuple[Sequence, int]]:
        """For a proposer that computes its guesses (a draft model's `prepare`), before
        the next plan: the decoding sequences whose last token is known and that are
        worth guessing for, each with its k (none beside a prompt chunk)."""
        if getattr(self.proposer, "prepare", None) is None or self._prompts_ready():
            return []
        decoding = [s for s in self.running.values() if s.phase is Phase.DECODE]
        spare = min(self.limits.max_decode_seqs, self.config.max_step_tokens) - len(decoding)
        if spare <= 0:
            return []
        prior = (self._pool_accepted + 1.0) / (self._pool_trials + 2.0)
        interactive = any(not s.batch for s in decoding)
        out = []
        for seq in decoding:
            if seq.inflight or (seq.batch and interactive):
                continue
            if seq.spec is None:
                seq.spec = SpecState()
            k = self._wanted_k(seq, seq.spec.rate(prior), len(seq.token_ids) - 1, spare)
            if k > 0:
                out.append((seq, k))
        return out

    def spec_forget(self, seq: Sequence) -> None:
        """The sequence left the running set: a proposer's state of it goes."""
        forget = getattr(self.proposer, "forget", None)
        if forget is not None:
            forget(seq)

    def _step_rate(self, nd: int, base: float, rows: int, gain: float,
                   explore: bool = True) -> float:
        """Tokens a second of a step of `nd` decodes (`base` seconds) with `rows` proposal
        rows expected to yield `gain` tokens (0 rows: plain, overlapped); 0 past the ITL
        target (or `base` where that is past it already). An overlapped step takes the
        longer of its computation and the engine's host work a step (`spec_sync_s`, 0
        without overlap); a verify's step, which is not overlapped, their sum. With
        `explore`, a shape that has not run a real step yet is tried (its warm-up ran on
        a made-up context): its first verify measures it; without (a pending sequence's
        proposals are only a guess), its warm-up figure stands."""
        host = self.spec_sync_s
        if not rows:
            return nd / max(base, host) if base > 0 else 0.0
        t = self._spec_step_time(nd + rows, explore)
        if t <= 0 or base <= 0:
            return math.inf
        limit = max(self.itl_target or self.config.itl_target_s, base)
        if limit > 0 and t > limit:
            return 0.0
        return (nd + gain) / (t + host)

    def _spec_step_time(self, rows: int, explore: bool = True) -> float:
        """Predicted seconds of a decode step of `rows` rows (0: not measured yet, with
        `explore`)."""
        cost = self.cost
        return cost.predict(rows, 0) if cost.measured(rows, 0) or not explore else 0.0

    def _prompts_ready(self) -> bool:
        """A prompt could take part of this step (prefilling, or admissible)."""
        if any(s.phase is Phase.PREFILL for s in self.running.values()):
            return True
        return bool(self.waiting) and len(self.running) < self.max_running

    def _verify_chunk(self, batch: Batch, i: int, props: list[int]) -> None:
        """Decode chunk i becomes a verify of `props`, where pages for them are free."""
        seq, chunk = batch.seqs[i], batch.plan.chunks[i]
        pages, ps = self.pages, self.pages.page_size
        # Free pages only (never a cached prefix evicted for a guess), the reserve kept.
        room = max(0, pages.num_free - self.config.kv_reserve_pages)
        props = props[:len(seq.kv_pages) * ps + room * ps - 1 - chunk.start_pos]
        if not props:
            return
        need = pages.pages_for(chunk.start_pos + len(props) + 1) - len(seq.kv_pages)
        if need > 0:
            seq.kv_pages.extend(pages.allocate(need))
        if self.window is not None:
            self.window.prepare(seq, chunk.start_pos, 1 + len(props), batch.plan.window_copies)
        chunk.token_ids = [*chunk.token_ids, *props]
        chunk.draft = len(props)
        batch.draft_rows += len(props)
        batch.work += len(props) * (chunk.start_pos + 1)
        seq.spec.idle = 0

    def _verified(self, seq: Sequence, chunk, drafted: list[SampledToken]
                  ) -> list[SampledToken]:
        """A verify is back: the tokens it yields (accepted proposals, then the first
        draw that differs), the books kept, pages past the new end released."""
        props = chunk.token_ids[1:]
        k = len(props)
        a = 0
        while a < k and a + 1 < len(drafted) and drafted[a].token_id == props[a]:
            a += 1
        out = drafted[:a + 1]
        st = seq.spec
        st.accepted = _DECAY * st.accepted + a
        st.trials = _DECAY * st.trials + a + (a < k)
        self._pool_accepted = _POOL_DECAY * self._pool_accepted + a
        self._pool_trials = _POOL_DECAY * self._pool_trials + a + (a < k)
        c = self.spec
        c.drafts += 1
        c.draft_tokens += k
        c.accepted_tokens += a
        c.emitted_tokens += len(out)
        for j in range(a):
            c.accepted_per_pos[j] += 1
        return out

    def _trim_pages(self, seq: Sequence) -> None:
        """Pages past what the sequence's known tokens need (its next write included)."""
        keep = self.pages.pages_for(len(seq.token_ids))
        if len(seq.kv_pages) > keep:
            tail = seq.kv_pages[keep:]
            del seq.kv_pages[keep:]
            self.pages.release(tail)
        if self.window is not None:
            self.window.trim(seq, keep)

    def spec_stats(self) -> dict:
        """What /v1/stats, the metrics and the dashboard show."""
        c = self.spec
        return {
            "mode": "off" if self.proposer is None else self.proposer.name,
            "num_speculative_tokens": self.spec_k,
            "drafts": c.drafts,
            "draft_tokens": c.draft_tokens,
            "accepted_tokens": c.accepted_tokens,
            "accepted_per_position": list(c.accepted_per_pos),
            "emitted_tokens": c.emitted_tokens,
            "acceptance_rate": c.accepted_tokens / c.draft_tokens if c.draft_tokens else 0.0,
            "mean_accepted_length": c.emitted_tokens / c.drafts if c.drafts else 0.0,
            "steps": c.steps,
        }
