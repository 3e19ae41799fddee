"""The `kvtier` command: serve | stats | config (and the bench, replay and check tools).

Every setting of kvtier.config.SETTINGS is a flag of `kvtier serve` (--host-capacity 4GiB ...),
an entry of the TOML file given with --config, and a KVTIER_* variable. Errors in any of them
print one line naming the setting and exit with status 2; nothing is started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from typing import Any

from kvtier.config import SETTINGS, Settings, load, markdown_table
from kvtier.errors import ConfigError, KvtierError

log = logging.getLogger("kvtier")


def _add_setting_flags(p: argparse.ArgumentParser) -> None:
    for s in SETTINGS:
        unit = f" [{s.unit}]" if s.unit else ""
        p.add_argument(f"--{s.name.replace('_', '-')}", dest=s.name, default=None,
                       help=f"{s.help}{unit} (default: {s.default!r})")


def _overrides(ns: argparse.Namespace) -> dict[str, Any]:
    return {s.name: getattr(ns, s.name) for s in SETTINGS if getattr(ns, s.name) is not None}


def cmd_serve(args: argparse.Namespace) -> int:
    settings = load(args.config, overrides=_overrides(args))
    os.umask(0o077)      # whatever the service creates is its user's alone (issue 20, item 13)
    _lock_data_dir(settings)
    _raise_fd_limit()
    from kvtier.memory import tune_malloc
    tune_malloc()
    try:
        import uvloop       # libuv's loop: a socket round trip costs about half of asyncio's
    except ImportError:
        return asyncio.run(_serve(settings))
    return uvloop.run(_serve(settings))


_DATA_DIR_LOCK: list[int] = []      # the lock's fd, held open for the life of the process


def _lock_data_dir(settings: Settings) -> None:
    """One `kvtier serve` per data directory (see lock_data_dir); held for the process's life."""
    from pathlib import Path

    from kvtier.pagetable.store import check_writable, lock_data_dir
    path = Path(settings.data_dir)
    check_writable(path)
    _DATA_DIR_LOCK.append(lock_data_dir(path, "kvtier serve"))


def _raise_fd_limit() -> None:
    """Each namespace holds about 3 fds (memfd, segments): take the hard limit, as servers do,
    so that max_namespaces is reached before EMFILE."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def _serve(settings: Settings) -> int:
    from kvtier.api.server import Server
    from kvtier.coherence.engine import Engine
    from kvtier.memory import shmem_huge_pages
    from kvtier.tiers.hbm import hbm_pool_factory

    loop = asyncio.get_running_loop()
    factory, hbm_note = hbm_pool_factory(settings)
    admin = None
    if settings.admin:
        from kvtier.api.admin import AdminServer, check_admin_binding
        check_admin_binding(settings)         # refuse before anything is opened
    engine = await loop.run_in_executor(None, lambda: Engine(settings, hbm_pool_factory=factory))
    metrics = None
    if settings.admin:
        from kvtier.api.metrics import Metrics
        metrics = Metrics()
    server = Server(engine, settings, on_op=metrics.observe if metrics else None)
    try:
        await server.start()
    except BaseException as exc:
        # Not server.stop(): the socket path may be another service's (it refused to start
        # over a live one), and stop() removes it.
        await loop.run_in_executor(None, engine.close)
        if isinstance(exc, OSError):
            raise ConfigError(f"cannot listen on {server.path}: {exc.strerror or exc}; "
                              "choose another --socket path") from None
        raise
    if settings.admin:
        try:
            admin = AdminServer(engine, server, settings, metrics)
            await admin.start()
        except BaseException:
            await server.stop()        # closes the engine and removes this service's socket
            raise
    print(f"kvtier: socket {server.path}", flush=True)
    print(f"kvtier: admin {admin.url if admin else 'disabled'}", flush=True)
    if hbm_note:
        print(f"kvtier: {hbm_note}", flush=True)
    for name, why in engine.catalog.damaged.items():
        print(f"kvtier: warning: namespace record {name!r} in {engine.catalog.path} is damaged "
              f"({why}) and was skipped; stop the service and run `kvtier check --repair "
              f"--data-dir {settings.data_dir}` to quarantine it", flush=True)
    thp = shmem_huge_pages()
    if thp in ("never", "deny"):
        print(f"kvtier: note: the host tier is in 4 KiB pages (shmem_enabled is {thp}); with "
              "'advise' workers copy out of 2 MiB pages (gets 6-11% faster on the dev VM; README: "
              "Tuning)", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("kvtier: stopping: flushing dirty blocks", flush=True)
    if admin is not None:
        await admin.stop()
    await server.stop()
    print("kvtier: stopped", flush=True)
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from kvtier.api.stats_view import fetch_stats, render
    stats = fetch_stats(socket_path=args.socket, url=args.url, token=args.token)
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
    else:
        render(stats)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    if args.markdown:
        print(markdown_table())
        return 0
    settings = load(args.config, overrides=_overrides(args))
    print(json.dumps(settings.as_dict(), indent=2, default=list))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier", description="KV-cache tiering service")
    p.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run the service in the foreground")
    s.add_argument("--config", help="TOML file of settings")
    _add_setting_flags(s)
    s.set_defaults(fn=cmd_serve)

    st = sub.add_parser("stats", help="tier statistics from a running service")
    st.add_argument("--socket", help="Unix socket (default: $KVTIER_SOCKET or the default)")
    st.add_argument("--url", help="admin URL instead of the socket, e.g. http://127.0.0.1:8787")
    st.add_argument("--token", help="admin token (not needed for reading stats)")
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=cmd_stats)

    c = sub.add_parser("config", help="print the effective settings, or the settings table")
    c.add_argument("--config", help="TOML file of settings")
    c.add_argument("--markdown", action="store_true", help="the README's settings table")
    _add_setting_flags(c)
    c.set_defaults(fn=cmd_config)

    for name, (_module, helptext) in TOOLS.items():
        sub.add_parser(name, help=helptext, add_help=False)
    return p


# Tools with their own argument parsers: `kvtier NAME ...` hands the rest of argv to them.
TOOLS = {"replay": ("kvtier.replay", "replay a Mooncake trace through the engine"),
         "bench": ("kvtier.fio", "fio-style benchmark of a tier (fio's options and job files)"),
         "check": ("kvtier.check", "offline consistency check of a data directory")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in TOOLS:
        import importlib
        try:
            return int(importlib.import_module(TOOLS[argv[0]][0]).main(argv[1:]) or 0)
        except KvtierError as exc:
            print(f"kvtier {argv[0]}: error: {exc}", file=sys.stderr)
            return 2
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.fn(args) or 0)
    except KvtierError as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
