"""Real redis-server processes on loopback for the remote-tier tests (started and stopped here)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from tests.service import free_port


class RedisServer:
    def __init__(self, workdir: Path, *extra: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.extra = list(extra)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (make test installs it: tools/system-deps)")
        log = open(self.dir / "redis.log", "ab")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir), *self.extra],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.cli("PING").strip() == "PONG":
                return self
            time.sleep(0.05)
        log_text = (self.dir / "redis.log").read_text()[-600:]
        raise RuntimeError(f"redis-server on {self.port} did not start:\n{log_text}")

    def cli(self, *args: str) -> str:
        out = subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True,
                             text=True, timeout=30)
        return out.stdout

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is a valid port too."""
    while True:
        port = free_port()
        if port + 10000 <= 65535:
            return port


def start_cluster(workdir: Path, n: int = 3) -> list[RedisServer]:
    nodes = [RedisServer(workdir, "--cluster-enabled", "yes", "--cluster-config-file",
                         "nodes.conf", "--cluster-node-timeout", "2000",
                         port=_cluster_port()).start()
             for _ in range(n)]
    out = subprocess.run(["redis-cli", "--cluster", "create",
                          *[f"127.0.0.1:{s.port}" for s in nodes], "--cluster-replicas", "0",
                          "--cluster-yes"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        for s in nodes:
            s.stop()
        raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout}{out.stderr}")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if all("cluster_state:ok" in s.cli("CLUSTER", "INFO") for s in nodes):
            return nodes
        time.sleep(0.1)
    raise RuntimeError("the cluster did not reach state ok")
