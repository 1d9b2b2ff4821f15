"""A step that cannot be prepared fails only the requests it is traced to (the engine core's
``_prepare``): who fails alone, and the step without them. Nothing of the step has run then."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from helixserve.engine.request import SamplingParams
from helixserve.engine.runner import ModelRunner, StepPreparationError
from helixserve.engine.scheduler_output import SchedulerOutput
from helixserve.host_copy import to_device


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
