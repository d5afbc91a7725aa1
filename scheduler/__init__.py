"""Pure-Python scheduling: request state, page allocator + prefix cache, per-iteration
policy, and the trio engine loop that drives a `Runner`.

Module map (read in this order):

- `api`: what app/ submits and receives (GenerateRequest, events, Overloaded, EngineStats).
- `protocol`: the Runner protocol and StepPlan the model side implements.
- `request`: `Sequence`, one object per request, mutated only by the scheduler.
- `pages`: `PageAllocator`, free list, ref counts, prefix cache, copy-on-write.
- `fairness`: `FairQueue`, priority classes, per-tenant FIFOs and fair share.
- `policy`: `Scheduler.schedule()`, the per-iteration plan; preemption by recompute; the
  narrow queries (counts, cost estimates, cache hit rate) everything else reads.
- `step_cost`: `StepCostModel`, step times learned per compiled shape and context.
- `itl_plan`: planning every step within a strict ITL target (a mixin of `Scheduler`).
- `chunk_sizing`: prompt chunk sizes beside the decodes, and which rule built a step (a mixin).
- `admission`: `Admission`, the door: queue bounds, predicted TTFT, Retry-After.
- `output`: `OutputStream`, incremental text, stop strings, coalescing.
- `step_log`: `StepRecord`s and the step totals behind `EngineStats`.
- `engine`: `Engine`, the trio task per replica (the only module here importing trio).
"""
