"""The `kvtier` command with garbage: one line naming the problem, exit status 2, nothing
started; and the settings table the README is generated from."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cli import main


def _kvtier(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args,match", [
    (["--host-capacity", "lots"], "host_capacity"),
    (["--write-policy", "sometimes"], "write_policy"),
    (["--admin", "0.0.0.0:18123"], "admin_token"),
    (["--config", "/nonexistent/kvtier.toml"], "does not exist"),
])
def test_serve_refuses_bad_settings(tmp_path: Path, args, match):
    out = _kvtier("serve", "--data-dir", str(tmp_path / "d"), *args)
    assert out.returncode == 2
    assert match in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "d" / "run" / "kvtier.sock").exists()


def test_serve_refuses_a_data_dir_that_is_a_file(tmp_path: Path):
    f = tmp_path / "file"
    f.write_text("x")
    out = _kvtier("serve", "--data-dir", str(f), "--admin", "")
    assert out.returncode == 2 and "data_dir" in out.stderr and "Traceback" not in out.stderr


def test_serve_with_its_admin_port_taken_says_so_and_removes_its_socket(tmp_path: Path):
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _kvtier("serve", "--data-dir", str(tmp_path / "d"), "--admin", f"127.0.0.1:{port}")
    assert out.returncode == 2, out.stderr
    assert "admin API could not listen" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "d" / "run" / "kvtier.sock").exists()


def test_a_second_serve_on_the_same_data_dir_is_refused_and_the_first_keeps_serving(
        service, tmp_path: Path):
    from kvtier.api.client import Client
    out = _kvtier("serve", "--data-dir", str(service.data_dir), "--admin", "",
                  "--socket", str(tmp_path / "second.sock"))
    assert out.returncode == 2, out.stderr
    assert "another kvtier serve" in out.stderr and "Traceback" not in out.stderr
    assert f"pid {service.proc.pid}" in out.stderr
    assert not (tmp_path / "second.sock").exists()
    with Client(service.socket) as c:
        assert "tiers" in c.stats()


def test_serve_where_no_socket_can_be_made_is_a_one_line_error(tmp_path: Path):
    out = _kvtier("serve", "--data-dir", str(tmp_path / "d"), "--admin", "",
                  "--socket", "/proc/kvtier-test.sock")
    assert out.returncode == 2, out.stderr
    assert "/proc/kvtier-test.sock" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("spoil", ["directory", "binary", "spaces"])
def test_serve_with_a_spoiled_admin_token_file_names_it(tmp_path: Path, spoil):
    d = tmp_path / "d"
    d.mkdir()
    token = d / "admin.token"
    if spoil == "directory":
        token.mkdir()
    else:
        token.write_bytes(b"\xff\xfe\x01token" if spoil == "binary" else b"two words\n")
    import socket
    with socket.socket() as free:                  # a port nobody listens on (admin: no 0)
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    out = _kvtier("serve", "--data-dir", str(d), "--admin", f"127.0.0.1:{port}")
    assert out.returncode == 2, out.stderr
    assert "admin.token" in out.stderr and "Traceback" not in out.stderr
    assert not (d / "run" / "kvtier.sock").exists()


@pytest.mark.parametrize("url", ["garbage", "http://[::1"])
def test_stats_with_a_malformed_url_is_a_clear_error(url, capsys):
    assert main(["stats", "--url", url]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_stats_without_a_service_is_a_clear_error(tmp_path: Path, capsys):
    assert main(["stats", "--socket", str(tmp_path / "none.sock")]) == 2
    assert "is `kvtier serve` running?" in capsys.readouterr().err


def test_config_markdown_and_effective_settings(capsys):
    assert main(["config", "--markdown"]) == 0
    assert "`host_capacity`" in capsys.readouterr().out
    assert main(["config", "--host-capacity", "2GiB"]) == 0
    assert '"host_capacity": 2147483648' in capsys.readouterr().out


def test_tools_report_errors_with_status_2(tmp_path: Path, capsys):
    assert main(["replay", str(tmp_path / "missing.jsonl"), "--capacity", "1e6"]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    assert main(["bench", "--rw=sideways"]) == 2
    assert "rw=" in capsys.readouterr().err


def test_check_repair_beside_a_running_serve_is_refused_and_moves_nothing(service):
    # a repair quarantines what it finds damaged: beside a live service that could be the
    # segment it is writing. A plain check (read-only) is still allowed.
    import numpy as np

    from kvtier.api.client import Client
    key = bytes(range(16))
    data = np.full((1, 4096), 7, dtype=np.uint8)
    with Client(service.socket) as c:
        c.namespace("t", block_bytes=4096).put(key, data)
    out = _kvtier("check", "--data-dir", str(service.data_dir), "--repair")
    assert out.returncode != 0, out.stdout
    assert "another kvtier serve" in out.stderr and "Traceback" not in out.stderr
    assert f"pid {service.proc.pid}" in out.stderr
    assert not (service.data_dir / "quarantine").exists()
    with Client(service.socket) as c:
        found, got = c.namespace("t", block_bytes=4096).get(key)
        assert found.tolist() == [True] and (got == data).all()
