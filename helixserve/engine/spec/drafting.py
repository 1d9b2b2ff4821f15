"""Draft tokens for a step's decoding requests, proposed scheduler-side (torch-free).

A decoding request gets up to ``num_draft_tokens`` drafts (``speculative.num_draft_tokens``),
fewer where more could never be emitted or cached:

- no more than ``max_tokens - outputs - 1`` (a verified run emits the drafts it accepts plus one);
- no more than ``max_model_len - 1 - tokens`` (the run never passes ``max_model_len``);
- none while forced output tokens are pending (a gen worker's first tokens from its ctx worker);
- within the step's draft budget (the token budget left once every decode has its one row).

Only the ``ngram`` method (prompt lookup, :mod:`.ngram`) drafts here; a drafter with weights
(``draft``, ``hidden``) needs a model and is refused by the engine that would run it.

A step that drafts nothing should cost what a plain decode step costs: every occurrence of a
suffix ends with the sequence's last token, so when that token is nowhere earlier (one scan of
the request's lists, no copy) there is nothing to look up and the request drafts nothing.
"""

from __future__ import annotations

from helixserve.config_speculative import SpeculativeConfig
from helixserve.engine.request import Request
from helixserve.engine.spec.ngram import propose_one


class NgramDrafter:
    """Prompt-lookup drafts for one request at a time (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        if config.method != "ngram":
            raise ValueError(f"speculative method {config.method!r} needs a drafter model; only 'ngram' "
                             "drafts scheduler-side")
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None  # resolved
        self.num_draft_tokens = config.num_draft_tokens
        self.max_model_len = max_model_len
        self.prompt_lookup_min, self.prompt_lookup_max = config.prompt_lookup_min, config.prompt_lookup_max

    def cap(self, request: Request) -> int:
        """The most drafts worth proposing for ``request`` now (ignoring the step budget)."""
        outputs = len(request.output_token_ids)
        if outputs < len(request.forced_output_token_ids):
            return 0
        room = min(request.sampling_params.max_tokens - outputs - 1,
                   self.max_model_len - 1 - request.num_tokens)
        return max(0, min(self.num_draft_tokens, room))

    def propose(self, request: Request, budget: int) -> list[int]:
        """Drafts for ``request`` (maybe none): at most ``min(cap(request), budget)`` tokens."""
        limit = min(self.cap(request), budget)
        if limit <= 0 or not last_token_recurs(request):
            return []
        tokens = request.prompt_token_ids + request.output_token_ids
        return propose_one(tokens, limit, self.prompt_lookup_min, self.prompt_lookup_max)


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
