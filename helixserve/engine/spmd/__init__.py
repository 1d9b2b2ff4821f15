"""The SPMD side of the one engine: a helix_a2a generation world of dp x cp ranks.

Who owns what:

- each CP group's **leader** (``cp_rank == 0``) runs the group's only
  :class:`~helixserve.engine.core.EngineCore`: its scheduler over the group's cache (every CP
  rank's allocator), its KV intake and an :class:`~.executor.SPMDExecutor` that sends each step
  to the group's other ranks (:mod:`.channel`) before running it on its own ``ModelRunner``;
- the group's **followers** (:mod:`.follower`) hold their cache shard, model shard and
  ``ModelRunner`` and run what the leader sends: steps (their own block tables), idle steps,
  KV receptions and the transfer consensus; they keep no request state;
- **rank 0** is group 0's leader and the world's front, :class:`~.driver.WorldDriver`: it checks
  and assigns requests to groups (attention DP) and, with dp > 1, sends each world step's plan to
  the other leaders (:mod:`.leader`, :mod:`.messages`) and gathers their reports.

A world step on a leader::

    apply rank 0's commands (add / abort / release) to the group's EngineCore
    EngineCore.step(): KV intake (start receptions on every rank, agree on outcomes through the
                       transceiver consensus), schedule, launch (-> every rank of the group runs
                       it), sample on the leader, tokens broadcast over the group
    dp > 1 and nothing launched: the idle step (MoE all-to-alls with no rows)
    nothing sent to the group: a heartbeat

Every collective has the group timeout, so a dead or stuck rank makes the others raise; a
failure that leaves collectives unmatched stops the world (:class:`~.messages.WorldStoppedError`
on rank 0, the rank's process ends elsewhere). Idle worlds stay alive through heartbeats
(``WorldDriver.has_unfinished_requests`` asks for a step once ``heartbeat_s`` passed).

Rank 0 keeps each request's state in one table, :class:`~.lifecycle.GenRequestLife` (awaiting
cache -> receiving -> decoding -> finished, a ``hold_cache`` request held before finished).
"""
