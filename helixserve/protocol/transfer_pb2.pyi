from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardRequest(_message.Message):
    __slots__ = ("ctx_request_id", "gen_rank", "cp_rank", "cp_size", "layout_json", "ucx_worker_address", "tag_base", "num_prompt_tokens", "max_message_bytes", "deadline_ms", "dst_block_ids", "dst_slot", "pull_epoch", "pack_bytes")
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
    PULL_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PACK_BYTES_FIELD_NUMBER: _ClassVar[int]
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
    pull_epoch: int
    pack_bytes: int
    def __init__(self, ctx_request_id: _Optional[str] = ..., gen_rank: _Optional[int] = ..., cp_rank: _Optional[int] = ..., cp_size: _Optional[int] = ..., layout_json: _Optional[str] = ..., ucx_worker_address: _Optional[bytes] = ..., tag_base: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., dst_slot: _Optional[int] = ..., pull_epoch: _Optional[int] = ..., pack_bytes: _Optional[int] = ...) -> None: ...

class PayloadDescriptor(_message.Message):
    __slots__ = ("kind", "first_message", "message_nbytes")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KV_BLOCKS: _ClassVar[PayloadDescriptor.Kind]
        KDA_STATE: _ClassVar[PayloadDescriptor.Kind]
        CONV_STATE: _ClassVar[PayloadDescriptor.Kind]
        AUX: _ClassVar[PayloadDescriptor.Kind]
        DRAFT: _ClassVar[PayloadDescriptor.Kind]
    KV_BLOCKS: PayloadDescriptor.Kind
    KDA_STATE: PayloadDescriptor.Kind
    CONV_STATE: PayloadDescriptor.Kind
    AUX: PayloadDescriptor.Kind
    DRAFT: PayloadDescriptor.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    FIRST_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_NBYTES_FIELD_NUMBER: _ClassVar[int]
    kind: PayloadDescriptor.Kind
    first_message: int
    message_nbytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[_Union[PayloadDescriptor.Kind, str]] = ..., first_message: _Optional[int] = ..., message_nbytes: _Optional[_Iterable[int]] = ...) -> None: ...

class ShardReply(_message.Message):
    __slots__ = ("accepted", "error", "ucx_worker_address", "message_bytes", "payloads", "pull", "pack_bytes")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    UCX_WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    PACK_BYTES_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    error: str
    ucx_worker_address: bytes
    message_bytes: int
    payloads: _containers.RepeatedCompositeFieldContainer[PayloadDescriptor]
    pull: PullShard
    pack_bytes: int
    def __init__(self, accepted: _Optional[bool] = ..., error: _Optional[str] = ..., ucx_worker_address: _Optional[bytes] = ..., message_bytes: _Optional[int] = ..., payloads: _Optional[_Iterable[_Union[PayloadDescriptor, _Mapping]]] = ..., pull: _Optional[_Union[PullShard, _Mapping]] = ..., pack_bytes: _Optional[int] = ...) -> None: ...

class PullShard(_message.Message):
    __slots__ = ("src_block_ids", "src_slot", "aux")
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SRC_SLOT_FIELD_NUMBER: _ClassVar[int]
    AUX_FIELD_NUMBER: _ClassVar[int]
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    src_slot: int
    aux: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, src_block_ids: _Optional[_Iterable[int]] = ..., src_slot: _Optional[int] = ..., aux: _Optional[_Iterable[int]] = ...) -> None: ...

class PoolsRequest(_message.Message):
    __slots__ = ("gen_rank", "host_id")
    GEN_RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    gen_rank: int
    host_id: str
    def __init__(self, gen_rank: _Optional[int] = ..., host_id: _Optional[str] = ...) -> None: ...

class IpcStorage(_message.Message):
    __slots__ = ("handle", "size_bytes", "offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, handle: _Optional[bytes] = ..., size_bytes: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class IpcTensor(_message.Message):
    __slots__ = ("kind", "layer_id", "storage", "byte_offset", "shape", "dtype")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        MLA_KV: _ClassVar[IpcTensor.Kind]
        KDA_STATE: _ClassVar[IpcTensor.Kind]
        CONV_STATE: _ClassVar[IpcTensor.Kind]
        DRAFT_KV: _ClassVar[IpcTensor.Kind]
        DRAFT_FEATURES: _ClassVar[IpcTensor.Kind]
    MLA_KV: IpcTensor.Kind
    KDA_STATE: IpcTensor.Kind
    CONV_STATE: IpcTensor.Kind
    DRAFT_KV: IpcTensor.Kind
    DRAFT_FEATURES: IpcTensor.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYER_ID_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    kind: IpcTensor.Kind
    layer_id: int
    storage: int
    byte_offset: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, kind: _Optional[_Union[IpcTensor.Kind, str]] = ..., layer_id: _Optional[int] = ..., storage: _Optional[int] = ..., byte_offset: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class PoolsReply(_message.Message):
    __slots__ = ("supported", "reason", "epoch", "device_uuid", "storages", "tensors", "grant_key", "lease_path", "lease_words")
    SUPPORTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    STORAGES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    GRANT_KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_PATH_FIELD_NUMBER: _ClassVar[int]
    LEASE_WORDS_FIELD_NUMBER: _ClassVar[int]
    supported: bool
    reason: str
    epoch: int
    device_uuid: str
    storages: _containers.RepeatedCompositeFieldContainer[IpcStorage]
    tensors: _containers.RepeatedCompositeFieldContainer[IpcTensor]
    grant_key: bytes
    lease_path: str
    lease_words: int
    def __init__(self, supported: _Optional[bool] = ..., reason: _Optional[str] = ..., epoch: _Optional[int] = ..., device_uuid: _Optional[str] = ..., storages: _Optional[_Iterable[_Union[IpcStorage, _Mapping]]] = ..., tensors: _Optional[_Iterable[_Union[IpcTensor, _Mapping]]] = ..., grant_key: _Optional[bytes] = ..., lease_path: _Optional[str] = ..., lease_words: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("known", "num_posted_messages", "message_bytes", "ucx_worker_address", "pack_bytes")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    NUM_POSTED_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    UCX_WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PACK_BYTES_FIELD_NUMBER: _ClassVar[int]
    known: bool
    num_posted_messages: int
    message_bytes: int
    ucx_worker_address: bytes
    pack_bytes: int
    def __init__(self, known: _Optional[bool] = ..., num_posted_messages: _Optional[int] = ..., message_bytes: _Optional[int] = ..., ucx_worker_address: _Optional[bytes] = ..., pack_bytes: _Optional[int] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("ctx_request_id", "cp_rank", "gen_rank", "success", "error", "cp_size")
    CTX_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CP_RANK_FIELD_NUMBER: _ClassVar[int]
    GEN_RANK_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ctx_request_id: str
    cp_rank: int
    gen_rank: int
    success: bool
    error: str
    cp_size: int
    def __init__(self, ctx_request_id: _Optional[str] = ..., cp_rank: _Optional[int] = ..., gen_rank: _Optional[int] = ..., success: _Optional[bool] = ..., error: _Optional[str] = ..., cp_size: _Optional[int] = ...) -> None: ...

class AckReply(_message.Message):
    __slots__ = ("known", "error")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    known: bool
    error: str
    def __init__(self, known: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...
