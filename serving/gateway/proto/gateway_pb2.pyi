from serving.wire import meshserve_pb2 as _meshserve_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState

class SubmitJobRequest(_message.Message):
    __slots__ = ("request", "callback_url", "idempotency_key")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CALLBACK_URL_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    request: _meshserve_pb2.GenerateRequest
    callback_url: str
    idempotency_key: str
    def __init__(self, request: _Optional[_Union[_meshserve_pb2.GenerateRequest, _Mapping]] = ..., callback_url: _Optional[str] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class JobResult(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "usage")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _meshserve_pb2.FinishReason
    usage: _meshserve_pb2.Usage
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_meshserve_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_meshserve_pb2.Usage, _Mapping]] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "state", "tenant", "created_time", "updated_time", "result", "error_code", "error_message", "callback_url", "callback_status", "attempts", "callback_attempts")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CREATED_TIME_FIELD_NUMBER: _ClassVar[int]
    UPDATED_TIME_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CALLBACK_URL_FIELD_NUMBER: _ClassVar[int]
    CALLBACK_STATUS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    CALLBACK_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: JobState
    tenant: str
    created_time: float
    updated_time: float
    result: JobResult
    error_code: str
    error_message: str
    callback_url: str
    callback_status: str
    attempts: int
    callback_attempts: int
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., tenant: _Optional[str] = ..., created_time: _Optional[float] = ..., updated_time: _Optional[float] = ..., result: _Optional[_Union[JobResult, _Mapping]] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ..., callback_url: _Optional[str] = ..., callback_status: _Optional[str] = ..., attempts: _Optional[int] = ..., callback_attempts: _Optional[int] = ...) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InstanceStatus(_message.Message):
    __slots__ = ("name", "target", "pool", "long_lane", "state", "state_reason", "inflight", "routed_total", "score", "report_age_s", "last_report", "window_latency_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    LONG_LANE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    ROUTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    REPORT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORT_FIELD_NUMBER: _ClassVar[int]
    WINDOW_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    target: str
    pool: str
    long_lane: bool
    state: str
    state_reason: str
    inflight: int
    routed_total: int
    score: float
    report_age_s: float
    last_report: _meshserve_pb2.LoadReport
    window_latency_s: float
    def __init__(self, name: _Optional[str] = ..., target: _Optional[str] = ..., pool: _Optional[str] = ..., long_lane: _Optional[bool] = ..., state: _Optional[str] = ..., state_reason: _Optional[str] = ..., inflight: _Optional[int] = ..., routed_total: _Optional[int] = ..., score: _Optional[float] = ..., report_age_s: _Optional[float] = ..., last_report: _Optional[_Union[_meshserve_pb2.LoadReport, _Mapping]] = ..., window_latency_s: _Optional[float] = ...) -> None: ...

class ListInstancesResponse(_message.Message):
    __slots__ = ("instances", "routing_policy", "config_version")
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    ROUTING_POLICY_FIELD_NUMBER: _ClassVar[int]
    CONFIG_VERSION_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceStatus]
    routing_policy: str
    config_version: int
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceStatus, _Mapping]]] = ..., routing_policy: _Optional[str] = ..., config_version: _Optional[int] = ...) -> None: ...

class DrainInstanceRequest(_message.Message):
    __slots__ = ("name", "resume")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    name: str
    resume: bool
    def __init__(self, name: _Optional[str] = ..., resume: _Optional[bool] = ...) -> None: ...

class ReloadConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadConfigResponse(_message.Message):
    __slots__ = ("applied", "error", "config_version")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CONFIG_VERSION_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    error: str
    config_version: int
    def __init__(self, applied: _Optional[bool] = ..., error: _Optional[str] = ..., config_version: _Optional[int] = ...) -> None: ...
