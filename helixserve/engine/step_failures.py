"""A failure is one request's, never its batch's: the engine core's handling of a step that
cannot be prepared (it runs again without the requests the failure is traced to, which end with
an error: :func:`failing_alone`, :func:`without`; nothing of the step has run then) and of a step
that failed once launched (its requests end with the error). The step handling is a mixin of
:class:`~helixserve.engine.core.EngineCore`, kept apart from the step's happy path."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

from helixserve.engine.request import RequestStatus, SamplingParams
from helixserve.engine.runner import LaunchedStep, ModelRunner, PreparedStep, StepPreparationError
from helixserve.engine.scheduler import RequestUpdate, Scheduler
from helixserve.engine.scheduler_output import SchedulerOutput
from helixserve.host_copy import to_device

logger = logging.getLogger("helixserve.engine.core")


def failing_alone(runner: ModelRunner, out: SchedulerOutput, params: Mapping[str, SamplingParams],
                  input_tokens: torch.Tensor | None) -> dict[str, str]:
    """Each request of ``out`` whose part of the step fails to prepare alone, and why."""
    failures: dict[str, str] = {}
    for j, seq in enumerate(out.seqs):
        tokens = None if input_tokens is None else input_tokens[j:j + 1]
        try:
            runner.prepare_step(SchedulerOutput(seqs=[seq]), params, tokens)
        except StepPreparationError as exc:
            failures[seq.request_id] = exc.failures.get(seq.request_id, str(exc))
    return failures


def without(out: SchedulerOutput, input_tokens: torch.Tensor | None, request_ids: Mapping[str, str] | set[str]
            ) -> torch.Tensor | None:
    """Take ``request_ids`` out of ``out`` (in place) and their rows out of ``input_tokens``
    (returned)."""
    keep = [j for j, s in enumerate(out.seqs) if s.request_id not in request_ids]
    if input_tokens is not None:
        input_tokens = input_tokens.index_select(0, to_device(torch.tensor(keep), input_tokens.device))
    out.seqs[:] = [out.seqs[j] for j in keep]
    return input_tokens


class StepFailures:
    """``_prepare``, ``_drop`` and ``_fail_step`` of the engine core, over its attributes below."""

    runner: ModelRunner
    scheduler: Scheduler
    num_step_errors: int
    _params: dict[str, SamplingParams]
    _in_flight: tuple[SchedulerOutput, LaunchedStep] | None
    _where: str
    _forget: Callable[[list[str]], None]  # the core's: drops what it keeps of these requests

    def _prepare(self, out: SchedulerOutput, input_tokens: torch.Tensor | None, failed: list[RequestUpdate]
                 ) -> tuple[PreparedStep | None, torch.Tensor | None]:
        """Prepare ``out`` (nothing of it runs here). A step that cannot be prepared runs again
        without the requests the failure is traced to, else without those that fail to prepare
        alone; they end with an error (appended to ``failed``). A failure no request explains
        raises. Returns the prepared step and the input tokens left."""
        while True:
            if out.is_empty:
                return None, input_tokens
            try:
                return self.runner.prepare_step(out, self._params, input_tokens), input_tokens
            except StepPreparationError as exc:
                culprits = exc.failures or failing_alone(self.runner, out, self._params, input_tokens)
                if not culprits:
                    raise
                input_tokens = self._drop(out, input_tokens, culprits, failed)

    def _drop(self, out: SchedulerOutput, input_tokens: torch.Tensor | None, culprits: dict[str, str],
              failed: list[RequestUpdate]) -> torch.Tensor | None:
        """Take ``culprits`` out of ``out`` (and their rows out of ``input_tokens``, returned),
        end them with their error and free what they hold."""
        input_tokens = without(out, input_tokens, culprits)
        for rid, why in culprits.items():
            message = f"engine step failed{self._where}: {why}"
            logger.error("%s; failed request %s alone", message, rid)
            self.scheduler.abort(rid, error=message)
            failed.append(RequestUpdate(rid, -1, RequestStatus.FINISHED_ERROR, error=message))
        self.num_step_errors += 1
        self._forget(list(culprits))
        return input_tokens

    def _fail_step(self, exc: Exception) -> list[RequestUpdate]:
        self.num_step_errors += 1
        if isinstance(exc, StepPreparationError) and exc.__cause__ is not None:
            exc = exc.__cause__  # type: ignore[assignment] - name what failed to prepare
        message = f"engine step failed{self._where}: {type(exc).__name__}: {exc}"
        self._in_flight = None
        request_ids = self.scheduler.fail_pending_step(message)
        logger.error("%s; failed requests %s", message, request_ids, exc_info=exc)
        self._forget(request_ids)
        return [RequestUpdate(rid, -1, RequestStatus.FINISHED_ERROR, error=message) for rid in request_ids]
