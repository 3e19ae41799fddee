"""The NVMe back-end on GPU hosts: kvikio (GPUDirect Storage, or its POSIX compat mode).

kvikio moves bytes between a file and host or device memory with its own thread pool, splitting
each request into ``task_size`` pieces. Where GDS is not available (no nvidia-fs, or a file system
without it), kvikio runs in compat mode with the same API. This back-end keeps the POSIX file
descriptor for header and size bookkeeping and hands the data path to kvikio.CuFile.

kvikio needs libcuda, so it is imported only here, lazily, and only when a CUDA device is present.
Sizing. Unless KVIKIO_NTHREADS or KVIKIO_TASK_SIZE is set, the back-end sizes kvikio's pool to
one thread per CPU up to 16 and its tasks to 4 MiB: kvikio's default of one thread left a
256 MiB read at the speed of one preadv (bench/gpu.py kvikio_threads), while a batch of records
that are adjacent in the log is one long run that 4 MiB tasks spread over the pool. The values
in force are reported in the NVMe tier's stats.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from kvtier.tiers.nvme import PosixBackend


class KvikioBackend(PosixBackend):
    name = "kvikio"
    # Its segments are plain files on POSIX fds: reads into host memory go through native AIO
    # on those fds (SegmentLog.read_rows), not one kvikio future per block (issue 17).
    posix_reads = True

    def __init__(self, kvikio: Any) -> None:
        self._kvikio = kvikio
        self._files: dict[int, Any] = {}
        self.compat_mode = _setting(kvikio, "compat_mode")
        self.threads = _setting(kvikio, "num_threads")
        self.task_size = _setting(kvikio, "task_size")

    def open(self, path: Path, create: bool, direct: bool) -> int:
        fd = super().open(path, create, direct=False)
        self._files[fd] = self._kvikio.CuFile(str(path), "r+")
        return fd

    def pwritev(self, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
        return self._each(self._files[fd].pwrite, bufs, offset)

    def preadv(self, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
        return self._each(self._files[fd].pread, bufs, offset)

    @staticmethod
    def _each(op: Any, bufs: Sequence[memoryview], offset: int) -> int:
        """One kvikio request per buffer, all in flight at once; bytes moved in total."""
        futures, pos = [], offset
        for b in bufs:
            futures.append(op(b, len(b), pos))
            pos += len(b)
        return sum(fut.get() for fut in futures)

    def sync(self, fd: int) -> None:
        os.fdatasync(fd)

    def close(self, fd: int) -> None:
        f = self._files.pop(fd, None)
        if f is not None:
            f.close()
        super().close(fd)


def _setting(kvikio: Any, name: str) -> str:
    """A kvikio default, across the API's versions (defaults.get(name) or defaults.name())."""
    try:
        import kvikio.defaults as kd
    except ImportError:
        return "unknown"
    getter = getattr(kd, "get", None)
    try:
        return str(getter(name) if getter is not None else getattr(kd, name)())
    except (AttributeError, KeyError, TypeError, ValueError):
        return "unknown"


DEFAULT_TASK_SIZE = 4 << 20
MAX_THREADS = 16


def size_pool(kvikio: Any) -> None:
    """Set kvikio's thread pool and task size (see the module docstring), across the API's
    versions (defaults.set(...) or the *_reset functions); the environment wins."""
    import kvikio.defaults as kd
    wanted = {}
    if "KVIKIO_NTHREADS" not in os.environ:
        wanted["num_threads"] = max(1, min(MAX_THREADS, os.cpu_count() or 1))
    if "KVIKIO_TASK_SIZE" not in os.environ:
        wanted["task_size"] = DEFAULT_TASK_SIZE
    for name, value in wanted.items():
        setter = getattr(kd, "set", None)
        attempts = ([lambda: setter(name, value), lambda: setter({name: value})]
                    if setter is not None else [])
        attempts.append(lambda: getattr(kd, f"{name}_reset")(value))
        for attempt in attempts:
            try:
                attempt()
                break
            except (AttributeError, TypeError, ValueError, RuntimeError):
                continue               # another API version; kvikio keeps its default if none


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
    size_pool(kvikio)
    return KvikioBackend(kvikio)
