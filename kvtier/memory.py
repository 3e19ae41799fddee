"""Process-wide memory settings for the service.

glibc raises its mmap threshold each time a large block is freed (up to 32 MiB), after which big
numpy temporaries come from the heap and their pages are not given back to the kernel. For a
service that builds multi-GB page tables in batches this showed as 240 instead of 150 resident
bytes per entry at 1M entries (bench/pagetable.py). Pinning the threshold at 128 KiB keeps large
arrays in their own mappings, returned on free. Called by ``kvtier serve`` and the benchmarks,
never on import: a library does not change its host's allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_MMAP_THRESHOLD = -3


def tune_malloc(threshold: int = 128 * 1024) -> bool:
    """Fix glibc's mmap threshold. Returns False where there is no glibc (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))
