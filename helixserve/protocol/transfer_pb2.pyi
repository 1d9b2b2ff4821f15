from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardRequest(_message.Message):
    __slots__ = ("ctx_request_id", "gen_rank", "cp_rank", "cp_size", "layout_json", "ucx_worker_address", "tag_base", "num_prompt_tokens", "max_message_bytes", "deadline_ms", "dst_block_ids", "dst_slot")
    CTX_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GEN_RANK_FIELD_NUMBER: _ClassVar[int]
    CP_RANK_FIELD_NUMBER: _ClassVar[int]
    CP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    UCX_WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TAG_BASE_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DST_SLOT_FIELD_NUMBER: _ClassVar[int]
    ctx_request_id: str
    gen_rank: int
    cp_rank: int
    cp_size: int
    layout_json: str
    ucx_worker_address: bytes
    tag_base: int
    num_prompt_tokens: int
    max_message_bytes: int
    deadline_ms: int
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    dst_slot: int
    def __init__(self, ctx_request_id: _Optional[str] = ..., gen_rank: _Optional[int] = ..., cp_rank: _Optional[int] = ..., cp_size: _Optional[int] = ..., layout_json: _Optional[str] = ..., ucx_worker_address: _Optional[bytes] = ..., tag_base: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., dst_slot: _Optional[int] = ...) -> None: ...

class PayloadDescriptor(_message.Message):
    __slots__ = ("kind", "first_message", "message_nbytes")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KV_BLOCKS: _ClassVar[PayloadDescriptor.Kind]
        KDA_STATE: _ClassVar[PayloadDescriptor.Kind]
        CONV_STATE: _ClassVar[PayloadDescriptor.Kind]
        AUX: _ClassVar[PayloadDescriptor.Kind]
    KV_BLOCKS: PayloadDescriptor.Kind
    KDA_STATE: PayloadDescriptor.Kind
    CONV_STATE: PayloadDescriptor.Kind
    AUX: PayloadDescriptor.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    FIRST_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_NBYTES_FIELD_NUMBER: _ClassVar[int]
    kind: PayloadDescriptor.Kind
    first_message: int
    message_nbytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[_Union[PayloadDescriptor.Kind, str]] = ..., first_message: _Optional[int] = ..., message_nbytes: _Optional[_Iterable[int]] = ...) -> None: ...

class ShardReply(_message.Message):
    __slots__ = ("accepted", "error", "ucx_worker_address", "message_bytes", "payloads")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    UCX_WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    error: str
    ucx_worker_address: bytes
    message_bytes: int
    payloads: _containers.RepeatedCompositeFieldContainer[PayloadDescriptor]
    def __init__(self, accepted: _Optional[bool] = ..., error: _Optional[str] = ..., ucx_worker_address: _Optional[bytes] = ..., message_bytes: _Optional[int] = ..., payloads: _Optional[_Iterable[_Union[PayloadDescriptor, _Mapping]]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("ctx_request_id", "cp_rank", "gen_rank", "reason")
    CTX_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CP_RANK_FIELD_NUMBER: _ClassVar[int]
    GEN_RANK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ctx_request_id: str
    cp_rank: int
    gen_rank: int
    reason: str
    def __init__(self, ctx_request_id: _Optional[str] = ..., cp_rank: _Optional[int] = ..., gen_rank: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelReply(_message.Message):
    __slots__ = ("known", "num_posted_messages", "message_bytes", "ucx_worker_address")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    NUM_POSTED_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    UCX_WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    known: bool
    num_posted_messages: int
    message_bytes: int
    ucx_worker_address: bytes
    def __init__(self, known: _Optional[bool] = ..., num_posted_messages: _Optional[int] = ..., message_bytes: _Optional[int] = ..., ucx_worker_address: _Optional[bytes] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("ctx_request_id", "cp_rank", "gen_rank", "success", "error")
    CTX_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CP_RANK_FIELD_NUMBER: _ClassVar[int]
    GEN_RANK_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ctx_request_id: str
    cp_rank: int
    gen_rank: int
    success: bool
    error: str
    def __init__(self, ctx_request_id: _Optional[str] = ..., cp_rank: _Optional[int] = ..., gen_rank: _Optional[int] = ..., success: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class AckReply(_message.Message):
    __slots__ = ("known", "error")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    known: bool
    error: str
    def __init__(self, known: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...
