from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_INTERACTIVE: _ClassVar[Priority]
    PRIORITY_BATCH: _ClassVar[Priority]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_TIMEOUT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
PRIORITY_INTERACTIVE: Priority
PRIORITY_BATCH: Priority
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_TIMEOUT: FinishReason
FINISH_REASON_ERROR: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages", "add_generation_prompt")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class SamplingParameters(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "logprobs", "skip_special_tokens", "spaces_between_special_tokens", "n", "logit_bias", "structured", "adapter")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    ignore_eos: bool
    logprobs: int
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    n: int
    logit_bias: _containers.ScalarMap[int, float]
    structured: StructuredOutput
    adapter: str
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., n: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ..., adapter: _Optional[str] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "grammar", "choice", "after_reasoning")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    AFTER_REASONING_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    choice: Choice
    after_reasoning: bool
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., choice: _Optional[_Union[Choice, _Mapping]] = ..., after_reasoning: _Optional[bool] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling", "priority", "tenant", "add_special_tokens", "cache_salt", "kv_export", "kv_source")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    KV_EXPORT_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: Chat
    sampling: SamplingParameters
    priority: Priority
    tenant: str
    add_special_tokens: bool
    cache_salt: str
    kv_export: bool
    kv_source: KVSource
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParameters, _Mapping]] = ..., priority: _Optional[_Union[Priority, str]] = ..., tenant: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., kv_export: _Optional[bool] = ..., kv_source: _Optional[_Union[KVSource, _Mapping]] = ...) -> None: ...

class KVSource(_message.Message):
    __slots__ = ("address", "transfer_id", "prompt_token_ids", "first_token_id", "streamed")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    address: str
    transfer_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    streamed: bool
    def __init__(self, address: _Optional[str] = ..., transfer_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., streamed: _Optional[bool] = ...) -> None: ...

class KVTransfer(_message.Message):
    __slots__ = ("transfer_id", "prompt_token_ids", "num_pages", "page_size", "transport", "timeout_s", "streaming")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    STREAMING_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_pages: int
    page_size: int
    transport: str
    timeout_s: float
    streaming: bool
    def __init__(self, transfer_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., num_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., transport: _Optional[str] = ..., timeout_s: _Optional[float] = ..., streaming: _Optional[bool] = ...) -> None: ...

class PullKVRequest(_message.Message):
    __slots__ = ("transfer_id", "pages_per_chunk")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_PER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    pages_per_chunk: int
    def __init__(self, transfer_id: _Optional[str] = ..., pages_per_chunk: _Optional[int] = ...) -> None: ...

class KVLeaf(_message.Message):
    __slots__ = ("page_shape", "dtype")
    PAGE_SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    page_shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, page_shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class KVPages(_message.Message):
    __slots__ = ("first_page", "num_pages", "leaves", "layout", "page_size", "total_pages", "prefill_done", "last", "first_token_id")
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DONE_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    first_page: int
    num_pages: int
    leaves: _containers.RepeatedScalarFieldContainer[bytes]
    layout: _containers.RepeatedCompositeFieldContainer[KVLeaf]
    page_size: int
    total_pages: int
    prefill_done: bool
    last: bool
    first_token_id: int
    def __init__(self, first_page: _Optional[int] = ..., num_pages: _Optional[int] = ..., leaves: _Optional[_Iterable[bytes]] = ..., layout: _Optional[_Iterable[_Union[KVLeaf, _Mapping]]] = ..., page_size: _Optional[int] = ..., total_pages: _Optional[int] = ..., prefill_done: _Optional[bool] = ..., last: _Optional[bool] = ..., first_token_id: _Optional[int] = ...) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "num_preemptions")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    num_preemptions: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ...) -> None: ...

class RequestTiming(_message.Message):
    __slots__ = ("queue_time_s", "time_to_first_token_s", "e2e_latency_s")
    QUEUE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    E2E_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    queue_time_s: float
    time_to_first_token_s: float
    e2e_latency_s: float
    def __init__(self, queue_time_s: _Optional[float] = ..., time_to_first_token_s: _Optional[float] = ..., e2e_latency_s: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finish_reason", "stop_token_id", "stop_string", "usage", "timing", "index", "kv_transfer")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: FinishReason
    stop_token_id: int
    stop_string: str
    usage: Usage
    timing: RequestTiming
    index: int
    kv_transfer: KVTransfer
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timing: _Optional[_Union[RequestTiming, _Mapping]] = ..., index: _Optional[int] = ..., kv_transfer: _Optional[_Union[KVTransfer, _Mapping]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "chat", "add_special_tokens", "return_token_strings")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_STRINGS_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: Chat
    add_special_tokens: bool
    return_token_strings: bool
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., return_token_strings: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "token_strings", "max_model_len")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRINGS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_strings: _containers.RepeatedScalarFieldContainer[str]
    max_model_len: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., token_strings: _Optional[_Iterable[str]] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("model", "architecture", "vocab_size", "max_model_len", "eos_token_ids", "dtype", "has_tokenizer", "has_chat_template", "page_size", "num_pages", "max_num_seqs", "max_num_batched_tokens", "token_buckets", "compile_count", "compile_time_s", "devices", "instance_id", "max_waiting_requests", "max_waiting_tokens", "max_request_bytes", "served_model_name", "http_port", "reasoning_parser", "tool_call_parser", "quantization", "kv_cache_dtype", "lora_adapters", "max_loras", "role", "kv_transport", "host_kv_cache_pages", "host_kv_cache_bytes", "kv_events_endpoint", "kv_events_replay_endpoint")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    COMPILE_COUNT_FIELD_NUMBER: _ClassVar[int]
    COMPILE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    HTTP_PORT_FIELD_NUMBER: _ClassVar[int]
    REASONING_PARSER_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_PARSER_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_CACHE_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_REPLAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    has_tokenizer: bool
    has_chat_template: bool
    page_size: int
    num_pages: int
    max_num_seqs: int
    max_num_batched_tokens: int
    token_buckets: _containers.RepeatedScalarFieldContainer[int]
    compile_count: int
    compile_time_s: float
    devices: _containers.RepeatedScalarFieldContainer[str]
    instance_id: str
    max_waiting_requests: int
    max_waiting_tokens: int
    max_request_bytes: int
    served_model_name: str
    http_port: int
    reasoning_parser: str
    tool_call_parser: str
    quantization: str
    kv_cache_dtype: str
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoRAAdapter]
    max_loras: int
    role: str
    kv_transport: str
    host_kv_cache_pages: int
    host_kv_cache_bytes: int
    kv_events_endpoint: str
    kv_events_replay_endpoint: str
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., has_tokenizer: _Optional[bool] = ..., has_chat_template: _Optional[bool] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., token_buckets: _Optional[_Iterable[int]] = ..., compile_count: _Optional[int] = ..., compile_time_s: _Optional[float] = ..., devices: _Optional[_Iterable[str]] = ..., instance_id: _Optional[str] = ..., max_waiting_requests: _Optional[int] = ..., max_waiting_tokens: _Optional[int] = ..., max_request_bytes: _Optional[int] = ..., served_model_name: _Optional[str] = ..., http_port: _Optional[int] = ..., reasoning_parser: _Optional[str] = ..., tool_call_parser: _Optional[str] = ..., quantization: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., lora_adapters: _Optional[_Iterable[_Union[LoRAAdapter, _Mapping]]] = ..., max_loras: _Optional[int] = ..., role: _Optional[str] = ..., kv_transport: _Optional[str] = ..., host_kv_cache_pages: _Optional[int] = ..., host_kv_cache_bytes: _Optional[int] = ..., kv_events_endpoint: _Optional[str] = ..., kv_events_replay_endpoint: _Optional[str] = ...) -> None: ...

class LoRAAdapter(_message.Message):
    __slots__ = ("name", "path", "rank", "target_modules", "resident")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    resident: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., resident: _Optional[bool] = ...) -> None: ...

class LoadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class UnloadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class LoRAAdapterResponse(_message.Message):
    __slots__ = ("adapter", "requests_in_flight")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    adapter: LoRAAdapter
    requests_in_flight: int
    def __init__(self, adapter: _Optional[_Union[LoRAAdapter, _Mapping]] = ..., requests_in_flight: _Optional[int] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ("check_invariants",)
    CHECK_INVARIANTS_FIELD_NUMBER: _ClassVar[int]
    check_invariants: bool
    def __init__(self, check_invariants: _Optional[bool] = ...) -> None: ...

class WatchLoadRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class DeviceStepTime(_message.Message):
    __slots__ = ("device", "step_time_s")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    device: str
    step_time_s: float
    def __init__(self, device: _Optional[str] = ..., step_time_s: _Optional[float] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("instance_id", "timestamp", "num_waiting", "num_running", "num_waiting_tokens", "kv_pages_total", "kv_pages_free", "kv_cache_usage", "tokens_per_s", "generation_tokens_per_s", "step_time_p50_s", "step_time_p99_s", "device_step_times", "prefix_cache_hit_rate", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "draining", "serving", "max_num_seqs", "max_waiting_requests", "steps", "invariant_error", "lora_adapters", "lora_resident", "max_loras", "lora_running", "lora_waiting", "host_kv_pages_total", "host_kv_pages_used", "host_prefix_cache_hits")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_P50_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_P99_S_FIELD_NUMBER: _ClassVar[int]
    DEVICE_STEP_TIMES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    INVARIANT_ERROR_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    LORA_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    LORA_RUNNING_FIELD_NUMBER: _ClassVar[int]
    LORA_WAITING_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    HOST_PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    timestamp: float
    num_waiting: int
    num_running: int
    num_waiting_tokens: int
    kv_pages_total: int
    kv_pages_free: int
    kv_cache_usage: float
    tokens_per_s: float
    generation_tokens_per_s: float
    step_time_p50_s: float
    step_time_p99_s: float
    device_step_times: _containers.RepeatedCompositeFieldContainer[DeviceStepTime]
    prefix_cache_hit_rate: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    draining: bool
    serving: bool
    max_num_seqs: int
    max_waiting_requests: int
    steps: int
    invariant_error: str
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    lora_resident: _containers.RepeatedScalarFieldContainer[str]
    max_loras: int
    lora_running: _containers.RepeatedScalarFieldContainer[str]
    lora_waiting: _containers.RepeatedScalarFieldContainer[str]
    host_kv_pages_total: int
    host_kv_pages_used: int
    host_prefix_cache_hits: int
    def __init__(self, instance_id: _Optional[str] = ..., timestamp: _Optional[float] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting_tokens: _Optional[int] = ..., kv_pages_total: _Optional[int] = ..., kv_pages_free: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., generation_tokens_per_s: _Optional[float] = ..., step_time_p50_s: _Optional[float] = ..., step_time_p99_s: _Optional[float] = ..., device_step_times: _Optional[_Iterable[_Union[DeviceStepTime, _Mapping]]] = ..., prefix_cache_hit_rate: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., draining: _Optional[bool] = ..., serving: _Optional[bool] = ..., max_num_seqs: _Optional[int] = ..., max_waiting_requests: _Optional[int] = ..., steps: _Optional[int] = ..., invariant_error: _Optional[str] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., lora_resident: _Optional[_Iterable[str]] = ..., max_loras: _Optional[int] = ..., lora_running: _Optional[_Iterable[str]] = ..., lora_waiting: _Optional[_Iterable[str]] = ..., host_kv_pages_total: _Optional[int] = ..., host_kv_pages_used: _Optional[int] = ..., host_prefix_cache_hits: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("resume",)
    RESUME_FIELD_NUMBER: _ClassVar[int]
    resume: bool
    def __init__(self, resume: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("draining", "num_waiting", "num_running")
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    num_waiting: int
    num_running: int
    def __init__(self, draining: _Optional[bool] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ...) -> None: ...
