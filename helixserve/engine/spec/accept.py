"""Appending a verified run of tokens to a request under plain decoding's stop rules (torch-free).

Plain decoding appends one sampled token per step and asks
:func:`helixserve.engine.stop.stop_status` whether it finishes the request. A verified run (the
accepted drafts plus the correction or bonus token) is the same tokens in the same order, so it is
appended the same way, one token at a time, and cut at the first token that finishes the request
(eos unless ``ignore_eos``, a stop token id, a stop string, ``max_tokens``, ``max_model_len``);
the tokens after it are dropped, exactly as plain decoding would never have produced them.

A forced output token (a gen worker resuming a request whose first token the ctx worker sampled)
replaces the run's token at its position as in plain decoding; when it differs, the rest of the
run was verified after a different token and is dropped too.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from helixserve.engine.request import Request, RequestStatus
from helixserve.engine.stop import StopChecker, stop_status


@dataclass(frozen=True, slots=True)
class AppendedRun:
    """``num_appended`` tokens of the run went to the request's outputs; ``status`` is how the
    request finished (``None``: still running)."""

    num_appended: int
    status: RequestStatus | None


def append_verified_tokens(
    request: Request, token_ids: Sequence[int], eos_token_ids: Collection[int],
    checker: StopChecker | None, max_model_len: int,
) -> AppendedRun:
    """Append ``token_ids`` (one verified run, in order) to ``request.output_token_ids``, cut as
    plain decoding cuts (see the module docstring); sets ``stop_reason`` as
    :func:`~helixserve.engine.stop.stop_status` does. The caller finishes the request on a status."""
    if not token_ids:
        raise ValueError(f"request {request.request_id!r}: a verified run has at least one token")
    if request.is_finished:
        raise ValueError(f"request {request.request_id!r} is already {request.status.value}")
    for i, sampled in enumerate(token_ids):
        token = request.next_output_token(sampled)
        request.output_token_ids.append(token)
        status = stop_status(request, token, eos_token_ids, checker, max_model_len)
        if status is not None or token != sampled:
            return AppendedRun(i + 1, status)
    return AppendedRun(len(token_ids), None)
