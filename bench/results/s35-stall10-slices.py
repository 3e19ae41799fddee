"""Per slice as the server runs it: locked fn + the generator's advance to the next step."""
import os, sys, shutil, tempfile, time, json
import numpy as np
sys.path.insert(0, os.getcwd())
from kvtier.coherence.engine import Engine
from kvtier.coherence.gets import advance
from kvtier.config import make_settings
def key(i): return (i + 2).to_bytes(16, "big")
cold, batch, bb = 4096, 64, 65536


def engine():
    """bench/stall.py's engine shape: 64 MiB host tier, the cold set flushed to NVMe."""
    base = tempfile.mkdtemp(prefix="s10-", dir="/tmp")
    eng = Engine(make_settings({"data_dir": base, "host_capacity": "64MiB",
        "nvme_capacity": str(cold * bb * 2 + (64 << 20)), "segment_bytes": "64MiB", "write_policy": "write_back"}))
    eng.create_namespace("s", bb)
    data = np.random.default_rng(0).integers(0, 256, (64, bb), dtype=np.uint8)
    for lo in range(0, cold, 64):
        eng.put("s", b"".join(key(i) for i in range(lo, lo + 64)), data[:64])
    eng.flush()
    return eng, base




def main():
    eng, base = engine()
    rng = np.random.default_rng(1)
    T = {}
    def one():
        ks = b"".join(key(int(k)) for k in rng.choice(cold, batch, replace=False))
        steps = eng.get_steps("s", ks, 0)
        step, out = advance(steps, None, None)
        while step is not None:
            if step.locked:
                name = step.fn.func.__name__
                t0 = time.perf_counter()
                with eng.lock:
                    value = step.fn()
                t1 = time.perf_counter()
                step, out = advance(steps, value, None)
                t2 = time.perf_counter()
                T.setdefault(name + ":fn", []).append(t1 - t0)
                T.setdefault(name + ":adv", []).append(t2 - t1)
                T.setdefault(name + ":slice", []).append(t2 - t0)
            else:
                value = step.fn()
                step, out = advance(steps, value, None)
        eng.release(out.lease_id)
    for _ in range(100): one()
    T.clear()
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 600): one()
    eng.close(flush=False); shutil.rmtree(base, ignore_errors=True)
    print(json.dumps({k: [round(float(np.percentile(v, 50)) * 1e6, 1), round(float(np.percentile(v, 90)) * 1e6, 1)] for k, v in T.items()}))


if __name__ == "__main__":
    main()
