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
        req = urllib.request.Request(url.rstrip("/") + "/v1/stats")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
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
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def render(stats: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvtier tiers")
    cols = ("tier", "capacity", "used", "blocks", "hits", "misses", "promotions", "demotions",
            "evictions", "read", "written")
    for c in cols:
        table.add_column(c, justify="left" if c == "tier" else "right")
    for tier, d in stats["tiers"].items():
        table.add_row(tier, _size(d.get("capacity_bytes")), _size(d.get("used_bytes")),
                      str(d.get("blocks", 0)), str(d["hits"]), str(d["misses"]),
                      str(d["promotions"]), str(d["demotions"]), str(d["evictions"]),
                      _size(d["bytes_read"]), _size(d["bytes_written"]))
    console = Console()
    console.print(table)
    hr = stats.get("hit_ratio")
    console.print(f"hit ratio {'-' if hr is None else f'{hr:.3f}'}  gets {stats['gets']}  "
                  f"puts {stats['puts']}  checksum failures {stats['checksum_failures']}  "
                  f"leases {stats['leases']}  uptime {stats['uptime_s']:.0f} s")
