from pdserve.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_CURRENT: _ClassVar[ProtocolVersion]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION_CURRENT: ProtocolVersion

class TransferMessage(_message.Message):
    __slots__ = ("transfer_id", "seq", "handshake", "handshake_ack", "layer_manifest", "first_token", "result", "hello", "challenge", "progress", "mac")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    HANDSHAKE_FIELD_NUMBER: _ClassVar[int]
    HANDSHAKE_ACK_FIELD_NUMBER: _ClassVar[int]
    LAYER_MANIFEST_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    seq: int
    handshake: TransferHandshake
    handshake_ack: HandshakeAck
    layer_manifest: LayerManifest
    first_token: FirstToken
    result: TransferResult
    hello: TransferHello
    challenge: HandshakeChallenge
    progress: Progress
    mac: bytes
    def __init__(self, transfer_id: _Optional[str] = ..., seq: _Optional[int] = ..., handshake: _Optional[_Union[TransferHandshake, _Mapping]] = ..., handshake_ack: _Optional[_Union[HandshakeAck, _Mapping]] = ..., layer_manifest: _Optional[_Union[LayerManifest, _Mapping]] = ..., first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., result: _Optional[_Union[TransferResult, _Mapping]] = ..., hello: _Optional[_Union[TransferHello, _Mapping]] = ..., challenge: _Optional[_Union[HandshakeChallenge, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., mac: _Optional[bytes] = ...) -> None: ...

class TransferHello(_message.Message):
    __slots__ = ("src_address",)
    SRC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    src_address: str
    def __init__(self, src_address: _Optional[str] = ...) -> None: ...

class HandshakeChallenge(_message.Message):
    __slots__ = ("nonce", "connection", "refused", "proof")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    CONNECTION_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    connection: str
    refused: str
    proof: bytes
    def __init__(self, nonce: _Optional[bytes] = ..., connection: _Optional[str] = ..., refused: _Optional[str] = ..., proof: _Optional[bytes] = ...) -> None: ...

class TransferHandshake(_message.Message):
    __slots__ = ("protocol_version", "layout_hash", "src_address", "num_layers", "num_tokens", "num_blocks", "proof", "kv_device", "write_in_place", "timeout_s", "encrypted", "kv_cache_dtype", "num_cached_blocks", "tp_size", "rank", "kv_head_start", "kv_head_end")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    SRC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    KV_DEVICE_FIELD_NUMBER: _ClassVar[int]
    WRITE_IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ENCRYPTED_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_END_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    layout_hash: str
    src_address: str
    num_layers: int
    num_tokens: int
    num_blocks: int
    proof: bytes
    kv_device: str
    write_in_place: bool
    timeout_s: float
    encrypted: bool
    kv_cache_dtype: str
    num_cached_blocks: int
    tp_size: int
    rank: int
    kv_head_start: int
    kv_head_end: int
    def __init__(self, protocol_version: _Optional[int] = ..., layout_hash: _Optional[str] = ..., src_address: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., proof: _Optional[bytes] = ..., kv_device: _Optional[str] = ..., write_in_place: _Optional[bool] = ..., timeout_s: _Optional[float] = ..., encrypted: _Optional[bool] = ..., kv_cache_dtype: _Optional[str] = ..., num_cached_blocks: _Optional[int] = ..., tp_size: _Optional[int] = ..., rank: _Optional[int] = ..., kv_head_start: _Optional[int] = ..., kv_head_end: _Optional[int] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("num_computed_tokens",)
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_computed_tokens: int
    def __init__(self, num_computed_tokens: _Optional[int] = ...) -> None: ...

class KVPoolExport(_message.Message):
    __slots__ = ("ipc_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "dtype", "shape", "stride", "k_offsets", "v_offsets")
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    K_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    V_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    ipc_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    k_offsets: _containers.RepeatedScalarFieldContainer[int]
    v_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ipc_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., k_offsets: _Optional[_Iterable[int]] = ..., v_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class HandshakeAck(_message.Message):
    __slots__ = ("accepted", "reason", "protocol_version", "pool")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    protocol_version: int
    pool: KVPoolExport
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., protocol_version: _Optional[int] = ..., pool: _Optional[_Union[KVPoolExport, _Mapping]] = ...) -> None: ...

class LayerManifest(_message.Message):
    __slots__ = ("layer_idx", "block_offset", "num_blocks", "num_bytes", "token_end", "written_in_place", "more_layer_ids", "payload_digest")
    LAYER_IDX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    MORE_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_DIGEST_FIELD_NUMBER: _ClassVar[int]
    layer_idx: int
    block_offset: int
    num_blocks: int
    num_bytes: int
    token_end: int
    written_in_place: bool
    more_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    payload_digest: bool
    def __init__(self, layer_idx: _Optional[int] = ..., block_offset: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., token_end: _Optional[int] = ..., written_in_place: _Optional[bool] = ..., more_layer_ids: _Optional[_Iterable[int]] = ..., payload_digest: _Optional[bool] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "logprob", "finish_reason", "draft_token_ids", "sealed")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: _generation_pb2.TokenLogprob
    finish_reason: str
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sealed: bytes
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[_Union[_generation_pb2.TokenLogprob, _Mapping]] = ..., finish_reason: _Optional[str] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., sealed: _Optional[bytes] = ...) -> None: ...

class TransferResult(_message.Message):
    __slots__ = ("ok", "error", "writes_drained")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WRITES_DRAINED_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    writes_drained: bool
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., writes_drained: _Optional[bool] = ...) -> None: ...
