"""Prompt logprobs (completions' `echo` with `logprobs`): each prompt token's logprob
under the tokens before it, computed from the step that prefills it.

The compiled step returns the last layer's output for every token beside the sampled
rows' logits (`llama.forward`); for a step holding chunks with `score_targets`, this small
second program puts every token of the step through the final norm and lm_head and keeps
each target's logprob and the top alternatives. Ordinary steps never compute logits they
do not sample. It compiles on first use, once per step size (the lm_head over a few
hundred rows: about a second on the CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from scheduler.protocol import SampledToken, SeqChunk, TokenLogprob

from .config import ModelConfig
from .llama import head_logits
from .sampling import TOP_LOGPROBS


class PromptScorer:
    def __init__(self, cfg: ModelConfig, feature_major: bool) -> None:
        def score(params, x, targets):
            lp = jax.nn.log_softmax(head_logits(params, x, cfg=cfg,
                                                feature_major=feature_major), -1)
            target_lp = jnp.take_along_axis(lp, jnp.maximum(targets, 0)[:, None], 1)[:, 0]
            top_lp, top_ids = jax.lax.top_k(lp, TOP_LOGPROBS)
            return target_lp, top_ids, top_lp

        self._fn = jax.jit(score)

    # Three parts, so that the runner can mirror the device one (model/multihost.py):
    # targets -> run -> unpack gives seq_id -> per token of each scored chunk
    # (`StepLayout.scored`: the chunk and the flat row it starts at), its target's
    # SampledToken or None (no target).
    @staticmethod
    def targets(scored: list[tuple[SeqChunk, int]], rows: int) -> np.ndarray:
        """Each of the step's `rows` token rows' target id (-1: not scored)."""
        targets = np.full(rows, -1, np.int32)
        for c, at in scored:
            targets[at:at + len(c.score_targets)] = c.score_targets
        return targets

    def run(self, params: dict, hidden, targets: np.ndarray):
        """The device part: the lm_head over `hidden` (the step's last-layer output),
        the log-softmax, each target's logprob and the top ones."""
        head = {k: params[k] for k in ("final_norm", "embed", "lm_head", "head_int8")
                if k in params}
        return self._fn(head, hidden, targets)

    @staticmethod
    def unpack(scored: list[tuple[SeqChunk, int]], arrays) -> dict[int, list]:
        target_lp, top_ids, top_lp = (np.asarray(a) for a in arrays)
        out = {}
        for c, at in scored:
            k = min(c.score_top, TOP_LOGPROBS)
            out[c.seq_id] = [None if t < 0 else SampledToken(
                int(t), float(target_lp[r]),
                [TokenLogprob(int(top_ids[r, j]), float(top_lp[r, j])) for j in range(k)])
                for r, t in enumerate(c.score_targets, at)]
        return out
