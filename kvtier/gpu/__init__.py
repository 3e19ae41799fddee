"""The client's CUDA data path: asynchronous gets and puts on the engine's stream.

    transfer.py   get_async / put_async and their handles (events, per-layer completion,
                  leases ended and commits sent only after the copies have completed)
    device.py     streams, staged indices, the slots the GPU addresses (mapped host segment,
                  HBM pools by CUDA IPC), the enqueueing of copies
    plan.py       which method moves which pages (copy engines or an SM-bounded kernel), the
                  copy runs and launch splits: numpy only, tested on CPU
    kernels.py    the gather/scatter and checksum kernels
    probe.py      how fast the SMs read mapped host memory (gpu_sorted_gets = auto)
    xxh3.py       the GPU checksum sent with an offload's commit, and its numpy reference

Importing this package needs neither cupy nor a GPU; the first transfer does.
"""

from __future__ import annotations


def warm(device: int = 0, measure: bool = True) -> None:
    """Create the CUDA context and compile the kernels before the first request (a worker's
    first transfer otherwise pays NVRTC's compile, ~0.5 s); measure: also the mapped-read
    probe that gpu_sorted_gets = auto decides by (kvtier.gpu.probe, tens of ms with its
    buffer's registration; never run inside a get)."""
    import cupy
    from kvtier.gpu import kernels, probe
    with cupy.cuda.Device(device):
        for name in ("move_pages16", "move_pages16_deep", "move_pages8", "move_layers16",
                     "move_layers8", "xxh3_pages"):
            kernels.get(name)
        if measure:
            from kvtier.gpu.transfer import policy
            probe.measure(device, policy())
