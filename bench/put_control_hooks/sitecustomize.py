"""bench/put_control.py's hooks (--later, --serve, --pack-buf), loaded into `kvtier serve` as
sitecustomize (PYTHONPATH). --later, when PUT_CONTROL_LATER names a file: what each Server._dispatch returned (a reply, an awaitable,
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

# --serve: each request's times in the service (PUT_CONTROL_SERVE names the file), on
# CLOCK_MONOTONIC as the client's perf_counter: when its frame's last byte was received (the
# data_received call that completed it, found by the stream's byte offsets), its dispatch's
# start and end (a Later's: its turn's), and its reply written (transport.write returned).
# Written at exit as JSON, one row per request in the service's order.
_serve = os.environ.get("PUT_CONTROL_SERVE")
if _serve:
    import json as _json
    import kvtier.api.connection as CN
    import kvtier.api.server as SV
    pc = time.perf_counter
    ROWS: list = []
    RX: dict = {}       # client id -> [[(bytes received so far, time), ...], bytes consumed]
    _data_received, _write = CN.Connection.data_received, CN.Connection._write
    _dispatch_s, _dispatch_req = SV.Server._dispatch, SV.Server._dispatch_req

    def data_received(self, data):
        log = RX.setdefault(self.client.cid, [[], 0])
        log[0].append(((log[0][-1][0] if log[0] else 0) + len(data), pc()))
        return _data_received(self, data)

    def arrival(cid, size):
        """When the frame of size bytes just cut from cid's stream had its last byte in."""
        log = RX.get(cid)
        if log is None:
            return None
        log[1] += size
        while len(log[0]) > 1 and log[0][0][0] < log[1]:
            log[0].pop(0)           # received wholly before this frame's end
        return log[0][0][1]

    def dispatch(self, client, body, own=-1):
        at = arrival(client.cid, 4 + len(body))
        ROWS.append({"cid": client.cid, "arrived": at, "start": pc()})
        row = ROWS[-1]
        out = _dispatch_s(self, client, body, own)
        if type(out) is CN.Later:       # its work runs in its turn: time that instead
            inner = out.dispatch

            def turn():
                row["start"] = pc()
                r = inner()
                row["end"] = pc()
                return r
            out.dispatch = turn
            row["later"] = True
        else:
            row["end"] = pc()
        return out

    def dispatch_req(self, client, req, req_id, op):
        row = ROWS[-1]
        row.update(id=req_id, op=op, keys=len(req.get("keys") or b"") // 16
                   or len(req.get("checksums") or b"") // 8)
        return _dispatch_req(self, client, req, req_id, op)

    def write(self, reply, t0):
        t = pc()
        _write(self, reply, t0)
        done = pc()
        rid = reply[0].get("id")
        for row in reversed(ROWS):
            if row.get("id") == rid and row["cid"] == self.client.cid:
                row["write_start"], row["written"] = t, done
                break

    CN.Connection.data_received, CN.Connection._write = data_received, write
    SV.Server._dispatch, SV.Server._dispatch_req = dispatch, dispatch_req

    def _dump_serve():
        import kvtier
        with open(_serve, "w") as f:
            _json.dump({"kvtier": kvtier.__file__, "rows": ROWS}, f)
    atexit.register(_dump_serve)

# PUT_CONTROL_PACK_BUF (bytes): measurement only, what a protocol.pack that gives msgpack's
# Packer a buffer under the service's mmap threshold would buy. `kvtier serve` pins glibc's
# mmap threshold at 128 KiB (kvtier.memory.tune_malloc), and msgpack.packb makes a Packer of
# 256 KiB on every call: in the service every reply's pack is an mmap, a page fault and a
# munmap (dev VM: 12.5 us a pack against 0.9 with a 64 KiB buffer).
_pack_buf = int(os.environ.get("PUT_CONTROL_PACK_BUF") or 0)
if _pack_buf:
    import msgpack
    import kvtier.api.protocol as _P

    def _pack(obj, _packb=msgpack.packb, _length=_P.LENGTH.pack):
        body = _packb(obj, use_bin_type=True, buf_size=_pack_buf)
        return _length(len(body)) + body
    _P.pack = _pack
