"""Draft tokens for a step's decoding requests, proposed scheduler-side (torch-free).

A decoding request gets up to ``num_draft_tokens`` drafts (``speculative.num_draft_tokens``),
fewer where more could never be emitted or cached:

- no more than ``max_tokens - outputs - 1`` (a verified run emits the drafts it accepts plus one);
- no more than ``max_model_len - 1 - tokens`` (the run never passes ``max_model_len``);
- none while forced output tokens are pending (a gen worker's first tokens from its ctx worker);
- within the step's draft budget (the token budget left once every decode has its one row).

The ``ngram`` method (prompt lookup, :mod:`.ngram`) drafts here. The ``draft`` and ``hidden``
methods' tokens come from a model the engine runs before the target's forward (a draft model,
:mod:`helixserve.engine.draft_runner`; a hidden-state drafter,
:mod:`helixserve.engine.hidden_runner`): here they only reserve the rows (:class:`ModelDraftRows`,
placeholder tokens the engine overwrites), under the same caps and budget.

A step that drafts nothing should cost what a plain decode step costs: every occurrence of a
suffix ends with the sequence's last token, so when that token is nowhere earlier (one scan of
the request's lists, no copy) there is nothing to look up and the request drafts nothing. And
while no request would draft, decode steps overlap as without speculation: a step scheduled
ahead of the pending step's tokens carries no drafts, so the scheduler schedules one only when
``would_draft`` is false for every request on its tokens so far; the first step where one would
runs after the pending step's tokens are applied, with its drafts (the ``draft`` and ``hidden`` methods'
rows always would: their engine does not overlap).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from helixserve.config_speculative import SpeculativeConfig
from helixserve.engine.request import Request
from helixserve.engine.spec.ngram import propose_one


DRAFT_PLACEHOLDER = -1  # a reserved draft row's token until the draft model fills it


class Drafter(ABC):
    """The caps every drafter applies (see the module docstring); ``propose`` is the method's."""

    method = ""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        if config.method != self.method:
            raise ValueError(f"speculative method {config.method!r} given to the {self.method!r} drafter")
        self.num_draft_tokens = config.num_draft_tokens
        self.max_model_len = max_model_len

    def cap(self, request: Request) -> int:
        """The most drafts worth proposing for ``request`` now (ignoring the step budget)."""
        outputs = len(request.output_token_ids)
        if outputs < len(request.forced_output_token_ids):
            return 0
        room = min(request.sampling_params.max_tokens - outputs - 1,
                   self.max_model_len - 1 - request.num_tokens)
        return max(0, min(self.num_draft_tokens, room))

    @abstractmethod
    def propose(self, request: Request, budget: int) -> list[int]:
        """Drafts for ``request`` (maybe none): at most ``min(cap(request), budget)`` tokens."""

    def would_draft(self, request: Request) -> bool:
        """Whether ``request`` would get drafts on its tokens so far: a decode step scheduled
        ahead of the pending one's tokens (overlapped decoding) carries none, so it runs only
        where no request would (:meth:`Scheduler.schedule_ahead`)."""
        return self.cap(request) > 0


class NgramDrafter(Drafter):
    """Prompt-lookup drafts for one request at a time (see the module docstring)."""

    method = "ngram"

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        super().__init__(config, max_model_len)
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None  # resolved
        self.prompt_lookup_min, self.prompt_lookup_max = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, request: Request, budget: int) -> list[int]:
        """Drafts for ``request`` (maybe none): at most ``min(cap(request), budget)`` tokens."""
        limit = min(self.cap(request), budget)
        if limit <= 0 or not last_token_recurs(request):
            return []
        tokens = request.prompt_token_ids + request.output_token_ids
        return propose_one(tokens, limit, self.prompt_lookup_min, self.prompt_lookup_max)

    def would_draft(self, request: Request) -> bool:
        return bool(self.propose(request, 1))


class ModelDraftRows(Drafter):
    """The ``draft`` method's rows: ``min(cap(request), budget)`` placeholders, filled by the
    engine's draft model before the target verifies them."""

    method = "draft"

    def propose(self, request: Request, budget: int) -> list[int]:
        return [DRAFT_PLACEHOLDER] * max(0, min(self.cap(request), budget))


class HiddenDraftRows(ModelDraftRows):
    """The ``hidden`` method's rows, filled by the engine's hidden-state drafter."""

    method = "hidden"


def make_drafter(config: SpeculativeConfig, max_model_len: int) -> Drafter:
    """The scheduler-side drafter of ``config.method``."""
    drafters: dict[str, type[Drafter]] = {"ngram": NgramDrafter, "draft": ModelDraftRows, "hidden": HiddenDraftRows}
    if config.method not in drafters:
        raise ValueError(f"speculative method {config.method!r} is not supported by the engine; "
                         f"use one of {sorted(drafters)}")
    return drafters[config.method](config, max_model_len)


def last_token_recurs(request: Request) -> bool:
    """Whether the request's last token occurs earlier in its prompt or outputs (a suffix can
    match only then; see the module docstring)."""
    outputs = request.output_token_ids
    if not outputs:
        return True  # the last token is the prompt's: the lookup decides
    last = outputs[-1]
    if last in request.prompt_token_ids:
        return True
    try:
        outputs.index(last, 0, len(outputs) - 1)
    except ValueError:
        return False
    return True
