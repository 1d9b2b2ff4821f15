"""SPMD executor of a helix_a2a generation world: every rank runs every step.

Roles:

- :class:`RankEngine` (every rank): a replica of its CP group's scheduler (CP-group-uniform cache
  accounting, so every rank of the group makes the same decisions), its own cache shard (MLA
  blocks ``b % cp == cp_rank``, KDA state of its heads) and its :class:`KimiForCausalLM`.
- :class:`WorldDriver` (rank 0): the request front, an
  :class:`~helixserve.engine.async_engine.EngineCoreLike`. It validates requests, assigns each to
  the least-loaded CP group (attention DP), and each :meth:`WorldDriver.step` broadcasts one
  :class:`StepPlan` (per-group commands) to the world, runs its own rank's step, and gathers one
  :class:`StepReport` per rank (tokens from the CP leaders, KV arrivals from every rank).
- :func:`serve_rank` (ranks != 0): receive plan -> step -> report, until the shutdown plan.

One world step on every rank::

    plan = broadcast(rank 0's plan)               # gloo control group, with the group timeout
    apply this CP group's commands (add / abort / release)
    agree on KV transfers with the CP group       # transceiver.consensus: one all-gather (cp > 1)
    out = scheduler.schedule()
    out empty -> model.empty_step()               # MoE all-to-alls with 0 rows: nobody waits
    else      -> forward, sample, CP leader's tokens broadcast over the CP group
    updates = scheduler.update_from_output(...)
    gather(report) to rank 0

When no request is live anywhere the plan says so and no rank runs the model. Every collective
has the group timeout, so a dead or stuck rank makes the others raise; a failure on any rank
stops the world (:class:`WorldStoppedError` on rank 0, the rank's process ends elsewhere).
Idle worlds stay alive through heartbeat plans (``has_unfinished_requests`` asks for a step
once ``heartbeat_s`` passed without one).

Requests whose prompt KV arrives from a ctx worker: ``WorldDriver.add_request(..., kv_ticket=T)``
with ``forced_output_token_ids = first_gen_tokens``. Every rank of the chosen CP group allocates
the prompt's cache shard and calls its :class:`KVReceiver`'s ``start(request_id, handle, caches,
T)``. Each step every rank polls its receiver (bounded, local) and the ranks of the group agree on
the outcomes through :class:`~helixserve.transceiver.consensus.TransferConsensus` (one batched
all-gather of every rank's ``LocalStatus`` over the CP group, the code the ``bounded_polling``
tests exercise): a request starts decoding on the whole group once every rank has its shard, and
fails on every rank, with the first rank's cause, when any rank's transfer failed or timed out.

Rank 0 keeps each request's state in one table, :class:`GenRequestLife` (awaiting cache ->
receiving -> decoding -> finished, a ``hold_cache`` request held before finished),
moved by typed events on the engine thread (:mod:`~helixserve.engine.spmd.lifecycle`).
"""

from helixserve.engine.spmd.driver import WorldDriver
from helixserve.engine.spmd.lifecycle import GenRequestLife, GenState, IllegalTransitionError
from helixserve.engine.spmd.messages import (
    AbortCommand,
    AddCommand,
    KVReceiver,
    ReleaseCommand,
    StepPlan,
    StepReport,
    WorldStoppedError,
)
from helixserve.engine.spmd.rank import RankEngine, serve_rank

__all__ = [
    "AbortCommand", "AddCommand", "GenRequestLife", "GenState", "IllegalTransitionError", "KVReceiver",
    "RankEngine", "ReleaseCommand", "StepPlan", "StepReport", "WorldDriver", "WorldStoppedError",
    "serve_rank",
]
