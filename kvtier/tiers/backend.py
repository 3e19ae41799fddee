"""How the NVMe tier's bytes reach the device: the back-end protocol, the POSIX back-end, and
the choice between it and kvikio (tiers.kvikio_backend). tiers.nvme re-exports all three."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Protocol, Sequence

from kvtier.errors import StorageError


class Backend(Protocol):
    name: str

    def open(self, path: Path, create: bool, direct: bool) -> int: ...
    def pwritev(self, fd: int, bufs: Sequence[memoryview], offset: int) -> int: ...
    def preadv(self, fd: int, bufs: Sequence[memoryview], offset: int) -> int: ...
    def sync(self, fd: int) -> None: ...
    def close(self, fd: int) -> None: ...


class PosixBackend:
    """pread/pwrite through the kernel, with O_DIRECT where the file system allows it."""

    name = "posix"

    def open(self, path: Path, create: bool, direct: bool) -> int:
        # O_NOFOLLOW: a segment that is a symlink is refused (ELOOP), never followed.
        flags = (os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
                 | (os.O_CREAT | os.O_EXCL if create else 0))
        if direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # tmpfs and some others refuse O_DIRECT
                    raise
        return os.open(path, flags, 0o600)

    def pwritev(self, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
        return os.pwritev(fd, bufs, offset)

    def preadv(self, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
        return os.preadv(fd, bufs, offset)

    def sync(self, fd: int) -> None:
        os.fdatasync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)


def make_backend(prefer: str = "auto") -> Backend:
    """kvikio when asked for or when CUDA is present and kvikio imports; POSIX otherwise."""
    if prefer in ("auto", "kvikio"):
        from kvtier.tiers.kvikio_backend import kvikio_backend
        backend = kvikio_backend()
        if backend is not None:
            return backend
        if prefer == "kvikio":
            raise StorageError("nvme backend 'kvikio' needs CUDA and the kvikio package "
                               "(pip install 'kvtier[gpu]'); use the posix backend otherwise")
    return PosixBackend()
