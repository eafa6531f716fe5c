from pdserve.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_ROLE_UNSPECIFIED: _ClassVar[NodeRole]
    NODE_ROLE_PREFILL: _ClassVar[NodeRole]
    NODE_ROLE_DECODE: _ClassVar[NodeRole]

class DecodeMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECODE_MODE_UNSPECIFIED: _ClassVar[DecodeMode]
    DECODE_MODE_DISAGGREGATED: _ClassVar[DecodeMode]
    DECODE_MODE_LOCAL_PREFILL: _ClassVar[DecodeMode]
NODE_ROLE_UNSPECIFIED: NodeRole
NODE_ROLE_PREFILL: NodeRole
NODE_ROLE_DECODE: NodeRole
DECODE_MODE_UNSPECIFIED: DecodeMode
DECODE_MODE_DISAGGREGATED: DecodeMode
DECODE_MODE_LOCAL_PREFILL: DecodeMode

class NodeSamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop_token_ids", "ignore_eos", "min_tokens", "logprobs", "structured_output", "prompt_logprobs", "logit_bias", "speculative")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    logprobs: int
    structured_output: _generation_pb2.StructuredOutput
    prompt_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    speculative: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., structured_output: _Optional[_Union[_generation_pb2.StructuredOutput, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., speculative: _Optional[bool] = ...) -> None: ...

class TransferTicket(_message.Message):
    __slots__ = ("transfer_id", "dst_address", "dst_block_ids", "layout_hash", "num_tokens", "expires_at_unix_s", "signature", "kv_device", "kv_cache_dtype", "num_cached_blocks", "tp_size", "ranks")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DST_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    KV_DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    dst_address: str
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    layout_hash: str
    num_tokens: int
    expires_at_unix_s: float
    signature: bytes
    kv_device: str
    kv_cache_dtype: str
    num_cached_blocks: int
    tp_size: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankEndpoint]
    def __init__(self, transfer_id: _Optional[str] = ..., dst_address: _Optional[str] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., layout_hash: _Optional[str] = ..., num_tokens: _Optional[int] = ..., expires_at_unix_s: _Optional[float] = ..., signature: _Optional[bytes] = ..., kv_device: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., num_cached_blocks: _Optional[int] = ..., tp_size: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankEndpoint, _Mapping]]] = ...) -> None: ...

class RankEndpoint(_message.Message):
    __slots__ = ("rank", "address", "kv_head_start", "kv_head_end", "kv_device")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_END_FIELD_NUMBER: _ClassVar[int]
    KV_DEVICE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    address: str
    kv_head_start: int
    kv_head_end: int
    kv_device: str
    def __init__(self, rank: _Optional[int] = ..., address: _Optional[str] = ..., kv_head_start: _Optional[int] = ..., kv_head_end: _Optional[int] = ..., kv_device: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "mode", "transfer_timeout_s", "output_token_ids", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: NodeSamplingParams
    mode: DecodeMode
    transfer_timeout_s: float
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[NodeSamplingParams, _Mapping]] = ..., mode: _Optional[_Union[DecodeMode, str]] = ..., transfer_timeout_s: _Optional[float] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("ticket", "tokens")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ticket: TransferTicket
    tokens: TokenChunk
    def __init__(self, ticket: _Optional[_Union[TransferTicket, _Mapping]] = ..., tokens: _Optional[_Union[TokenChunk, _Mapping]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("output_index", "token_ids", "logprobs", "finish_reason", "num_cached_tokens", "prompt_logprobs", "prefilled_here")
    OUTPUT_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_HERE_FIELD_NUMBER: _ClassVar[int]
    output_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    finish_reason: str
    num_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    prefilled_here: bool
    def __init__(self, output_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., prefilled_here: _Optional[bool] = ...) -> None: ...

class CancelTransferRequest(_message.Message):
    __slots__ = ("transfer_id", "reason")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    reason: str
    def __init__(self, transfer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelTransferResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "ticket", "transfer_timeout_s", "cache_salt", "ticket_timeout_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TICKET_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: NodeSamplingParams
    ticket: TransferTicket
    transfer_timeout_s: float
    cache_salt: str
    ticket_timeout_s: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[NodeSamplingParams, _Mapping]] = ..., ticket: _Optional[_Union[TransferTicket, _Mapping]] = ..., transfer_timeout_s: _Optional[float] = ..., cache_salt: _Optional[str] = ..., ticket_timeout_s: _Optional[float] = ...) -> None: ...

class AttachTicketRequest(_message.Message):
    __slots__ = ("request_id", "ticket")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ticket: TransferTicket
    def __init__(self, request_id: _Optional[str] = ..., ticket: _Optional[_Union[TransferTicket, _Mapping]] = ...) -> None: ...

class AttachTicketResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "transfer_result")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_RESULT_FIELD_NUMBER: _ClassVar[int]
    first_token: PrefillFirstToken
    transfer_result: PrefillTransferResult
    def __init__(self, first_token: _Optional[_Union[PrefillFirstToken, _Mapping]] = ..., transfer_result: _Optional[_Union[PrefillTransferResult, _Mapping]] = ...) -> None: ...

class PrefillFirstToken(_message.Message):
    __slots__ = ("token_id", "logprob", "finish_reason", "num_cached_tokens", "prompt_logprobs", "draft_token_ids")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: _generation_pb2.TokenLogprob
    finish_reason: str
    num_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[_Union[_generation_pb2.TokenLogprob, _Mapping]] = ..., finish_reason: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillTransferResult(_message.Message):
    __slots__ = ("ok", "error", "num_bytes", "elapsed_s")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    num_bytes: int
    elapsed_s: float
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., num_bytes: _Optional[int] = ..., elapsed_s: _Optional[float] = ...) -> None: ...

class WatchKVEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEvents(_message.Message):
    __slots__ = ("epoch", "seq", "reset", "stored", "removed")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    seq: int
    reset: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, epoch: _Optional[str] = ..., seq: _Optional[int] = ..., reset: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetNodeInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("role", "model_name", "layout_hash", "max_model_len", "vocab_size", "eos_token_ids", "block_size", "kv_transport", "protocol_version", "max_num_seqs", "default_sampling")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    role: NodeRole
    model_name: str
    layout_hash: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    kv_transport: str
    protocol_version: int
    max_num_seqs: int
    default_sampling: NodeSamplingParams
    def __init__(self, role: _Optional[_Union[NodeRole, str]] = ..., model_name: _Optional[str] = ..., layout_hash: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., kv_transport: _Optional[str] = ..., protocol_version: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., default_sampling: _Optional[_Union[NodeSamplingParams, _Mapping]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStats(_message.Message):
    __slots__ = ("num_kv_blocks", "num_free_kv_blocks", "num_running_requests", "num_waiting_requests", "num_pending_transfers", "num_finished_requests", "num_local_prefills", "num_failed_transfers", "num_prefix_cache_hit_tokens", "num_queued_prefill_tokens", "last_transfer", "num_in_place_transfers", "num_host_kv_blocks", "num_free_host_kv_blocks", "num_host_prefix_cache_hit_tokens", "num_kv_offload_bytes", "num_kv_promotion_bytes", "num_prefilled_tokens", "num_kv_transfers", "num_kv_transfer_bytes", "num_kv_skipped_bytes", "num_spec_verifies", "num_spec_draft_tokens", "num_spec_accepted_tokens", "num_spec_emitted_tokens")
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCAL_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_PLACE_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_HOST_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_OFFLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_PROMOTION_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_SKIPPED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_VERIFIES_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_EMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_running_requests: int
    num_waiting_requests: int
    num_pending_transfers: int
    num_finished_requests: int
    num_local_prefills: int
    num_failed_transfers: int
    num_prefix_cache_hit_tokens: int
    num_queued_prefill_tokens: int
    last_transfer: LayerTimeline
    num_in_place_transfers: int
    num_host_kv_blocks: int
    num_free_host_kv_blocks: int
    num_host_prefix_cache_hit_tokens: int
    num_kv_offload_bytes: int
    num_kv_promotion_bytes: int
    num_prefilled_tokens: int
    num_kv_transfers: int
    num_kv_transfer_bytes: int
    num_kv_skipped_bytes: int
    num_spec_verifies: int
    num_spec_draft_tokens: int
    num_spec_accepted_tokens: int
    num_spec_emitted_tokens: int
    def __init__(self, num_kv_blocks: _Optional[int] = ..., num_free_kv_blocks: _Optional[int] = ..., num_running_requests: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ..., num_pending_transfers: _Optional[int] = ..., num_finished_requests: _Optional[int] = ..., num_local_prefills: _Optional[int] = ..., num_failed_transfers: _Optional[int] = ..., num_prefix_cache_hit_tokens: _Optional[int] = ..., num_queued_prefill_tokens: _Optional[int] = ..., last_transfer: _Optional[_Union[LayerTimeline, _Mapping]] = ..., num_in_place_transfers: _Optional[int] = ..., num_host_kv_blocks: _Optional[int] = ..., num_free_host_kv_blocks: _Optional[int] = ..., num_host_prefix_cache_hit_tokens: _Optional[int] = ..., num_kv_offload_bytes: _Optional[int] = ..., num_kv_promotion_bytes: _Optional[int] = ..., num_prefilled_tokens: _Optional[int] = ..., num_kv_transfers: _Optional[int] = ..., num_kv_transfer_bytes: _Optional[int] = ..., num_kv_skipped_bytes: _Optional[int] = ..., num_spec_verifies: _Optional[int] = ..., num_spec_draft_tokens: _Optional[int] = ..., num_spec_accepted_tokens: _Optional[int] = ..., num_spec_emitted_tokens: _Optional[int] = ...) -> None: ...

class LayerTimeline(_message.Message):
    __slots__ = ("transfer_id", "request_id", "computed_s", "sent_s", "landed_s", "marks_s")
    class MarksSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_S_FIELD_NUMBER: _ClassVar[int]
    SENT_S_FIELD_NUMBER: _ClassVar[int]
    LANDED_S_FIELD_NUMBER: _ClassVar[int]
    MARKS_S_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    computed_s: _containers.RepeatedScalarFieldContainer[float]
    sent_s: _containers.RepeatedScalarFieldContainer[float]
    landed_s: _containers.RepeatedScalarFieldContainer[float]
    marks_s: _containers.ScalarMap[str, float]
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., computed_s: _Optional[_Iterable[float]] = ..., sent_s: _Optional[_Iterable[float]] = ..., landed_s: _Optional[_Iterable[float]] = ..., marks_s: _Optional[_Mapping[str, float]] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerFiles(_message.Message):
    __slots__ = ("tokenizer_json", "tokenizer_config_json", "chat_template")
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    tokenizer_json: bytes
    tokenizer_config_json: bytes
    chat_template: str
    def __init__(self, tokenizer_json: _Optional[bytes] = ..., tokenizer_config_json: _Optional[bytes] = ..., chat_template: _Optional[str] = ...) -> None: ...
