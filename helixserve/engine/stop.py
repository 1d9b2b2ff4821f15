"""Stop rules (torch-free): which sampled token finishes a request, and stop-string matching.

Design: the scheduler owns every finishing decision so a request's cache is freed in the same
step it stops: ``Scheduler.update_from_output`` applies :func:`stop_status` to each sampled
token (eos unless ``ignore_eos``, ``stop_token_ids``, stop strings, ``max_tokens``,
``max_model_len``). Stop *strings* need text, so the scheduler is given a ``detokenize(token_ids) ->
str`` callable and keeps one :class:`StopChecker` per request that has ``stop`` strings. The LLM
layer uses :func:`truncate_at_stop` on the final text (stop strings are not returned to the user).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from helixserve.engine.request import Request, RequestStatus

Detokenize = Callable[[list[int]], str]


class StopChecker:
    """Finds a stop string in the tail of the output.

    Only the last ``4 * max_stop_len + 4`` tokens are detokenized each step (a character is at
    most 4 byte-level tokens), so the per-step cost does not grow with the output length.
    """

    def __init__(self, stop: Sequence[str], detokenize: Detokenize) -> None:
        if not stop or any(not s for s in stop):
            raise ValueError(f"stop must be a non-empty list of non-empty strings, got {stop!r}")
        self.stop = tuple(stop)
        self.detokenize = detokenize
        self._window = 4 * max(len(s) for s in self.stop) + 4

    def check(self, output_token_ids: Sequence[int]) -> str | None:
        """The stop string found in the output's tail, or ``None``."""
        text = self.detokenize(list(output_token_ids[-self._window :]))
        found = [(text.find(s), s) for s in self.stop if s in text]
        return min(found)[1] if found else None


def truncate_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` cut before the earliest occurrence of any stop string."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=len(text))
    return text[:cut]


def stop_checker_for(request_id: str, stop: Sequence[str], detokenize: Detokenize | None) -> StopChecker | None:
    """The checker for a request's ``stop`` strings (``None`` without any); ``ValueError`` when
    it has some but no ``detokenize`` was given."""
    if not stop:
        return None
    if detokenize is None:
        raise ValueError(f"request {request_id!r} has stop strings but no detokenize was given")
    return StopChecker(stop, detokenize)


def stop_status(
    request: Request, token: int, eos_token_ids: Collection[int], checker: StopChecker | None, max_model_len: int
) -> RequestStatus | None:
    """How ``request`` finishes with ``token`` (already appended to its outputs), or ``None``;
    sets ``stop_reason`` for a stop token or string."""
    params = request.sampling_params
    if token in eos_token_ids and not params.ignore_eos:
        return RequestStatus.FINISHED_STOPPED
    if token in params.stop_token_ids:
        request.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    if checker is not None:
        matched = checker.check(request.output_token_ids)
        if matched is not None:
            request.stop_reason = matched
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
