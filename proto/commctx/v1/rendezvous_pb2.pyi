from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    INVALID_REQUEST: _ClassVar[ErrorReason]
    JOB_CONFLICT: _ClassVar[ErrorReason]
    STALE_GENERATION: _ClassVar[ErrorReason]
    RANK_TAKEN: _ClassVar[ErrorReason]
    JOB_FULL: _ClassVar[ErrorReason]
    MEMBER_NOT_FOUND: _ClassVar[ErrorReason]
    RENDEZVOUS_TIMEOUT: _ClassVar[ErrorReason]
    SERVER_UNAVAILABLE: _ClassVar[ErrorReason]
    UNAUTHENTICATED_CALLER: _ClassVar[ErrorReason]
    JOB_SEALED: _ClassVar[ErrorReason]
    SERVER_FULL: _ClassVar[ErrorReason]
    NOT_LEADER: _ClassVar[ErrorReason]
    JOB_CLOSED: _ClassVar[ErrorReason]
    SESSION_REPLACED: _ClassVar[ErrorReason]

class Scope(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCOPE_JOB: _ClassVar[Scope]
    SCOPE_NODE: _ClassVar[Scope]
ERROR_REASON_UNSPECIFIED: ErrorReason
INVALID_REQUEST: ErrorReason
JOB_CONFLICT: ErrorReason
STALE_GENERATION: ErrorReason
RANK_TAKEN: ErrorReason
JOB_FULL: ErrorReason
MEMBER_NOT_FOUND: ErrorReason
RENDEZVOUS_TIMEOUT: ErrorReason
SERVER_UNAVAILABLE: ErrorReason
UNAUTHENTICATED_CALLER: ErrorReason
JOB_SEALED: ErrorReason
SERVER_FULL: ErrorReason
NOT_LEADER: ErrorReason
JOB_CLOSED: ErrorReason
SESSION_REPLACED: ErrorReason
SCOPE_JOB: Scope
SCOPE_NODE: Scope

class JobSpec(_message.Message):
    __slots__ = ("world_size", "layout", "roles", "groups", "cpu_twins", "expected_nodes", "elastic", "nodes")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    CPU_TWINS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_NODES_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    layout: ParallelLayout
    roles: _containers.RepeatedCompositeFieldContainer[RoleCount]
    groups: _containers.RepeatedCompositeFieldContainer[GroupRule]
    cpu_twins: _containers.RepeatedScalarFieldContainer[str]
    expected_nodes: _containers.RepeatedScalarFieldContainer[str]
    elastic: Elastic
    nodes: Nodes
    def __init__(self, world_size: _Optional[int] = ..., layout: _Optional[_Union[ParallelLayout, _Mapping]] = ..., roles: _Optional[_Iterable[_Union[RoleCount, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[GroupRule, _Mapping]]] = ..., cpu_twins: _Optional[_Iterable[str]] = ..., expected_nodes: _Optional[_Iterable[str]] = ..., elastic: _Optional[_Union[Elastic, _Mapping]] = ..., nodes: _Optional[_Union[Nodes, _Mapping]] = ...) -> None: ...

class Nodes(_message.Message):
    __slots__ = ("min", "max", "last_call_ms")
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    LAST_CALL_MS_FIELD_NUMBER: _ClassVar[int]
    min: int
    max: int
    last_call_ms: int
    def __init__(self, min: _Optional[int] = ..., max: _Optional[int] = ..., last_call_ms: _Optional[int] = ...) -> None: ...

class Elastic(_message.Message):
    __slots__ = ("min_size", "last_call_ms")
    MIN_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_CALL_MS_FIELD_NUMBER: _ClassVar[int]
    min_size: int
    last_call_ms: int
    def __init__(self, min_size: _Optional[int] = ..., last_call_ms: _Optional[int] = ...) -> None: ...

class ParallelLayout(_message.Message):
    __slots__ = ("tp", "cp", "ep", "dp", "pp", "order", "within_node")
    TP_FIELD_NUMBER: _ClassVar[int]
    CP_FIELD_NUMBER: _ClassVar[int]
    EP_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    WITHIN_NODE_FIELD_NUMBER: _ClassVar[int]
    tp: int
    cp: int
    ep: int
    dp: int
    pp: int
    order: str
    within_node: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tp: _Optional[int] = ..., cp: _Optional[int] = ..., ep: _Optional[int] = ..., dp: _Optional[int] = ..., pp: _Optional[int] = ..., order: _Optional[str] = ..., within_node: _Optional[_Iterable[str]] = ...) -> None: ...

class RoleCount(_message.Message):
    __slots__ = ("role", "count")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    role: str
    count: int
    def __init__(self, role: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class GroupRule(_message.Message):
    __slots__ = ("mode", "role_group", "weight_transfer", "named")
    MODE_FIELD_NUMBER: _ClassVar[int]
    ROLE_GROUP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    NAMED_FIELD_NUMBER: _ClassVar[int]
    mode: str
    role_group: RoleGroup
    weight_transfer: WeightTransfer
    named: NamedGroups
    def __init__(self, mode: _Optional[str] = ..., role_group: _Optional[_Union[RoleGroup, _Mapping]] = ..., weight_transfer: _Optional[_Union[WeightTransfer, _Mapping]] = ..., named: _Optional[_Union[NamedGroups, _Mapping]] = ...) -> None: ...

class RoleGroup(_message.Message):
    __slots__ = ("roles", "scope")
    ROLES_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    roles: _containers.RepeatedScalarFieldContainer[str]
    scope: Scope
    def __init__(self, roles: _Optional[_Iterable[str]] = ..., scope: _Optional[_Union[Scope, str]] = ...) -> None: ...

class WeightTransfer(_message.Message):
    __slots__ = ("sender_role", "receiver_roles", "scope")
    SENDER_ROLE_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ROLES_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    sender_role: str
    receiver_roles: _containers.RepeatedScalarFieldContainer[str]
    scope: Scope
    def __init__(self, sender_role: _Optional[str] = ..., receiver_roles: _Optional[_Iterable[str]] = ..., scope: _Optional[_Union[Scope, str]] = ...) -> None: ...

class NamedGroups(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[RankList]
    def __init__(self, groups: _Optional[_Iterable[_Union[RankList, _Mapping]]] = ...) -> None: ...

class RankList(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("job_id", "spec", "node_key", "address", "master_port", "local_rank", "node_rank", "wait_timeout_ms", "role", "member_id", "member_secret", "job_secret", "workers", "host_workers", "host_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NODE_KEY_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_SECRET_FIELD_NUMBER: _ClassVar[int]
    JOB_SECRET_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    HOST_WORKERS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    spec: JobSpec
    node_key: str
    address: str
    master_port: int
    local_rank: int
    node_rank: int
    wait_timeout_ms: int
    role: str
    member_id: str
    member_secret: str
    job_secret: str
    workers: int
    host_workers: _containers.RepeatedCompositeFieldContainer[HostWorker]
    host_id: str
    def __init__(self, job_id: _Optional[str] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., node_key: _Optional[str] = ..., address: _Optional[str] = ..., master_port: _Optional[int] = ..., local_rank: _Optional[int] = ..., node_rank: _Optional[int] = ..., wait_timeout_ms: _Optional[int] = ..., role: _Optional[str] = ..., member_id: _Optional[str] = ..., member_secret: _Optional[str] = ..., job_secret: _Optional[str] = ..., workers: _Optional[int] = ..., host_workers: _Optional[_Iterable[_Union[HostWorker, _Mapping]]] = ..., host_id: _Optional[str] = ...) -> None: ...

class HostWorker(_message.Message):
    __slots__ = ("index", "role", "local_rank")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    index: int
    role: str
    local_rank: int
    def __init__(self, index: _Optional[int] = ..., role: _Optional[str] = ..., local_rank: _Optional[int] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("member_id", "lease_ttl_ms", "assignment", "member_secret", "worker_assignments")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    MEMBER_SECRET_FIELD_NUMBER: _ClassVar[int]
    WORKER_ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    lease_ttl_ms: int
    assignment: Assignment
    member_secret: str
    worker_assignments: _containers.RepeatedCompositeFieldContainer[Assignment]
    def __init__(self, member_id: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ..., assignment: _Optional[_Union[Assignment, _Mapping]] = ..., member_secret: _Optional[str] = ..., worker_assignments: _Optional[_Iterable[_Union[Assignment, _Mapping]]] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("job_id", "generation", "rank", "world_size", "node_rank", "num_nodes", "local_rank", "local_world_size", "master_addr", "master_port", "dist_url", "groups", "role", "changed_groups", "previous_rank", "reason", "previous_lost", "worker", "run")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    DIST_URL_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CHANGED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_RANK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_LOST_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    generation: int
    rank: int
    world_size: int
    node_rank: int
    num_nodes: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    dist_url: str
    groups: _containers.RepeatedCompositeFieldContainer[Group]
    role: str
    changed_groups: _containers.RepeatedScalarFieldContainer[str]
    previous_rank: int
    reason: str
    previous_lost: bool
    worker: int
    run: int
    def __init__(self, job_id: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., node_rank: _Optional[int] = ..., num_nodes: _Optional[int] = ..., local_rank: _Optional[int] = ..., local_world_size: _Optional[int] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., dist_url: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[Group, _Mapping]]] = ..., role: _Optional[str] = ..., changed_groups: _Optional[_Iterable[str]] = ..., previous_rank: _Optional[int] = ..., reason: _Optional[str] = ..., previous_lost: _Optional[bool] = ..., worker: _Optional[int] = ..., run: _Optional[int] = ...) -> None: ...

class Group(_message.Message):
    __slots__ = ("mode", "index", "ranks", "cpu_twin", "root")
    MODE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    CPU_TWIN_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    mode: str
    index: int
    ranks: RankSet
    cpu_twin: bool
    root: int
    def __init__(self, mode: _Optional[str] = ..., index: _Optional[int] = ..., ranks: _Optional[_Union[RankSet, _Mapping]] = ..., cpu_twin: _Optional[bool] = ..., root: _Optional[int] = ...) -> None: ...

class RankSet(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RankRun]
    def __init__(self, runs: _Optional[_Iterable[_Union[RankRun, _Mapping]]] = ...) -> None: ...

class RankRun(_message.Message):
    __slots__ = ("start", "count", "stride")
    START_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    start: int
    count: int
    stride: int
    def __init__(self, start: _Optional[int] = ..., count: _Optional[int] = ..., stride: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("job_id", "member_id", "generation", "spare_port", "member_secret", "restart_generation", "failed_generation", "gone_workers", "left_workers", "expired_workers")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SPARE_PORT_FIELD_NUMBER: _ClassVar[int]
    MEMBER_SECRET_FIELD_NUMBER: _ClassVar[int]
    RESTART_GENERATION_FIELD_NUMBER: _ClassVar[int]
    FAILED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    GONE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    LEFT_WORKERS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    member_id: str
    generation: int
    spare_port: int
    member_secret: str
    restart_generation: int
    failed_generation: int
    gone_workers: _containers.RepeatedScalarFieldContainer[int]
    left_workers: _containers.RepeatedScalarFieldContainer[int]
    expired_workers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., member_id: _Optional[str] = ..., generation: _Optional[int] = ..., spare_port: _Optional[int] = ..., member_secret: _Optional[str] = ..., restart_generation: _Optional[int] = ..., failed_generation: _Optional[int] = ..., gone_workers: _Optional[_Iterable[int]] = ..., left_workers: _Optional[_Iterable[int]] = ..., expired_workers: _Optional[_Iterable[int]] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("lease_ttl_ms", "world_changed", "assignment", "gone", "job_ended", "job_closed", "worker_assignments")
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    WORLD_CHANGED_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    GONE_FIELD_NUMBER: _ClassVar[int]
    JOB_ENDED_FIELD_NUMBER: _ClassVar[int]
    JOB_CLOSED_FIELD_NUMBER: _ClassVar[int]
    WORKER_ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_ms: int
    world_changed: WorldChange
    assignment: Assignment
    gone: str
    job_ended: bool
    job_closed: bool
    worker_assignments: _containers.RepeatedCompositeFieldContainer[Assignment]
    def __init__(self, lease_ttl_ms: _Optional[int] = ..., world_changed: _Optional[_Union[WorldChange, _Mapping]] = ..., assignment: _Optional[_Union[Assignment, _Mapping]] = ..., gone: _Optional[str] = ..., job_ended: _Optional[bool] = ..., job_closed: _Optional[bool] = ..., worker_assignments: _Optional[_Iterable[_Union[Assignment, _Mapping]]] = ...) -> None: ...

class WorldChange(_message.Message):
    __slots__ = ("generation", "reason", "lost")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    generation: int
    reason: str
    lost: bool
    def __init__(self, generation: _Optional[int] = ..., reason: _Optional[str] = ..., lost: _Optional[bool] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("job_id", "member_id", "generation", "member_secret")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MEMBER_SECRET_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    member_id: str
    generation: int
    member_secret: str
    def __init__(self, job_id: _Optional[str] = ..., member_id: _Optional[str] = ..., generation: _Optional[int] = ..., member_secret: _Optional[str] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("lease_ttl_ms", "generation")
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_ms: int
    generation: int
    def __init__(self, lease_ttl_ms: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("job_id", "member_id", "member_secret", "job_secret", "close")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_SECRET_FIELD_NUMBER: _ClassVar[int]
    JOB_SECRET_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    member_id: str
    member_secret: str
    job_secret: str
    close: bool
    def __init__(self, job_id: _Optional[str] = ..., member_id: _Optional[str] = ..., member_secret: _Optional[str] = ..., job_secret: _Optional[str] = ..., close: _Optional[bool] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeJobRequest(_message.Message):
    __slots__ = ("job_id", "job_secret", "node_page_size", "node_page_token", "run")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_SECRET_FIELD_NUMBER: _ClassVar[int]
    NODE_PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NODE_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    job_secret: str
    node_page_size: int
    node_page_token: str
    run: int
    def __init__(self, job_id: _Optional[str] = ..., job_secret: _Optional[str] = ..., node_page_size: _Optional[int] = ..., node_page_token: _Optional[str] = ..., run: _Optional[int] = ...) -> None: ...

class JobDescription(_message.Message):
    __slots__ = ("job_id", "state", "generation", "spec", "joined", "missing", "nodes", "reason", "forming_for_s", "missing_nodes", "waiting", "not_ready", "num_nodes", "next_node_page_token", "refused", "last_refused", "run", "started_at", "ended_at", "other_runs")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[JobDescription.State]
        FORMING: _ClassVar[JobDescription.State]
        FORMED: _ClassVar[JobDescription.State]
        FAILED: _ClassVar[JobDescription.State]
        ENDED: _ClassVar[JobDescription.State]
        CLOSED: _ClassVar[JobDescription.State]
    STATE_UNSPECIFIED: JobDescription.State
    FORMING: JobDescription.State
    FORMED: JobDescription.State
    FAILED: JobDescription.State
    ENDED: JobDescription.State
    CLOSED: JobDescription.State
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FORMING_FOR_S_FIELD_NUMBER: _ClassVar[int]
    MISSING_NODES_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    NOT_READY_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    NEXT_NODE_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    LAST_REFUSED_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    OTHER_RUNS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: JobDescription.State
    generation: int
    spec: JobSpec
    joined: int
    missing: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeDescription]
    reason: str
    forming_for_s: float
    missing_nodes: _containers.RepeatedScalarFieldContainer[str]
    waiting: int
    not_ready: int
    num_nodes: int
    next_node_page_token: str
    refused: int
    last_refused: str
    run: int
    started_at: float
    ended_at: float
    other_runs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[JobDescription.State, str]] = ..., generation: _Optional[int] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., joined: _Optional[int] = ..., missing: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeDescription, _Mapping]]] = ..., reason: _Optional[str] = ..., forming_for_s: _Optional[float] = ..., missing_nodes: _Optional[_Iterable[str]] = ..., waiting: _Optional[int] = ..., not_ready: _Optional[int] = ..., num_nodes: _Optional[int] = ..., next_node_page_token: _Optional[str] = ..., refused: _Optional[int] = ..., last_refused: _Optional[str] = ..., run: _Optional[int] = ..., started_at: _Optional[float] = ..., ended_at: _Optional[float] = ..., other_runs: _Optional[_Iterable[int]] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("seq", "time", "kind", "generation", "message", "fields")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    time: float
    kind: str
    generation: int
    message: str
    fields: _struct_pb2.Struct
    def __init__(self, seq: _Optional[int] = ..., time: _Optional[float] = ..., kind: _Optional[str] = ..., generation: _Optional[int] = ..., message: _Optional[str] = ..., fields: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class ListEventsRequest(_message.Message):
    __slots__ = ("job_id", "job_secret", "page_size", "page_token", "run")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_SECRET_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    job_secret: str
    page_size: int
    page_token: str
    run: int
    def __init__(self, job_id: _Optional[str] = ..., job_secret: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., run: _Optional[int] = ...) -> None: ...

class ListEventsResponse(_message.Message):
    __slots__ = ("events", "next_page_token")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[JobEvent]
    next_page_token: str
    def __init__(self, events: _Optional[_Iterable[_Union[JobEvent, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("job_id", "job_secret", "after_seq")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_SECRET_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    job_secret: str
    after_seq: int
    def __init__(self, job_id: _Optional[str] = ..., job_secret: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "include_ended")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_ENDED_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    include_ended: bool
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., include_ended: _Optional[bool] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobDescription]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobDescription, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class NodeDescription(_message.Message):
    __slots__ = ("node_key", "address", "workers", "addresses", "node_rank", "roles")
    NODE_KEY_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    node_key: str
    address: str
    workers: int
    addresses: _containers.RepeatedScalarFieldContainer[str]
    node_rank: int
    roles: _containers.RepeatedCompositeFieldContainer[RoleCount]
    def __init__(self, node_key: _Optional[str] = ..., address: _Optional[str] = ..., workers: _Optional[int] = ..., addresses: _Optional[_Iterable[str]] = ..., node_rank: _Optional[int] = ..., roles: _Optional[_Iterable[_Union[RoleCount, _Mapping]]] = ...) -> None: ...
