"""tools/system-deps, the one step that installs the system packages `make test` and `make run`
need: where it cannot install (no apt-get; not root and no password-less sudo) it stops with the
exact command to run. Run for real as an unprivileged user, on a PATH that lacks the tools (the
root path is what every fresh-machine `make test` runs)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "system-deps"
PACKAGES = ("redis-server", "fio", "chromium")


def _run_unprivileged(tools: tuple[str, ...]) -> subprocess.CompletedProcess:
    """The script as an unprivileged user whose PATH holds only `tools` (no redis-server, fio,
    chromium or sudo), read from stdin so that the user needs no access to the checkout."""
    if os.getuid() != 0 and shutil.which("sudo") and subprocess.run(
            ["sudo", "-n", "true"], capture_output=True).returncode == 0:
        pytest.skip("password-less sudo here: the script would install for real")
    bindir = Path(tempfile.mkdtemp(prefix="kvtier-deps-"))
    try:
        bindir.chmod(0o755)
        for tool in ("bash", "id", "grep", "env", *tools):
            path = shutil.which(tool)
            if path is None:
                pytest.skip(f"{tool} is not installed here (a Debian/Ubuntu tool)")
            (bindir / tool).symlink_to(path)
        user = {"user": 65534, "group": 65534} if os.getuid() == 0 else {}
        return subprocess.run([str(bindir / "bash"), "-s"], input=SCRIPT.read_text(), text=True,
                              env={"PATH": str(bindir)}, cwd="/", capture_output=True,
                              timeout=30, **user)
    finally:
        shutil.rmtree(bindir)


def test_without_root_it_stops_with_the_exact_command():
    out = _run_unprivileged(("apt-get",))
    assert out.returncode == 1
    want = "sudo apt-get update && sudo apt-get install -y " + " ".join(PACKAGES)
    assert want in out.stderr, out.stderr


def test_without_apt_it_names_the_packages_and_says_so():
    out = _run_unprivileged(())
    assert out.returncode == 1
    assert "missing system packages: " + " ".join(PACKAGES) in out.stderr, out.stderr
    assert "no apt-get" in out.stderr
