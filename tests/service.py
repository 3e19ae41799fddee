"""Start and stop a real `kvtier serve` subprocess for integration tests and benchmarks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def admin_evict(url: str, data_dir: Path, tier: str = "host", count: int = 1 << 30) -> int:
    """POST /v1/evict to the service at url, with the admin token of its data_dir: drop up to
    count copies from tier (a lower tier keeps each block). Returns the copies evicted."""
    import json
    import urllib.request
    token = (Path(data_dir) / "admin.token").read_text().strip()
    req = urllib.request.Request(f"{url}/v1/evict", method="POST",
                                 data=json.dumps({"tier": tier, "count": count}).encode(),
                                 headers={"Authorization": f"Bearer {token}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return int(json.loads(resp.read())["evicted"])


class Service:
    """A `kvtier serve` process on data_dir. start() waits until the socket answers."""

    def __init__(self, data_dir: Path, admin: bool = True, **settings: Any) -> None:
        self.data_dir = Path(data_dir)
        self.socket = self.data_dir / "run" / "kvtier.sock"
        self.port = free_port() if admin else 0
        self.settings = settings
        self.proc: subprocess.Popen | None = None
        self.log = self.data_dir.parent / f"serve-{self.data_dir.name}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> "Service":
        args = [sys.executable, "-m", "kvtier.cli", "serve", "--data-dir", str(self.data_dir),
                "--admin", f"127.0.0.1:{self.port}" if self.port else ""]
        for k, v in self.settings.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        start = self.log.stat().st_size if self.log.exists() else 0
        logf = open(self.log, "ab")
        self.proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        logf.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log.read_text()[start:]
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtier serve exited with {self.proc.returncode}:\n{text}")
            if "kvtier: admin" in text:
                return self
            time.sleep(0.05)
        raise RuntimeError("kvtier serve did not start:\n" + self.log.read_text())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.proc = None
        return rc

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def evict(self, tier: str = "host", count: int = 1 << 30) -> int:
        """Drop up to count copies from tier (admin_evict)."""
        return admin_evict(self.url, self.data_dir, tier, count)

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""
