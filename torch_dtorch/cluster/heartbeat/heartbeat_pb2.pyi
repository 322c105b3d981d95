# ruff: noqa
# mypy: ignore-errors
# Generated from heartbeat.proto by regen_stubs.py (version guards removed, see there).
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Beat(_message.Message):
    __slots__ = ("worker_id", "host", "pid", "sequence", "state", "op", "busy_since", "sent_at")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[Beat.State]
        IDLE: _ClassVar[Beat.State]
        BUSY: _ClassVar[Beat.State]
        STOPPING: _ClassVar[Beat.State]
    STATE_UNSPECIFIED: Beat.State
    IDLE: Beat.State
    BUSY: Beat.State
    STOPPING: Beat.State
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    BUSY_SINCE_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    host: str
    pid: int
    sequence: int
    state: Beat.State
    op: str
    busy_since: float
    sent_at: float
    def __init__(self, worker_id: _Optional[str] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., sequence: _Optional[int] = ..., state: _Optional[_Union[Beat.State, str]] = ..., op: _Optional[str] = ..., busy_since: _Optional[float] = ..., sent_at: _Optional[float] = ...) -> None: ...
