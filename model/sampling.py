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
from flax import struct

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
