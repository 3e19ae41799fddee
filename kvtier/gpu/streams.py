"""Streams of the GPU data path: the caller's, and the few of kvtier's own that a transfer forks
onto and joins back from, so that everything it does is ordered on the caller's stream.

- the kernel stream, of the highest priority the device offers: when the model's kernels fill
  every SM, the block scheduler gives the next free SM to the transfer's few thread blocks
  first, instead of after the model's whole next kernel;
- the checksum stream of puts (kvtier.gpu.xxh3).

Fork: each side stream waits for an event of the caller's stream. Join: the caller's stream
waits for an event of each side stream. No host waits, no device synchronisation.

wait_value: a stream waits, on the GPU, for a counter in device memory to reach a value
(cuStreamWaitValue32, through the driver library: cupy has no binding). A per-layer transfer
done by one kernel signals each layer that way (kernels.move_layers).
"""

from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass
from typing import Any

from kvtier.errors import BadRequest


class _Handle:
    """A cudaStream_t as the CUDA stream protocol (cupy's Stream.from_external)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def _cupy_view(ptr: int, device: int) -> Any:
    import cupy
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        try:
            return from_external(_Handle(ptr))
        except (TypeError, ValueError, AttributeError):
            pass                       # an older protocol: the deprecated class still works
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(ptr, device)


_views: dict[tuple[int, int], "Stream"] = {}
_raw: list[Any] = []


def current_stream_ptr(device: int) -> int:
    """torch's current stream on device as a cudaStream_t. torch._C._cuda_getCurrentRawStream
    (what torch's own compiled code calls) where torch has it: on the H200 host 0.3 us against
    3.9 us for torch.cuda.current_stream(device).cuda_stream, which builds a Stream object
    (bench/single_split.py), and a single-block get asks once per call."""
    if not _raw:
        import torch
        _raw.append(getattr(torch._C, "_cuda_getCurrentRawStream", None))
    if _raw[0] is not None:
        return int(_raw[0](device))
    import torch
    return int(torch.cuda.current_stream(device).cuda_stream)


@dataclass(slots=True)
class Stream:
    """A stream: its handle and a cupy view of it (kernels launch on cupy's current stream);
    owner keeps a stream kvtier made alive."""

    ptr: int
    cupy: Any
    owner: Any = None

    @classmethod
    def resolve(cls, stream: Any, device: int) -> "Stream":
        """torch.cuda.Stream, cupy Stream, a raw cudaStream_t, or None: torch's current stream
        on device (the engine's)."""
        if stream is None:
            ptr = current_stream_ptr(device)
        elif hasattr(stream, "cuda_stream"):
            ptr = int(stream.cuda_stream)
        elif hasattr(stream, "ptr"):
            ptr = int(stream.ptr)
        elif isinstance(stream, int) and not isinstance(stream, bool):
            ptr = stream
        else:
            raise BadRequest(f"stream must be a torch or cupy CUDA stream, or a cudaStream_t "
                             f"as an int, not {type(stream).__name__}")
        view = _views.get((ptr, device))
        if view is None:                   # a view holds no resource: cached for the next call
            view = _views[(ptr, device)] = cls(ptr, _cupy_view(ptr, device))
        return view

    def event(self) -> Any:
        import cupy
        ev = cupy.cuda.Event(block=False, disable_timing=True)
        ev.record(self.cupy)
        return ev

    def wait(self, event: Any) -> None:
        import cupy
        cupy.cuda.runtime.streamWaitEvent(self.ptr, event.ptr, 0)


def settle(st: Stream) -> None:
    """Wait (on the host) until what was enqueued on st so far has run. Where the stream has
    failed (a CUDA error: the context is lost, nothing of it runs any more) there is nothing to
    wait for; that error is not raised here: the transfer's first failure is."""
    import cupy
    try:
        st.event().synchronize()
    except cupy.cuda.runtime.CUDARuntimeError:
        pass


_own: dict[tuple[int, str], Stream] = {}
PRIORITY = {"available": True}      # False where the device offers no higher priority


def own(device: int, role: str, high_priority: bool = False) -> Stream:
    """kvtier's stream ``role`` on device, made once. Non-blocking (it never waits for the
    legacy default stream); high_priority: the device's highest stream priority, through torch
    (cupy 14's Stream takes no priority)."""
    st = _own.get((device, role))
    if st is None:
        import torch
        s = torch.cuda.Stream(device=device, priority=-100 if high_priority else 0)
        PRIORITY["available"] = PRIORITY["available"] and (
            not high_priority or s.priority < 0)
        st = _own[(device, role)] = Stream(int(s.cuda_stream), _cupy_view(s.cuda_stream,
                                                                          device), s)
    return st


class Lanes:
    """Side streams forked from a caller's stream for one step of a transfer, then joined."""

    def __init__(self, caller: Stream, sides: list[Stream]) -> None:
        self.caller, self.sides = caller, sides
        ev = caller.event()
        for s in sides:
            s.wait(ev)

    def join(self) -> None:
        for s in self.sides:
            self.caller.wait(s.event())


_wait_fn: list[Any] = []
_wait_ok: dict[int, bool] = {}


def _cu_wait_value() -> Any:
    if not _wait_fn:
        fn = None
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            for name in ("cuStreamWaitValue32_v2", "cuStreamWaitValue32"):
                try:
                    fn = getattr(lib, name)
                    break
                except AttributeError:
                    continue
        except OSError:
            fn = None
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
        _wait_fn.append(fn)
    return _wait_fn[0]


def wait_value(st: Stream, addr: int, value: int) -> bool:
    """st waits on the GPU until the uint32 at device address addr is >= value. False (and
    nothing enqueued) where the driver refuses stream memory operations."""
    fn = _cu_wait_value()
    return fn is not None and fn(ctypes.c_void_p(st.ptr), ctypes.c_uint64(addr),
                                 ctypes.c_uint32(value), 0) == 0    # CU_STREAM_WAIT_VALUE_GEQ


def can_wait_value(device: int) -> bool:
    """Whether wait_value works on device (tried once on a counter already reached)."""
    ok = _wait_ok.get(device)
    if ok is None:
        import cupy
        with cupy.cuda.Device(device):
            flag = cupy.ones(1, dtype=cupy.uint32)
            probe = own(device, "probe")
            ok = wait_value(probe, int(flag.data.ptr), 1)
            probe.event().synchronize()
        _wait_ok[device] = ok
    return ok
