"""`kvtier stats`: the service's statistics as a terminal table (rich), from the socket or the
admin REST API."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from kvtier.errors import ServiceUnavailable


def fetch_stats(socket_path: str | None = None, url: str | None = None,
                token: str | None = None) -> dict[str, Any]:
    if url:
        try:
            # (Request itself raises ValueError for a URL without a scheme or a broken one.)
            req = urllib.request.Request(url.rstrip("/") + "/v1/stats")
            if token:
                req.add_header("Authorization", f"Bearer {token}")
            with urllib.request.urlopen(req, timeout=10) as resp:
                return json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise ServiceUnavailable(f"cannot read {url}/v1/stats: {exc}") from None
    from kvtier.api.client import Client
    with Client(socket_path, timeout=10) as c:
        return c.stats()


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1023.95 or unit == "TiB":        # 1023.96 would print as 1024.0
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


# (row label, the tier dict's key, how to show it): one row per measure and one column per
# tier, so that the table fits an 80-column terminal with up to four tiers (hbm, host, nvme,
# remote): one column per measure did not (every header cut to three letters, issue 19).
ROWS: tuple[tuple[str, str, Any], ...] = (
    ("capacity", "capacity_bytes", _size), ("used", "used_bytes", _size),
    ("blocks", "blocks", str), ("hits", "hits", str), ("misses", "misses", str),
    ("promotions", "promotions", str), ("demotions", "demotions", str),
    ("evictions", "evictions", str), ("read", "bytes_read", _size),
    ("written", "bytes_written", _size),
)


def render(stats: dict[str, Any], console: Any = None) -> None:
    """Print the tiers as a table, one column per tier, then the service's totals; fits 80
    columns (numbers are never cut: a narrower terminal wraps the totals' lines only)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvtier tiers")
    tiers = stats["tiers"]
    table.add_column("", no_wrap=True, min_width=max(len(r[0]) for r in ROWS))
    for tier in tiers:
        table.add_column(tier, justify="right", no_wrap=True)
    for label, key, show in ROWS:
        table.add_row(label, *(show(d.get(key)) if d.get(key) is not None else "-"
                               for d in tiers.values()))
    console = console or Console()
    console.print(table)
    hr = stats.get("hit_ratio")
    console.print(f"hit ratio {'-' if hr is None else f'{hr:.3f}'}  gets {stats['gets']}  "
                  f"puts {stats['puts']}  leases {stats['leases']}")
    console.print(f"checksum failures {stats['checksum_failures']}  "
                  f"uptime {stats['uptime_s']:.0f} s")
    connectors = stats.get("connectors") or {}
    if connectors:
        # Like the tiers: one row per counter, one column per engine (80 columns).
        from kvtier.api.metrics import CONNECTOR_COUNTERS
        eng = Table(title="engine connectors")
        eng.add_column("", no_wrap=True)
        for engine in connectors:
            eng.add_column(engine, justify="right", no_wrap=True)
        for name in CONNECTOR_COUNTERS:
            eng.add_row(name, *(f"{c.get(name, 0):.3f}" if name == "seconds"
                                else str(int(c.get(name, 0))) for c in connectors.values()))
        console.print(eng)
