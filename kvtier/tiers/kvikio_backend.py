"""The NVMe back-end on GPU hosts: kvikio (GPUDirect Storage, or its POSIX compat mode).

kvikio moves bytes between a file and host or device memory with its own thread pool, splitting
each request into ``task_size`` pieces. Where GDS is not available (no nvidia-fs, or a file system
without it), kvikio runs in compat mode with the same API. This back-end keeps the POSIX file
descriptor for header and size bookkeeping and hands the data path to kvikio.CuFile.

kvikio needs libcuda, so it is imported only here, lazily, and only when a CUDA device is present.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from kvtier.tiers.nvme import PosixBackend


class KvikioBackend(PosixBackend):
    name = "kvikio"

    def __init__(self, kvikio: Any) -> None:
        self._kvikio = kvikio
        self._files: dict[int, Any] = {}
        try:
            import kvikio.defaults as kd
            self.compat_mode = str(kd.compat_mode())
        except (ImportError, AttributeError):
            self.compat_mode = "unknown"

    def open(self, path: Path, create: bool, direct: bool) -> int:
        fd = super().open(path, create, direct=False)
        self._files[fd] = self._kvikio.CuFile(str(path), "r+")
        return fd

    def pwritev(self, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
        f = self._files[fd]
        futures, pos = [], offset
        for b in bufs:
            futures.append(f.pwrite(b, len(b), pos))
            pos += len(b)
        return sum(fut.get() for fut in futures)

    def preadv(self, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
        f = self._files[fd]
        futures, pos = [], offset
        for b in bufs:
            futures.append(f.pread(b, len(b), pos))
            pos += len(b)
        return sum(fut.get() for fut in futures)

    def sync(self, fd: int) -> None:
        os.fdatasync(fd)

    def close(self, fd: int) -> None:
        f = self._files.pop(fd, None)
        if f is not None:
            f.close()
        super().close(fd)


def kvikio_backend() -> KvikioBackend | None:
    """A kvikio back-end when kvikio imports and a CUDA device is visible, else None."""
    try:
        import cupy
        import kvikio
    except ImportError:
        return None
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except cupy.cuda.runtime.CUDARuntimeError:
        return None
    return KvikioBackend(kvikio)
