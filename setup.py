"""Only the optional C helpers live here; everything else is in pyproject.toml.

kvtier.pagetable._native (the page table's index: hashing, probing, inserts and
removals), kvtier.coherence.policies._queues (the eviction queues and the ghost),
kvtier.coherence._fast (the lease bookkeeping of a resident get, a put's rows and
eviction's), kvtier.coherence._gets (a get's split into ready and to bring up), kvtier.coherence._flush
(a flush's pick and apply), kvtier._xxh (batch hashing through the system's libxxhash), kvtier.tiers._aio
(the NVMe tier's AIO loop), kvtier.tiers._reads (an NVMe get's read in C) and kvtier.tiers._slots (a host pool's checked write) are built when a C compiler and the
Python headers are present; where they fail to build, the package installs anyway and the
Python implementations run instead (the same results, slower).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("kvtier.pagetable._native", ["kvtier/pagetable/_native.c"],
              depends=["kvtier/pagetable/keyhash.h", "kvtier/coherence/cviews.h",
                       "kvtier/coherence/install.h"],
              extra_compile_args=["-O3", "-std=c11"], optional=True),
    # The eviction policies' queues and ghost (kvtier/coherence/policies/queues.py, rings.py).
    Extension("kvtier.coherence.policies._queues", ["kvtier/coherence/policies/_queues.c"],
              depends=["kvtier/coherence/cviews.h", "kvtier/pagetable/keyhash.h",
                       "kvtier/coherence/policies/ghost.h"],
              extra_compile_args=["-O2", "-std=c11"], optional=True),
    # The first half of a get's decide (coherence/gets.py; numpy without it).
    Extension("kvtier.coherence._gets", ["kvtier/coherence/_gets.c"],
              depends=["kvtier/coherence/cviews.h"],
              extra_compile_args=["-O2", "-std=c11", "-Wall"], optional=True),
    # A flush's pick and apply over the page table's columns (coherence/flushes.py; numpy without it).
    Extension("kvtier.coherence._flush", ["kvtier/coherence/_flush.c"],
              depends=["kvtier/coherence/cviews.h"],
              extra_compile_args=["-O2", "-std=c11", "-Wall"], optional=True),
    Extension("kvtier.coherence._fast", ["kvtier/coherence/_fast.c"],
              depends=["kvtier/coherence/cviews.h", "kvtier/coherence/install.h"],
              extra_compile_args=["-O2", "-std=c11"], optional=True),
    # Batch XXH3 through the system's libxxhash, GIL released (kvtier/checksums.py).
    Extension("kvtier._xxh", ["kvtier/_xxh.c"], extra_compile_args=["-O2", "-std=gnu11"],
              optional=True),
    # SlotPool.write's bounds check and row copy (kvtier/tiers/host.py falls back to numpy).
    Extension("kvtier.tiers._slots", ["kvtier/tiers/_slots.c"],
              depends=["kvtier/coherence/cviews.h"],
              extra_compile_args=["-O2", "-std=c11"], optional=True),
    # The NVMe tier's native-AIO submit/reap loop (Linux only; tiers/aio.py falls back to Python).
    Extension("kvtier.tiers._aio", ["kvtier/tiers/_aio.c"], depends=["kvtier/tiers/aio_loop.h"],
              extra_compile_args=["-O2", "-std=gnu11"], optional=True),
    # An NVMe get's whole read (AIO, checksums, verdicts) and its C threads (tiers/reads.py;
    # without it the read runs on the I/O pool in Python, as before).
    Extension("kvtier.tiers._reads", ["kvtier/tiers/_reads.c"], depends=["kvtier/tiers/aio_loop.h"],
              extra_compile_args=["-O2", "-std=gnu11", "-Wall"], extra_link_args=["-pthread"],
              optional=True),
])
