"""`kvtier stats` fits an 80-column terminal: one column per tier, nothing cut (issue 19: one
column per measure cut every header to three letters)."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from rich.console import Console

from kvtier.api.stats_view import ROWS, render


def _lines(stats: dict, width: int = 80) -> list[str]:
    out = io.StringIO()
    render(stats, Console(file=out, width=width, color_system=None))
    return out.getvalue().splitlines()


def _stats(tiers: dict) -> dict:
    return {"tiers": tiers, "hit_ratio": None, "gets": 0, "puts": 0, "checksum_failures": 0,
            "leases": 0, "uptime_s": 3.2}


def test_four_tiers_with_large_counts_fit_80_columns_uncut():
    tier = {"capacity_bytes": 1 << 40, "used_bytes": (1 << 40) - 1, "blocks": 123456789012,
            "hits": 1234567890123, "misses": 2345, "promotions": 34, "demotions": 3,
            "evictions": 12345, "bytes_read": 10 ** 15, "bytes_written": 10 ** 11}
    lines = _lines(_stats({"hbm": tier, "host": tier, "nvme": tier, "remote": tier}))
    text = "\n".join(lines)
    assert max(len(line) for line in lines) <= 80 and "…" not in text
    for label, _key, _show in ROWS:
        assert any(line.startswith(f"│ {label} ") for line in lines), label
    assert "1234567890123" in text and "909.5 TiB" in text and "1.0 TiB" in text
    assert "1024.0 GiB" not in text                          # rounds up to the next unit


def test_missing_measures_show_a_dash():
    lines = _lines(_stats({"remote": {"hits": 5}}))
    row = next(line for line in lines if line.startswith("│ capacity"))
    assert row.split("│")[2].strip() == "-"
    assert any("hit ratio -" in line for line in lines)


def test_the_command_fits_80_columns(service):
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "stats", "--socket",
                          str(service.socket)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "80"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in out.stdout
    assert "host" in lines[2] and "nvme" in lines[2] and any("promotions" in x for x in lines)
