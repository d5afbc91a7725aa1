"""Sampling on the device for the whole batch, each row with its own parameters.

Two compiled variants per row bucket: `greedy` (argmax; the common case, no sort) and
`full` (penalties, temperature, top-k, top-p, min-p, seeded categorical). Both also return
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


def _pack(tokens, logprobs):
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logprobs, TOP_LOGPROBS)
    return jnp.concatenate(
        [tokens[:, None].astype(jnp.float32), chosen[:, None],
         top_ids.astype(jnp.float32), top_lp], axis=1)


def sample_greedy(logits):
    """logits [rows, vocab] f32 -> packed [rows, PACK_WIDTH]."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    return _pack(jnp.argmax(logits, axis=-1).astype(jnp.int32), logprobs)


def _counts(ids, vocab):
    rows = ids.shape[0]
    valid = ids >= 0
    safe = jnp.where(valid, ids, 0)
    return jnp.zeros((rows, vocab), jnp.float32).at[
        jnp.arange(rows)[:, None], safe].add(valid.astype(jnp.float32))


def sample_full(logits, sb: SamplingBatch):
    """logits [rows, vocab] f32 -> packed [rows, PACK_WIDTH]."""
    rows, vocab = logits.shape
    logprobs = jax.nn.log_softmax(logits, axis=-1)

    gen_counts = _counts(sb.generated_ids, vocab)
    seen = (gen_counts + _counts(sb.prompt_ids, vocab)) > 0
    rep = sb.repetition[:, None]
    x = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    x = x - sb.presence[:, None] * (gen_counts > 0) - sb.frequency[:, None] * gen_counts

    greedy_tok = jnp.argmax(x, axis=-1).astype(jnp.int32)
    temp = jnp.where(sb.temperature > 0, sb.temperature, 1.0)
    x = x / temp[:, None]

    order = jnp.argsort(-x, axis=-1)
    sx = jnp.take_along_axis(x, order, axis=-1)  # descending
    rank = jnp.arange(vocab)[None, :]
    keep = jnp.where(sb.top_k[:, None] > 0, rank < sb.top_k[:, None], True)
    probs = jax.nn.softmax(sx, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above this token
    keep &= before < sb.top_p[:, None]
    keep &= probs >= sb.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    sx = jnp.where(keep, sx, -jnp.inf)

    def draw(seed, step, row):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
        return jax.random.categorical(key, row)

    pick = jax.vmap(draw)(sb.seed, sb.step, sx)
    sampled = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    tokens = jnp.where(sb.temperature > 0, sampled, greedy_tok)
    return _pack(tokens, logprobs)


# ---- host side: building a SamplingBatch from the plan, reading the packed result ---------


def sampling_batch(rows: list, n: int, hist: int, rng: np.random.Generator) -> SamplingBatch:
    """Per-row parameters for the `rows` chunks that sample, padded to `n` rows. `hist` is
    the width of the token-history arrays (1 when no row asks for penalties)."""
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
    return SamplingBatch(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                         step=step, presence=pres, frequency=freq, repetition=rep,
                         generated_ids=gen, prompt_ids=prm)


def unpack(packed: np.ndarray, rows: list) -> dict[int, SampledToken]:
    """The packed [rows, PACK_WIDTH] result -> seq_id -> SampledToken (logprobs if asked)."""
    out = {}
    for r, c in enumerate(rows):
        sp = c.sampling
        tok = SampledToken(token_id=int(packed[r, 0]))
        if sp.logprobs or sp.top_logprobs:
            tok.logprob = float(packed[r, 1])
            k = min(sp.top_logprobs, TOP_LOGPROBS)
            tok.top_logprobs = [TokenLogprob(int(packed[r, 2 + j]),
                                             float(packed[r, 2 + TOP_LOGPROBS + j]))
                                for j in range(k)]
        out[c.seq_id] = tok
    return out
