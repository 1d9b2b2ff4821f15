"""A CP group's leader in a world step: apply rank 0's commands to the group's EngineCore, step it,
keep the group in step with the world, report.

:func:`leader_step` is the one world step of every leader (rank 0 included, inside
:class:`~.driver.WorldDriver`); :func:`serve_leader` is the loop of a leader other than rank 0
(dp > 1): receive the plan, :func:`leader_step`, send the report, until the shutdown plan.

Keeping in step: with dp > 1 the MoE all-to-alls span every DP group, so while any request is
live in the world (``plan.run_model``) each group runs exactly one forward per world step, its
idle step (no rows) when it has nothing to run or its step failed before its forward. A group
that sent its ranks nothing this step sends a heartbeat, so its ranks' waits stay bounded.
"""

from __future__ import annotations

import logging

from helixserve.engine.core import EngineCore, EngineStats
from helixserve.engine.request import RequestStatus
from helixserve.engine.scheduler import RequestUpdate
from helixserve.engine.spmd.executor import SPMDExecutor
from helixserve.engine.spmd.messages import (AbortCommand, AddCommand, Command, StepPlan, StepReport,
                                             broadcast_plan, gather_reports)

logger = logging.getLogger(__name__)


def apply_commands(core: EngineCore, commands: list[Command]) -> list[RequestUpdate]:
    """Rank 0 checked each request with the same rules; a refusal here is reported as an error."""
    updates: list[RequestUpdate] = []
    for cmd in commands:
        if isinstance(cmd, AddCommand):
            try:
                core.add_request(cmd.request_id, list(cmd.prompt_token_ids), cmd.params, hold_cache=cmd.hold_cache,
                                 forced_output_token_ids=cmd.forced_output_token_ids, kv_ticket=cmd.kv_ticket)
            except ValueError as exc:
                logger.error("CP group leader refused request %s: %s", cmd.request_id, exc)
                updates.append(RequestUpdate(cmd.request_id, -1, RequestStatus.FINISHED_ERROR, error=str(exc)))
        elif isinstance(cmd, AbortCommand):
            core.abort(cmd.request_id, cmd.error)
        else:
            core.release(cmd.request_id)
    return updates


def group_stats(core: EngineCore) -> list[EngineStats]:
    """Each CP rank's stats: the group's request counts, the rank's own blocks and slots."""
    total = core.stats()
    return [EngineStats(total.num_running, total.num_waiting, total.num_held, c.num_blocks, c.num_used_blocks,
                        c.num_slots, c.num_used_slots) for c in core.cache_manager.rank_stats()]


def leader_step(core: EngineCore, commands: list[Command], run_model: bool, dp: int) -> StepReport:
    """One world step of a CP group's leader (see the module docstring)."""
    executor = core.executor
    assert isinstance(executor, SPMDExecutor)
    forwards, messages = executor.num_forwards, executor.num_messages
    updates = apply_commands(core, commands)
    updates += core.step()  # also with nothing to run: an abort's cancels still go to the ranks
    if dp > 1 and run_model and executor.num_forwards == forwards:
        executor.idle_step()
    if executor.num_messages == messages:
        executor.heartbeat()
    mapping = executor.channel.mapping
    return StepReport(mapping.rank, mapping.dp_rank, 0, updates, group_stats(core))


def serve_leader(core: EngineCore, dp: int) -> int:
    """The loop of a CP leader other than rank 0: plans until the shutdown plan; the step count.

    Raises on any failure (a collective timed out, a forward raised): the process should then
    end, so that the other ranks' collectives fail fast."""
    executor = core.executor
    assert isinstance(executor, SPMDExecutor)
    groups = executor.channel.groups
    steps = 0
    while True:
        plan: StepPlan = broadcast_plan(None, groups)
        if plan.shutdown:
            executor.shutdown()
            return steps
        gather_reports(leader_step(core, plan.commands[groups.mapping.dp_rank], plan.run_model, dp), groups)
        steps += 1
