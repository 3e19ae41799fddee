"""bench/put_control.py --later's hooks, loaded into `kvtier serve` as sitecustomize (PYTHONPATH)
when PUT_CONTROL_LATER names a file: what each Server._dispatch returned (a reply, an awaitable,
or a Later: a long request run a poll later as a slice of the step queue, stall6) in order, and
how long each Later waited for its turn (Connection._later's start against the frame's t0);
written at exit as JSON. For measuring only: it wraps kvtier.api.server and .connection.
"""
import atexit
import os
import time

_path = os.environ.get("PUT_CONTROL_LATER")
if _path:
    import json
    import kvtier.api.connection as CN
    import kvtier.api.server as SV
    pc = time.perf_counter
    KINDS: list = []
    WAITS: list = []
    _later, _dispatch = CN.Connection._later, SV.Server._dispatch

    def later(self, out, t0):
        WAITS.append(pc() - t0)
        return _later(self, out, t0)

    def dispatch(self, client, body, own=-1):
        out = _dispatch(self, client, body, own)
        KINDS.append(type(out).__name__)
        return out
    CN.Connection._later, SV.Server._dispatch = later, dispatch

    def _dump():
        with open(_path, "w") as f:
            json.dump({"kinds": KINDS, "later_waits_s": WAITS}, f)
    atexit.register(_dump)
