"""One engine driver for every role: the step loop of a gen world, a ctx worker and a single process.

Call chains (engine loop -> model forward)::

    served    AsyncEngine's thread: EngineThread._run -> EngineThread._step -> [WorldCore.step]
              -> WorldDriver.step -> EngineCore.step -> EngineCore._launch -> ModelRunner.run
              -> KimiForCausalLM.forward
    offline   LLM.generate / generate --dp --cp: drive_to_completion -> WorldDriver.step -> ...
    leaders   a CP group's leader other than rank 0: serve_leader -> WorldDriver.step -> ...
    followers serve_follower -> ModelRunner.forward (what the leader's GroupLeader sent)

``WorldCore`` (:mod:`helixserve.serving.world_core`) is a world worker's composition around the driver (a failed world's requests
end with a 503, a restarted world is swapped in), not a layer of the engine.

Who owns what:

- :class:`~.driver.WorldDriver` owns a world's step (commands in, schedule -> launch ->
  postprocess, updates out). Rank 0's is the world's front: it checks and assigns requests to CP
  groups (attention DP) and keeps each request's state (:class:`~.lifecycle.GenRequestLife`);
  with dp > 1 it sends each step's plan to the other leaders and gathers their reports
  (:mod:`.messages`). A single process (``LLM``, a world of one) is the same driver over an
  ``EngineCore`` built without groups: nothing is sent, there is no other path.
- each CP group's **leader** (``cp_rank == 0``) runs the group's only
  :class:`~helixserve.engine.core.EngineCore`: its scheduler over the group's cache (every CP
  rank's allocator), its KV intake, its ``ModelRunner``, and a :class:`~.leader.GroupLeader`
  that sends each launch to the group's other ranks (:mod:`.channel`) and shares the sampled
  tokens;
- the group's **followers** (:mod:`.follower`) hold their cache shard, model shard and
  ``ModelRunner`` and run what the leader sends: steps (their own block tables), idle steps,
  KV receptions and the transfer consensus; they keep no request state.

A world step on a leader::

    apply the plan's commands (add / abort / release) to the group's EngineCore
    EngineCore.step(): KV intake (start receptions on every rank, agree on outcomes through the
                       transceiver consensus), schedule, launch (-> every rank of the group runs
                       it), sample on the leader, tokens broadcast over the group, postprocess
    dp > 1 and nothing launched: the idle step (MoE all-to-alls with no rows)
    nothing sent to the group: a heartbeat

Every collective has the group timeout, so a dead or stuck rank makes the others raise; a
failure that leaves collectives unmatched stops the world (:class:`~.messages.WorldStoppedError`
on rank 0, the rank's process ends elsewhere). Idle worlds stay alive through heartbeats
(``WorldDriver.has_unfinished_requests`` asks for a step once ``heartbeat_s`` passed).

A ctx world (``ctx[].tp > 1``: the helix layout dp 1 x cp tp, experts over every rank) runs
this same driver: its leader's ``EngineCore`` launches through its group like a gen world's, and
the ctx server composes ``WorldCore`` around it as the gen server does
(:mod:`helixserve.ctx_server.world`); the role stays in the server, never a flag in the engine.
"""
