"""``disaggregated_params``: what the router, the ctx worker and the gen worker tell each other.

The request path (DESIGN.md, "One request, end to end"):

1. router -> ctx: the OpenAI request with ``DisaggregatedParams(request_type="context_only")``.
2. ctx -> router: the first token, and ``DisaggregatedParams`` (still ``context_only``) filled in:
   ``ctx_request_id``, ``first_gen_tokens``, ``prompt_token_ids``, the ctx worker's transceiver
   endpoint and a :class:`KVLayout` descriptor.
3. router -> gen: the same request with ``params.for_generation()`` (``generation_only``); the gen
   side checks the layout against its own (:meth:`KVLayout.mismatches`) before any transfer.

Sizes the transceiver derives from a :class:`KVLayout` (per request of ``P`` prompt tokens):

- MLA, per MLA layer: ``ceil(P / tokens_per_block)`` blocks of
  ``[tokens_per_block, kv_lora_rank + qk_rope_head_dim]`` in ``kv_dtype``.
- KDA, per KDA layer: recurrent state ``[num_kda_heads, kda_head_dim, kda_head_dim]`` in
  ``state_dtype`` and conv state ``[3 * num_kda_heads * kda_head_dim, conv_kernel_size - 1]`` in
  ``conv_dtype`` (the ctx side holds them sharded over ``ctx_tp_size`` head slices).

A ctx world of ``ctx_tp_size`` ranks holds a request the helix way (dp 1 x cp ``ctx_tp_size``):
rank ``ctx_rank`` has the MLA blocks ``b % ctx_tp_size == ctx_rank`` and KDA heads
``[ctx_rank*H/ctx_tp_size, (ctx_rank+1)*H/ctx_tp_size)``. A world advertises its layout with
``ctx_rank`` 0; each rank's KV sender describes its own rank.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator
from pydantic_core import PydanticCustomError

TokenId = Annotated[StrictInt, Field(ge=0)]
PositiveInt = Annotated[StrictInt, Field(gt=0)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]
DType = Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
LayerKind = Literal["kda", "mla"]


class RequestType(StrEnum):
    """Which half of a disaggregated request a worker is asked to run."""

    CONTEXT_ONLY = "context_only"
    GENERATION_ONLY = "generation_only"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TransceiverEndpoint(_Strict):
    """Where the ctx worker's transceiver control plane (gRPC) listens."""

    host: NonEmptyStr
    port: Annotated[StrictInt, Field(ge=1, le=65535)]


MAX_CTX_RANKS = 1024  # ctx_endpoints a request may name
CTX_MAPPING_FIELDS = frozenset({"ctx_tp_size", "ctx_rank"})  # KVLayout's fields of the ctx world's sharding
SIDE_FIELDS = CTX_MAPPING_FIELDS | {"draft"}  # fields that may differ between two sides that can pair up


class DraftLayout(_Strict):
    """A hidden-state drafter's prompt cache, as it travels with a request from a ctx worker that
    runs the drafter over the prompt to the gen CP group's leader (``speculative.method: hidden``
    on both sides).

    Per request of ``P`` prompt tokens: for each of the drafter's ``num_layers`` MLA layers, the
    ``ceil(P / tokens_per_block)`` blocks ``[tokens_per_block, kv_lora_rank + qk_rope_head_dim]``
    in ``kv_dtype`` (full rows: every block, whichever CP rank holds the target's), and one row of
    ``feature_size`` target features in ``kv_dtype`` (the target's hidden states at the last prompt
    position, which the drafter reads at the first decoded one). ``model`` names the drafter.
    """

    model: NonEmptyStr
    num_layers: PositiveInt
    kv_lora_rank: PositiveInt
    qk_rope_head_dim: NonNegativeInt
    feature_size: PositiveInt
    kv_dtype: DType


class KVLayout(_Strict):
    """Cache layout of the ctx worker that holds a request; both sides must agree on it.

    ``layer_kinds[i]`` is the mixer of 0-based decoder layer ``i`` (``"kda"`` or ``"mla"``).
    """

    model: NonEmptyStr
    tokens_per_block: PositiveInt
    layer_kinds: Annotated[list[LayerKind], Field(min_length=1)]
    kv_lora_rank: PositiveInt
    qk_rope_head_dim: NonNegativeInt
    num_kda_heads: PositiveInt
    kda_head_dim: PositiveInt
    conv_kernel_size: PositiveInt
    kv_dtype: DType
    state_dtype: DType = "float32"
    conv_dtype: DType
    ctx_tp_size: PositiveInt = 1
    ctx_rank: NonNegativeInt = 0
    # a hidden drafter's prompt cache the ctx builds and sends (None: none); a gen side that runs
    # another drafter, or none, leaves it where it is
    draft: DraftLayout | None = None

    @model_validator(mode="after")
    def _check_shards(self) -> Self:
        if self.num_kda_heads % self.ctx_tp_size:
            raise PydanticCustomError(
                "invalid_value", "num_kda_heads ({h}) must be divisible by ctx_tp_size ({tp})",
                {"h": self.num_kda_heads, "tp": self.ctx_tp_size, "param": "ctx_tp_size"})
        if self.ctx_rank >= self.ctx_tp_size:
            raise PydanticCustomError(
                "invalid_value", "ctx_rank ({rank}) must be below ctx_tp_size ({tp})",
                {"rank": self.ctx_rank, "tp": self.ctx_tp_size, "param": "ctx_rank"})
        return self

    @property
    def mla_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_kinds) if kind == "mla"]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_kinds) if kind == "kda"]

    def num_blocks(self, num_tokens: int) -> int:
        """MLA blocks that hold ``num_tokens`` cached tokens."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.tokens_per_block)

    def mismatches(self, other: KVLayout, *, ignore: frozenset[str] = SIDE_FIELDS) -> list[str]:
        """``"field: ours != theirs"`` for every differing field (empty list = compatible).

        ``ctx_tp_size`` and ``ctx_rank`` are ignored by default: they say how the ctx side shards,
        not what it holds; and ``draft``: a drafter's prompt cache travels only when both sides
        name the same one (a gen side falls back to rebuilding it otherwise).
        """
        return [f"{name}: {getattr(self, name)!r} != {getattr(other, name)!r}"
                for name in type(self).model_fields
                if name not in ignore and getattr(self, name) != getattr(other, name)]


class PullGrant(_Strict):
    """A ctx worker's leave to copy a held prefill straight out of its pools (same host, CUDA IPC).

    ``epoch`` names the ctx's pool export, ``serial`` its lease word (see
    ``transceiver.lease``), ``block_ids`` the physical blocks holding logical blocks 0.., ``slot``
    the KDA state slot (-1: none), ``mac`` an HMAC (the export's key) over these and the request's
    id, prompt length and first tokens. A gen rank that cannot use it asks with RequestShard.
    """

    epoch: Annotated[StrictInt, Field(ge=1, lt=1 << 63)]
    serial: Annotated[StrictInt, Field(ge=1, lt=1 << 63)]
    block_ids: list[Annotated[StrictInt, Field(ge=0, lt=1 << 31)]] = Field(max_length=1 << 20)
    slot: Annotated[StrictInt, Field(ge=-1, lt=1 << 31)]
    mac: Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{32}$")]


class DisaggregatedParams(_Strict):
    """The ``disaggregated_params`` field of requests to, and responses from, ctx and gen workers.

    A ``context_only`` request from the router carries only ``request_type``; the ctx worker's
    response fills in the rest. A ``generation_only`` request must carry everything the gen side
    needs to pick the cache up: ``ctx_request_id``, ``first_gen_tokens`` (non-empty),
    ``prompt_token_ids`` (non-empty), ``ctx_endpoint`` and ``layout``, and for a ctx world
    (``layout.ctx_tp_size > 1``) ``ctx_endpoints``, one per ctx rank.
    """

    request_type: RequestType
    ctx_request_id: NonEmptyStr | None = None
    first_gen_tokens: list[TokenId] = Field(default_factory=list)
    prompt_token_ids: list[TokenId] = Field(default_factory=list)
    ctx_endpoint: TransceiverEndpoint | None = None
    layout: KVLayout | None = None
    pull_grant: PullGrant | None = None  # set by a ctx whose pools a gen rank may copy from
    # the ctx's admission of this request: its POST /v1/release names it, so a late release frees
    # no later request that reused the id
    ctx_admission: Annotated[StrictInt, Field(ge=1, lt=1 << 63)] | None = None
    # a ctx world's (``layout.ctx_tp_size > 1``): every rank's transceiver, in rank order (the
    # first is ``ctx_endpoint``); each gen rank asks the ranks that hold part of its shard
    ctx_endpoints: list[TransceiverEndpoint] = Field(default_factory=list, max_length=MAX_CTX_RANKS)
    # a prefix-caching ctx's hit on the prompt: the gen answers it as
    # usage.prompt_tokens_details.cached_tokens (None: the ctx caches no prefix)
    cached_tokens: NonNegativeInt | None = None

    @model_validator(mode="after")
    def _check_generation_only(self) -> Self:
        if self.request_type is not RequestType.GENERATION_ONLY:
            return self
        for name in ("ctx_request_id", "first_gen_tokens", "prompt_token_ids", "ctx_endpoint",
                     "layout"):
            if not getattr(self, name):
                raise PydanticCustomError(
                    "invalid_value", "a generation_only request needs disaggregated_params.{name}",
                    {"name": name, "param": name,
                     "code": "missing_required_parameter"})
        if self.cached_tokens is not None and self.cached_tokens >= len(self.prompt_token_ids):
            raise PydanticCustomError(
                "invalid_value", "disaggregated_params.cached_tokens ({cached}) must be less than the "
                "prompt's {num} tokens", {"cached": self.cached_tokens, "num": len(self.prompt_token_ids),
                                          "param": "cached_tokens"})
        return self._check_ctx_endpoints()

    def _check_ctx_endpoints(self) -> Self:
        """As many ``ctx_endpoints`` as the layout's ctx ranks (none for one), the first one
        ``ctx_endpoint``."""
        assert self.layout is not None
        num, tp = len(self.ctx_endpoints), self.layout.ctx_tp_size
        if (num or tp > 1) and num != tp:
            raise PydanticCustomError(
                "invalid_value", "disaggregated_params.ctx_endpoints names {num} ctx ranks, the layout's "
                "ctx world has ctx_tp_size={tp}", {"num": num, "tp": tp, "param": "ctx_endpoints"})
        if num and self.ctx_endpoints[0] != self.ctx_endpoint:
            first = self.ctx_endpoints[0]
            raise PydanticCustomError(
                "invalid_value", "disaggregated_params.ctx_endpoints[0] ({host}:{port}) is not ctx_endpoint",
                {"host": first.host, "port": first.port, "param": "ctx_endpoints"})
        return self

    @property
    def is_context_only(self) -> bool:
        return self.request_type is RequestType.CONTEXT_ONLY

    @property
    def is_generation_only(self) -> bool:
        return self.request_type is RequestType.GENERATION_ONLY

    def for_generation(self) -> DisaggregatedParams:
        """These (ctx-filled) params as a validated ``generation_only`` request's params.

        Raises ``pydantic.ValidationError`` when the ctx answer lacks a required field.
        """
        return DisaggregatedParams.model_validate(
            {**self.model_dump(), "request_type": RequestType.GENERATION_ONLY})
