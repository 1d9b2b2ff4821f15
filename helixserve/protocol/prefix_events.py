"""``GET /v1/prefix_events`` of a prefix-caching ctx worker, read by the router's cache-aware
policy (internal: behind the deployment's secret).

Query ``since=N`` (the ``seq`` of the last answer; absent: a new reader) and ``max_blocks=M``.
The answer names the worker's event log (``epoch``), its last event number (``seq``: ask from
there next) and its ``tokens_per_block``; then either ``events`` after ``N``, each
``[seq, "stored" | "removed", key]``, or (``resync``: ``N`` was absent, too old or not this
log's) ``blocks``, the keys cached now, at most ``M``, oldest first. A key is a block's 16-byte
BLAKE2b-128 chain key (:mod:`helixserve.kvcache.prefix_index`) in hex.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

PREFIX_EVENTS_PATH = "/v1/prefix_events"
HexKey = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]


class PrefixEventsAnswer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    epoch: str = Field(min_length=1, max_length=64)
    seq: int = Field(ge=0)
    tokens_per_block: int = Field(ge=1)
    resync: bool = False
    events: list[tuple[int, Literal["stored", "removed"], HexKey]] = Field(default_factory=list)
    blocks: list[HexKey] = Field(default_factory=list)
