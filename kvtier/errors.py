"""The exceptions kvtier raises, one small family.

Expected misses are not errors: a get of an unknown key returns a miss, not an exception. These
classes are for failures, and each message says what to change. Every class carries a stable
``code`` that the socket protocol sends in error replies, so that a client re-raises the same type.
"""

from __future__ import annotations


class KvtierError(Exception):
    """Base of every kvtier failure."""

    code = "error"


class ConfigError(KvtierError):
    """A setting is missing, malformed or contradicts another one."""

    code = "config"


class DataDirError(KvtierError):
    """The data directory is missing, unwritable or not a kvtier directory."""

    code = "data_dir"


class NamespaceError(KvtierError):
    """A namespace is unknown, exists already with another layout, or its name is invalid."""

    code = "namespace"


class BadRequest(KvtierError):
    """The caller sent something malformed: a wrong key width, a wrong block size, a bad slot."""

    code = "bad_request"


class CapacityError(KvtierError):
    """No tier has room: every slot is leased, reserved or dirty with nowhere to write it back."""

    code = "capacity"


class LeaseError(KvtierError):
    """A lease or reservation is unknown, already released or expired."""

    code = "lease"


class ChecksumError(KvtierError):
    """Bytes came back with a checksum that does not match the page table."""

    code = "checksum"


class StorageError(KvtierError):
    """The NVMe tier or LMDB failed (disk full, read-only, I/O error)."""

    code = "storage"


class ProtocolError(KvtierError):
    """The frame could not be decoded or does not follow the protocol."""

    code = "protocol"


class AuthError(KvtierError):
    """The peer is not allowed: wrong uid or missing token."""

    code = "auth"


class ServiceUnavailable(KvtierError):
    """The service cannot be reached or went away mid-request."""

    code = "unavailable"


class PutOutcomeUnknown(ServiceUnavailable):
    """The connection was lost after a put (or a put's commit) was sent and before its reply:
    the old service may or may not have stored those blocks. Raised by the client, never
    retried by it: check with match_prefix or get, or put the blocks again."""

    code = "put_outcome_unknown"


BY_CODE: dict[str, type[KvtierError]] = {
    cls.code: cls
    for cls in (
        KvtierError, ConfigError, DataDirError, NamespaceError, BadRequest, CapacityError,
        LeaseError, ChecksumError, StorageError, ProtocolError, AuthError, ServiceUnavailable,
        PutOutcomeUnknown,
    )
}
