"""`Batch`: one step as the policy builds it, the plan and the sequences behind its chunks,
with what the step's books need after it launched (scheduler/policy.py builds it;
chunk_sizing.py, itl_plan.py and step_books.py read it; the engine launches its plan).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .protocol import StepPlan
from .request import Sequence
from .step_cost import StepCostModel


@dataclass(slots=True)
class Batch:
    """One step's plan and the sequences behind its chunks (``seqs[i]`` owns chunk i)."""

    plan: StepPlan
    seqs: list[Sequence]
    num_decode: int
    preempted: list[int] = field(default_factory=list)  # seq_ids preempted while planning
    # Sequences whose pages `plan.copies` fills (a failed step must fail them too, even
    # those with no chunk in it).
    copied: list[Sequence] = field(default_factory=list)
    work: int = 0  # keys the step's attention reads (step_cost.chunk_work)
    prefill_padded: int = 0  # prompt tokens as computed: whole query blocks
    # Each sequence's preemption count when the step was launched: a sequence preempted
    # (and maybe admitted again) since then has nothing to commit from this step.
    epochs: list[int] = field(default_factory=list)
    registered: list[int] = field(default_factory=list)  # pages it offered the prefix cache
    window_registered: list[int] = field(default_factory=list)  # ... of the sliding layers'
    # Which rule sized the step's prompt chunks (`STEP_PLANS`) and the ITL budget it was
    # planned within (0: none): /v1/stats and the dashboard show them step by step.
    why: str = "decode-only"
    budget_s: float = 0.0
    # Decode rows beyond one a sequence: the proposals of its verify chunks
    # (scheduler/speculative.py); the step's decode rows are `decode_rows`.
    draft_rows: int = 0
    # A sequence in it would propose once its token is known: commit before the next
    # plan (no overlap after it).
    spec_sync: bool = False

    @property
    def decode_rows(self) -> int:
        return self.num_decode + self.draft_rows

    def predicted(self, cost: StepCostModel) -> float:
        """The step-cost model's estimate of this step's seconds."""
        return cost.predict(self.decode_rows, self.prefill_padded, self.work)
