"""Sampling on the device for the whole batch, each row with its own parameters.

Compiled variants per row bucket: `greedy` (argmax; the common case, no sort) and `full`
(logit bias, structured output's token mask, temperature, top-k, top-p, min-p, seeded
categorical; `penalties` is `full` with the token histories penalties count). Both also return
the chosen token's logprob and the top-20 logprobs, and pack everything into one float32
array so a step costs exactly one device-to-host copy. Token ids are exact in float32 up to
2**24, far above any vocabulary.

Logprobs are those of the model's distribution (log-softmax of the raw logits), as vLLM
reports them by default, not of the distribution after temperature or truncation.

Seeded sampling is reproducible whatever else is in the batch: the key for a row is
`fold_in(PRNGKey(seed), num_generated)`, a function of the request alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from scheduler.protocol import SampledToken, TokenLogprob

TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries of a request's `logit_bias`
PACK_WIDTH = 2 + 2 * TOP_LOGPROBS  # token, logprob, top ids, top logprobs


@struct.dataclass
class SamplingBatch:
    temperature: jax.Array  # [rows] f32; 0 = greedy
    top_p: jax.Array  # [rows] f32
    top_k: jax.Array  # [rows] int32; 0 = off
    min_p: jax.Array  # [rows] f32
    seed: jax.Array  # [rows] uint32
    step: jax.Array  # [rows] int32: tokens generated so far
    presence: jax.Array  # [rows] f32
    frequency: jax.Array  # [rows] f32
    repetition: jax.Array  # [rows] f32
    # [rows, history] int32 ids, -1 padding; only the full variant reads them.
    generated_ids: jax.Array
    prompt_ids: jax.Array
    bias_ids: jax.Array  # [rows, MAX_LOGIT_BIAS] int32 token ids, -1 padding
    bias_values: jax.Array  # [rows, MAX_LOGIT_BIAS] f32
    # [rows, ceil(vocab / 32)] int32: bit i of word w allows token 32 * w + i (structured
    # output; all ones for a free row).
    allowed: jax.Array


def _argmax(x, block: int = 1024):
    """`jnp.argmax` over the last axis of [rows, n] (the first of equal maxima; a row
    with a NaN gets some index, and `unpack` fails it), found in two levels: the first
    block of `block` holding the row's maximum, then the first maximum in it. XLA:CPU
    runs argmax's paired (value, index) reduce unvectorised: 2.4 ms for 16 rows of
    49,152, against 0.2 ms for the blocks' plain maxima and two small argmaxes."""
    rows, n = x.shape
    if n <= block:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    nb = -(-n // block)
    if nb * block != n:
        x = jnp.pad(x, ((0, 0), (0, nb * block - n)), constant_values=-jnp.inf)
    blocks = x.reshape(rows, nb, block)
    b = jnp.argmax(blocks.max(axis=-1), axis=-1)
    inner = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]
    return (b * block + jnp.argmax(inner, axis=-1)).astype(jnp.int32)


def _logsumexp(x):
    """log(sum(exp(x))) over the last axis, without `jax.nn.logsumexp`'s guards for
    infinite maxima (2.2 ms for 16 rows of 49,152 on the CPU, against 1.3): a row with
    an infinity or a NaN gets a non-finite result, and `unpack` fails it."""
    m = x.max(axis=-1)
    return m + jnp.log(jnp.exp(x - m[:, None]).sum(axis=-1))


def _pack(tokens, logits, top=True):
    """The chosen tokens with their logprobs and the top-20, under the model's own
    distribution (`logits` raw): each is a logit less the row's logsumexp, taken only where
    needed, so the vocabulary-wide log-softmax is never materialised (2.6 ms instead of
    4.0 for 16 rows of SmolLM2's 49,152 on the CPU). The top-20 only where `top` (a
    traced bool: some row asked for `top_logprobs`), zeros otherwise: `lax.top_k` over
    the vocabulary costs more than the rest of a greedy sampler (6.3 ms for 16 rows on
    the CPU with it, 2.7 without)."""
    lse = _logsumexp(logits)
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=1)[:, 0] - lse

    def top_k(logits):
        top_l, top_ids = jax.lax.top_k(logits, TOP_LOGPROBS)
        return top_ids.astype(jnp.float32), top_l - lse[:, None]

    def none(logits):
        z = jnp.zeros((logits.shape[0], TOP_LOGPROBS), jnp.float32)
        return z, z

    ids, top_lp = top_k(logits) if top is True else jax.lax.cond(top, top_k, none, logits)
    return jnp.concatenate(
        [tokens[:, None].astype(jnp.float32), chosen[:, None], ids, top_lp], axis=1)


def sample_greedy(logits, top=True):
    """logits [rows, vocab] f32 -> packed [rows, PACK_WIDTH] (`top`: `_pack`'s)."""
    return _pack(_argmax(logits), logits, top)


def wants_top(rows: list) -> bool:
    """Whether any sampled row asked for its top logprobs (the samplers' `top`)."""
    return any(c.sampling.top_logprobs for c in rows)


def _counts(ids, vocab):
    rows = ids.shape[0]
    valid = ids >= 0
    safe = jnp.where(valid, ids, 0)
    return jnp.zeros((rows, vocab), jnp.float32).at[
        jnp.arange(rows)[:, None], safe].add(valid.astype(jnp.float32))


# After this many bisection steps over the whole vocabulary, `keep_mask` carries on over
# the blocks of `_BLOCK` entries that can still hold a token above the bracket's lower
# bound, where at most `_CANDIDATE_BLOCKS` of them can (else over the whole vocabulary).
_COARSE_STEPS = 8
_BLOCK = 256
_CANDIDATE_BLOCKS = 16


def keep_mask(probs, top_k, top_p, min_p, iterations: int = 30):
    """[rows, vocab] bool: the tokens top-k, top-p and min-p keep, without sorting the
    vocabulary (a sort of 16 rows of 49k logits cost 220 ms a step on the CPU, and
    `lax.top_k` of the 128 most probable 18 ms a row). Each cut is a probability
    threshold found by bisection: top-k keeps the tokens at least as probable as the
    k-th; top-p those whose more probable tokens hold less than `top_p` of the mass (the
    smallest set reaching it); min-p those at least `min_p` x the most probable. Ties at a
    threshold are all kept. A search no row of the batch asks for is skipped.

    A search's first `_COARSE_STEPS` steps pass over the whole vocabulary; every later
    midpoint is above their lower bound, so the rest count only the tokens above it: the
    blocks of `_BLOCK` entries whose largest reaches it, gathered once when every row
    has at most `_CANDIDATE_BLOCKS` of them (a peaked distribution's usual case: Gemma
    3's 262,144 entries, 16 rows, top-p 43 -> ~15 ms on the CPU), else the whole
    vocabulary again. The thresholds are the same either way (up to the order of a
    float sum)."""
    rows, vocab = probs.shape
    pmax = probs.max(-1)
    zero = jnp.zeros_like(pmax)
    k = top_k.astype(jnp.float32)

    # Each lower bound keeps its cut's last token (the k-th; the one that brings the
    # top-p set to `top_p`) and converges on it from below.
    def k_step(p, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        enough = (p >= mid[:, None]).sum(-1) >= k  # still k tokens at this height
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

    def p_step(p, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        short = jnp.where(p > mid[:, None], p, 0.0).sum(-1) < top_p  # inside the set
        return jnp.where(short, lo, mid), jnp.where(short, mid, hi)

    def steps(step, p, first, last, bounds):
        return jax.lax.fori_loop(first, last, lambda _, b: step(p, b), bounds)

    blocks = vocab // _BLOCK if vocab % _BLOCK == 0 else 0
    narrow = blocks > _CANDIDATE_BLOCKS and iterations > _COARSE_STEPS

    def run(step, wanted):
        if not narrow:
            return steps(step, probs, 0, iterations, (zero, pmax))[0]
        bounds = steps(step, probs, 0, _COARSE_STEPS, (zero, pmax))
        by_block = probs.reshape(rows, blocks, _BLOCK)
        top = by_block.max(-1)
        reach = top >= bounds[0][:, None]
        many = jnp.where(wanted, reach.sum(-1), 0).max() > _CANDIDATE_BLOCKS

        def candidates():  # the blocks above the bound (others' tokens all sit below it)
            _, idx = jax.lax.top_k(jnp.where(reach, top, -1.0), _CANDIDATE_BLOCKS)
            p = jnp.take_along_axis(by_block, idx[:, :, None], axis=1).reshape(rows, -1)
            return steps(step, p, _COARSE_STEPS, iterations, bounds)[0]

        return jax.lax.cond(many, lambda: steps(step, probs, _COARSE_STEPS, iterations,
                                                bounds)[0], candidates)

    def search(step, wanted):
        return jax.lax.cond(jnp.any(wanted), lambda: run(step, wanted), lambda: zero)

    cut = jnp.maximum(jnp.maximum(jnp.where(top_k > 0, search(k_step, top_k > 0), 0.0),
                                  jnp.where(top_p < 1.0, search(p_step, top_p < 1.0), 0.0)),
                      min_p * pmax)
    return (probs >= cut[:, None]) & (probs > 0.0)


def sample_full(logits, sb: SamplingBatch, top=True):
    """logits [rows, vocab] f32 -> packed [rows, PACK_WIDTH] (`top`: `_pack`'s). The
    work over the whole vocabulary is a few passes: penalties only in the `penalties`
    variant (token histories wider than 1), the structured-output mask only when a row
    has one, one softmax, the truncation (`keep_mask`), and the draw from what it keeps
    by one uniform number per row (the inverse of its cumulative distribution)."""
    rows, vocab = logits.shape
    x = logits
    if sb.generated_ids.shape[1] > 1:  # (static: the `penalties` variant's histories)
        gen_counts = _counts(sb.generated_ids, vocab)
        seen = (gen_counts + _counts(sb.prompt_ids, vocab)) > 0
        rep = sb.repetition[:, None]
        x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
        x = x - sb.presence[:, None] * (gen_counts > 0) - sb.frequency[:, None] * gen_counts
    biased = sb.bias_ids >= 0
    x = x.at[jnp.arange(rows)[:, None], jnp.where(biased, sb.bias_ids, 0)].add(
        jnp.where(biased, sb.bias_values, 0.0))

    def constrain(x):
        ids = jnp.arange(vocab)
        return jnp.where((sb.allowed[:, ids // 32] >> (ids % 32)) & 1 > 0, x, -jnp.inf)

    x = jax.lax.cond(jnp.any(sb.allowed != -1), constrain, lambda x: x, x)
    greedy_tok = _argmax(x)

    def sample(x):
        temp = jnp.where(sb.temperature > 0, sb.temperature, 1.0)
        probs = jax.nn.softmax(x / temp[:, None], axis=-1)
        truncate = jnp.any((sb.top_k > 0) | (sb.top_p < 1.0) | (sb.min_p > 0.0))
        keep = jax.lax.cond(truncate, lambda p: keep_mask(p, sb.top_k, sb.top_p, sb.min_p),
                            lambda p: p > 0.0, probs)
        keep = keep.at[jnp.arange(rows), greedy_tok].set(True)
        cdf = jnp.cumsum(jnp.where(keep, probs, 0.0), axis=-1)

        def uniform(seed, step):  # the row's own draw: independent of the batch
            return jax.random.uniform(jax.random.fold_in(jax.random.PRNGKey(seed), step))

        at = jax.vmap(uniform)(sb.seed, sb.step) * cdf[:, -1]
        sampled = jnp.minimum(jnp.sum(cdf <= at[:, None], axis=-1), vocab - 1)
        sampled = jnp.where(jnp.take_along_axis(keep, sampled[:, None], axis=1)[:, 0],
                            sampled, greedy_tok).astype(jnp.int32)
        return jnp.where(sb.temperature > 0, sampled, greedy_tok)

    # Greedy rows here only for a bias, a mask or penalties: no sampling work for them.
    tokens = jax.lax.cond(jnp.any(sb.temperature > 0), sample, lambda x: greedy_tok, x)
    return _pack(tokens, logits, top)


# ---- host side: building a SamplingBatch from the plan, reading the packed result ---------


def sampling_batch(rows: list, n: int, hist: int, rng: np.random.Generator,
                   vocab: int) -> SamplingBatch:
    """Per-row parameters for the `rows` chunks that sample, padded to `n` rows. `hist` is
    the width of the token-history arrays (1 when no row asks for penalties). A row's
    structured-output constraint writes its token mask here (in the step's thread)."""
    temp = np.zeros(n, np.float32)
    top_p = np.ones(n, np.float32)
    top_k = np.zeros(n, np.int32)
    min_p = np.zeros(n, np.float32)
    seed = np.zeros(n, np.uint32)
    step = np.zeros(n, np.int32)
    pres = np.zeros(n, np.float32)
    freq = np.zeros(n, np.float32)
    rep = np.ones(n, np.float32)
    gen = np.full((n, hist), -1, np.int32)
    prm = np.full((n, hist), -1, np.int32)
    bias_ids = np.full((n, MAX_LOGIT_BIAS), -1, np.int32)
    bias_values = np.zeros((n, MAX_LOGIT_BIAS), np.float32)
    allowed = np.full((n, (vocab + 31) // 32), -1, np.int32)
    for r, c in enumerate(rows):
        sp = c.sampling
        temp[r], top_p[r], top_k[r], min_p[r] = sp.temperature, sp.top_p, sp.top_k, sp.min_p
        # Unseeded requests draw a fresh seed each step; seeded ones are reproducible.
        seed[r] = (sp.seed if sp.seed is not None
                   else int(rng.integers(0, 2**32, dtype=np.uint64))) & 0xFFFFFFFF
        step[r] = c.num_generated
        pres[r], freq[r], rep[r] = sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty
        if hist > 1 and sp.needs_penalties:
            g = list(c.penalty_token_ids)[-hist:]
            p = list(c.prompt_token_ids)[-hist:]
            gen[r, :len(g)] = g
            prm[r, :len(p)] = p
        if sp.logit_bias:
            ids, values = zip(*sp.logit_bias[:MAX_LOGIT_BIAS])
            bias_ids[r, :len(ids)], bias_values[r, :len(ids)] = ids, values
        if c.constraint is not None:
            c.constraint.fill(allowed[r])
    return SamplingBatch(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                         step=step, presence=pres, frequency=freq, repetition=rep,
                         generated_ids=gen, prompt_ids=prm, bias_ids=bias_ids,
                         bias_values=bias_values, allowed=allowed)


NONFINITE = "the model's logits were not finite (NaN or infinity)"


def kind_of(rows: list) -> str:
    """The sampler variant a step's sampling rows need: "greedy" when every row is plain
    argmax, "penalties" when any counts its tokens, else "full"."""
    if any(c.sampling.needs_penalties for c in rows):
        return "penalties"
    if all(c.sampling.is_greedy and not c.sampling.logit_bias and c.constraint is None
           for c in rows):
        return "greedy"
    return "full"


def unpack(packed: np.ndarray, rows: list) -> tuple[dict[int, SampledToken], dict[int, str],
                                                   dict[int, list[SampledToken]]]:
    """The packed [rows, PACK_WIDTH] result -> (seq_id -> SampledToken (logprobs if
    asked), seq_id -> why its row failed, seq_id -> the tokens of a sequence with several
    rows (a speculative verify, `packing.draft_rows`), in position order).

    A row whose chosen token's logprob is not finite had a NaN or an infinity among its
    logits (log-softmax spreads either to the whole row; finite logits always give a
    finite logprob): it fails alone instead of emitting an arbitrary token (a verify's
    sequence fails if any of its rows does). The check reads a value the sampler
    computes anyway, so it costs nothing on the device."""
    failed: dict[int, str] = {}
    by_seq: dict[int, list[tuple[int, SampledToken]]] = {}  # (position, token) per row
    finite = np.isfinite(packed[:len(rows), 1])
    for r, c in enumerate(rows):
        if not finite[r]:
            failed[c.seq_id] = NONFINITE
            continue
        sp = c.sampling
        tok = SampledToken(token_id=int(packed[r, 0]))
        if sp.logprobs or sp.top_logprobs:
            tok.logprob = float(packed[r, 1])
            k = min(sp.top_logprobs, TOP_LOGPROBS)
            tok.top_logprobs = [TokenLogprob(int(packed[r, 2 + j]),
                                             float(packed[r, 2 + TOP_LOGPROBS + j]))
                                for j in range(k)]
        by_seq.setdefault(c.seq_id, []).append((c.start_pos, tok))
    out, drafted = {}, {}
    for sid, toks in by_seq.items():
        if sid in failed:
            continue
        toks.sort(key=lambda pt: pt[0])
        out[sid] = toks[0][1]
        if len(toks) > 1:
            drafted[sid] = [t for _, t in toks]
    return out, failed, drafted
