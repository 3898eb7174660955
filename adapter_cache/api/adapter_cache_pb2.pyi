from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StageRequest(_message.Message):
    __slots__ = ("uri", "sha256", "lease_seconds")
    URI_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    uri: str
    sha256: str
    lease_seconds: int
    def __init__(self, uri: _Optional[str] = ..., sha256: _Optional[str] = ..., lease_seconds: _Optional[int] = ...) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class StageResponse(_message.Message):
    __slots__ = ("lease_id", "path", "tensors", "config_json", "size_bytes", "sha256", "cache_hit", "lease_expires_at")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    path: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    config_json: str
    size_bytes: int
    sha256: str
    cache_hit: bool
    lease_expires_at: float
    def __init__(self, lease_id: _Optional[str] = ..., path: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., config_json: _Optional[str] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., cache_hit: _Optional[bool] = ..., lease_expires_at: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReadRequest(_message.Message):
    __slots__ = ("lease_id", "chunk_bytes")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    chunk_bytes: int
    def __init__(self, lease_id: _Optional[str] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class ReadResponse(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("uri",)
    URI_FIELD_NUMBER: _ClassVar[int]
    uri: str
    def __init__(self, uri: _Optional[str] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted_uris",)
    EVICTED_URIS_FIELD_NUMBER: _ClassVar[int]
    evicted_uris: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, evicted_uris: _Optional[_Iterable[str]] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheEntry(_message.Message):
    __slots__ = ("uri", "size_bytes", "leases", "last_used_at", "hits", "sha256", "path")
    URI_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_AT_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    uri: str
    size_bytes: int
    leases: int
    last_used_at: float
    hits: int
    sha256: str
    path: str
    def __init__(self, uri: _Optional[str] = ..., size_bytes: _Optional[int] = ..., leases: _Optional[int] = ..., last_used_at: _Optional[float] = ..., hits: _Optional[int] = ..., sha256: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("entries", "capacity_bytes", "used_bytes")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[CacheEntry]
    capacity_bytes: int
    used_bytes: int
    def __init__(self, entries: _Optional[_Iterable[_Union[CacheEntry, _Mapping]]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ...) -> None: ...
