"""A request's prompt block keys, computed in the router as the ctx worker computes them (torch-free).

The ctx worker tokenizes a completion's text prompt with the deployment's tokenizer, renders a
chat request's messages with its chat template first, and takes a token-id prompt as is; its
prefix cache names each full block by the BLAKE2b-128 chain of
:mod:`helixserve.kvcache.prefix_index` from the request's ``cache_salt``. The router does the
same with the same tokenizer (:func:`~helixserve.models.tokenizer_loader.tokenizer_of`: the
checkpoint directory's, or ``load_format: dummy``'s byte-level one) and the deployment's
``cache.tokens_per_block``, so its keys are the ctx worker's. Only the blocks a hit can use count:
the full blocks before the prompt's last token (that token is always computed).

The keys only steer routing: a prompt the router cannot tokenize (no tokenizer where the router
runs, a chat template error the ctx worker will answer with its 400) has no keys and is routed
by load.
"""

from __future__ import annotations

import logging

from helixserve.kvcache.prefix_index import BlockKey, append_block_keys
from helixserve.models.tokenizer import HelixTokenizer
from helixserve.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)


class PromptKeys:
    """Block keys of requests' prompts (module docstring)."""

    def __init__(self, tokenizer: HelixTokenizer | None, tokens_per_block: int) -> None:
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        self.tokenizer = tokenizer
        self.tokens_per_block = tokens_per_block

    def token_ids(self, body: CompletionRequest | ChatCompletionRequest) -> list[int] | None:
        """The prompt's token ids as the ctx worker sees them; None where the router cannot tell."""
        if not isinstance(body, ChatCompletionRequest) and not isinstance(body.prompt, str):
            ids = list(body.prompt)
            return ids if max(ids, default=0) < 1 << 63 else None  # beyond any vocabulary: the ctx's 400
        if self.tokenizer is None:
            return None
        try:
            if isinstance(body, ChatCompletionRequest):
                return self.tokenizer.encode_chat([m.model_dump() for m in body.messages])
            return self.tokenizer.encode(body.prompt)
        except Exception as exc:  # noqa: BLE001 (a template's own errors too: the ctx worker answers them)
            logger.debug("no prefix keys for a request: %s: %s", type(exc).__name__, exc)
            return None

    def block_keys(self, body: CompletionRequest | ChatCompletionRequest) -> list[BlockKey]:
        """The keys of the full blocks before the prompt's last token."""
        ids = self.token_ids(body)
        if not ids:
            return []
        usable = (len(ids) - 1) // self.tokens_per_block * self.tokens_per_block
        return append_block_keys([], ids[:usable], self.tokens_per_block, body.cache_salt)
