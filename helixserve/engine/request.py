"""Request state: sampling parameters, status machine, token bookkeeping (torch-free).

Lifecycle: ``WAITING -> RUNNING -> FINISHED_*``; a preempted request goes back to ``WAITING`` with
``num_computed_tokens = 0`` and is recomputed from scratch (prompt + outputs so far).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from enum import Enum

from pydantic import BaseModel, ConfigDict, StrictInt, field_validator


_GREEDY_BELOW = 1e-5  # temperatures this small are greedy (avoids overflow in logits / T)
MAX_CACHE_SALT_CHARS = 1024  # a cache_salt names a tenant; longer is refused
INT32_MAX = 2**31 - 1  # integer parameters stay within int32, as vLLM's and the sampler's tensors
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes: [low, high)


class SamplingParams(BaseModel):
    """Per-request sampling and stopping. An invalid value raises pydantic's ``ValidationError``
    (a ``ValueError``) naming the field and the value.

    ``temperature == 0`` is greedy. ``top_k`` 0 or -1 is off; a ``top_k`` above the vocabulary
    keeps every token, as ``top_k`` = vocabulary size does. Integers stay within int32 (``seed``:
    what ``torch.Generator.manual_seed`` takes), floats are finite. ``stop`` strings need a
    detokenizer (see :mod:`helixserve.engine.stop`). A stop/eos token is kept in
    ``output_token_ids``. ``cache_salt`` (vLLM's request field, carried here so it reaches every
    engine): with prefix caching, cached blocks are shared only between requests of one salt.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: StrictInt = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: StrictInt = 0
    seed: StrictInt | None = None
    stop_token_ids: tuple[StrictInt, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    cache_salt: str | None = None

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int) -> int:
        if not 1 <= v <= INT32_MAX:
            raise ValueError(f"max_tokens must be in [1, {INT32_MAX}], got {v}")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {v}")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not 0 < v <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {v}")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if not -1 <= v <= INT32_MAX:
            raise ValueError(f"top_k must be -1 or 0 (off) or in [1, {INT32_MAX}], got {v}")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not SEED_RANGE[0] <= v < SEED_RANGE[1]:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {v}")
        return v

    @field_validator("cache_salt")
    @classmethod
    def _cache_salt(cls, v: str | None) -> str | None:
        if v is not None and not 1 <= len(v) <= MAX_CACHE_SALT_CHARS:
            raise ValueError(f"cache_salt must have 1 to {MAX_CACHE_SALT_CHARS} characters, got {len(v)}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        bad = [t for t in v if not 0 <= t <= INT32_MAX]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {INT32_MAX}], got {bad[:8]}")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: object) -> object:
        if isinstance(v, str):
            v = (v,)
        if v is None:
            return ()
        if any(not s for s in v):  # type: ignore[union-attr]
            raise ValueError(f"stop strings must be non-empty, got {v!r}")
        return v

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_BELOW

    @property
    def is_top_k_on(self) -> bool:
        return self.top_k > 0


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"  # eos, stop token or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"  # client cancel
    FINISHED_ERROR = "finished_error"  # e.g. a failed KV transfer

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason, ``None`` while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV/state is in the cache
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    error: str | None = None
    num_preemptions: int = 0
    # ctx hold: on a stop/length finish keep the cache until ``Scheduler.release`` (see there)
    hold_cache_on_finish: bool = False
    # the first outputs are these tokens, not the sampled ones (a gen worker resuming a request
    # whose first token the ctx worker sampled); stop rules still apply to them
    forced_output_token_ids: list[int] = field(default_factory=list)
    # prefix caching: the keys of the request's full blocks so far (kvcache.prefix_index),
    # computed once
    block_keys: list[bytes] = field(default_factory=list)
    num_cached_tokens: int | None = None  # prefix caching: tokens its last admission found cached

    @property
    def cache_salt(self) -> str | None:
        return self.sampling_params.cache_salt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def next_output_token(self, sampled_token_id: int) -> int:
        """The token to append after sampling ``sampled_token_id`` (a forced one while any is left)."""
        index = len(self.output_token_ids)
        if index < len(self.forced_output_token_ids):
            return self.forced_output_token_ids[index]
        return sampled_token_id

    def token_ids_between(self, start: int, stop: int) -> list[int]:
        """Tokens ``[start, stop)`` of prompt + outputs."""
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : stop - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - num_prompt]
