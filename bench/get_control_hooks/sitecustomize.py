"""bench/get_control.py's hooks, loaded into `kvtier serve` as sitecustomize (PYTHONPATH) when
GET_CONTROL_TRACE names a file: each data_received (bytes in), each frame's dispatch, its
msgpack decode, the engine's try_get and the reply's build inside it, and each reply's pack and
write, as (kind, t0, t1, extra) on CLOCK_MONOTONIC (the probe's perf_counter too); pickled at
exit. For measuring only: it wraps methods of kvtier.api.server, .connection and .protocol.
"""
import atexit
import os
import time

_path = os.environ.get("GET_CONTROL_TRACE")
if _path:
    import pickle
    pc = time.perf_counter
    EV = []

    def _dump():
        with open(_path, "wb") as f:
            pickle.dump(EV, f)
    atexit.register(_dump)
    import kvtier.api.connection as CN
    import kvtier.api.protocol as P
    import kvtier.api.server as SV

    def _timed(cls_or_mod, name, kind, extra=lambda a: None):
        orig = getattr(cls_or_mod, name)

        def f(*a, **k):
            t0 = pc()
            r = orig(*a, **k)
            EV.append((kind, t0, pc(), extra(a)))
            return r
        setattr(cls_or_mod, name, f)
    _timed(CN.Connection, "data_received", "dr", lambda a: len(a[1]))
    _timed(SV.Server, "_dispatch", "dispatch", lambda a: len(a[2]))
    _timed(SV.Server, "_get_reply", "reply")
    _timed(SV.Server, "_fast", "fast", lambda a: getattr(a[1], "__name__", "?"))
    _timed(SV.Server, "_release_first", "release_first")
    _timed(CN.Connection, "_write", "write")
    _timed(P, "unpack", "unpack", lambda a: len(a[0]))
    _timed(P, "pack", "pack")
    _timed(P, "arr", "arr")
    _timed(SV.Server, "_end_leases", "end_leases")
    _timed(SV.Server, "_spawn", "spawn")
    import kvtier.api.quota as Q
    _timed(Q.Pins, "check", "pins_check")
    _init = SV.Server.__init__

    def _init_t(self, engine, *a, **k):
        # The engine's entry points are bound in its __init__: wrap them on the instance.
        for name in ("looks_resident", "wants_prefetch", "release_many", "try_get"):
            if hasattr(engine, name):
                _timed(engine, name, name)
        _init(self, engine, *a, **k)
    SV.Server.__init__ = _init_t
