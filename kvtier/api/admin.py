"""The admin REST API (FastAPI), served by uvicorn inside the service's event loop.

Read endpoints need no token; the two mutations (POST /v1/flush, POST /v1/evict) need
exactly ``Authorization: Bearer <admin_token>``. In the service the app runs behind
api.admin_guard: forged Host headers (DNS rebinding), unauthenticated mutations and oversized
bodies are refused there, before any body is read. Without a configured token the service binds loopback
only and writes a random token to <data_dir>/admin.token (mode 0600); binding another address
without a token is refused at start. The app is a thin façade: every number comes from
Engine.stats(), the server's client table or the Metrics object.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import os
import secrets
import time
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, Field

from kvtier.api.admin_guard import AdminGuard, token_matches
from kvtier.api.metrics import Metrics
from kvtier.config import Settings, parse_hostport
from kvtier.errors import ConfigError, KvtierError, NamespaceError
from kvtier.types import Tier

HISTORY_S = 300
NOT_FOUND = {"description": "no such namespace, block or asset"}
UNAUTHORIZED = {"description": "missing or wrong bearer token"}


def _is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_admin_binding(settings: Settings) -> None:
    host, _port = parse_hostport(settings.admin)
    if not _is_loopback(host) and not settings.admin_token:
        raise ConfigError(f"admin would listen on {host}, beyond loopback, with no admin_token; "
                          "set admin_token (or KVTIER_ADMIN_TOKEN), or bind 127.0.0.1")


def admin_token(settings: Settings) -> str:
    """The configured token, or one generated into <data_dir>/admin.token."""
    if settings.admin_token:
        return settings.admin_token
    path = Path(settings.data_dir) / "admin.token"
    if path.exists() and not path.is_symlink():
        try:
            token = path.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not text"
            raise ConfigError(f"cannot read the admin token {path}: {why}; remove it (a new "
                              "one is written) or set admin_token") from None
        if token:
            if not token.isprintable() or any(c.isspace() for c in token):
                raise ConfigError(f"the admin token in {path} holds spaces or control "
                                  "characters (no Authorization header can carry it); remove "
                                  "the file (a new one is written) or set admin_token")
            return token
    token = secrets.token_urlsafe(24)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror}; set admin_token instead") from None
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    return token


class EvictRequest(BaseModel):
    tier: Literal["hbm", "host", "nvme"] = Field("host", description="the tier to evict from")
    count: int = Field(1, ge=1, le=1 << 31, description="copies to evict at most")
    namespace: str | None = Field(None, description="only this namespace; all when omitted")


class FlushRequest(BaseModel):
    namespace: str | None = Field(None, description="only this namespace; all when omitted")


class History:
    """One sample a second of the figures the dashboard charts, HISTORY_S seconds deep."""

    def __init__(self) -> None:
        self.samples: collections.deque = collections.deque(maxlen=HISTORY_S)
        self._last: dict[str, Any] | None = None

    def add(self, stats: dict[str, Any]) -> None:
        now = time.time()
        point: dict[str, Any] = {"t": now, "tiers": {}}
        prev = self._last
        dt = (now - prev["t"]) if prev else 0.0
        gets, hits = stats["gets"], stats["get_hits"]
        point["hit_ratio"] = None
        if prev and dt > 0:
            dg = gets - prev["gets"]
            point["hit_ratio"] = (hits - prev["get_hits"]) / dg if dg > 0 else None
        for tier, d in stats["tiers"].items():
            entry = {"used_bytes": d.get("used_bytes", 0), "capacity_bytes": d["capacity_bytes"],
                     "read_bps": 0.0, "write_bps": 0.0}
            if prev and dt > 0 and tier in prev["tiers"]:
                p = prev["tiers"][tier]
                entry["read_bps"] = max(0.0, (d["bytes_read"] - p["bytes_read"]) / dt)
                entry["write_bps"] = max(0.0, (d["bytes_written"] - p["bytes_written"]) / dt)
            point["tiers"][tier] = entry
        self._last = {"t": now, "gets": gets, "get_hits": hits,
                      "tiers": {t: {"bytes_read": d["bytes_read"],
                                    "bytes_written": d["bytes_written"]}
                                for t, d in stats["tiers"].items()}}
        self.samples.append(point)

    def current(self) -> dict[str, Any]:
        return self.samples[-1] if self.samples else {"tiers": {}}


def build_app(engine: Any, server: Any, settings: Settings, metrics: Metrics,
              history: History, token: str, ready: asyncio.Event | None = None) -> FastAPI:
    app = FastAPI(title="kvtier admin", version="1", description=__doc__)

    async def run(fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def need_token(authorization: str | None = Header(None)) -> None:
        if not token_matches(authorization, token):
            raise HTTPException(401, "missing or wrong bearer token; see admin_token or "
                                     "<data_dir>/admin.token",
                                headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Any, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes the raw input and fails (500) on a body that is not
        # UTF-8; garbage must get a 422 like any other bad request.
        errors = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")),
                   "type": str(e.get("type", ""))} for e in exc.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(KvtierError)
    async def kvtier_error(_request: Any, exc: KvtierError) -> JSONResponse:
        status = 404 if isinstance(exc, NamespaceError) else 400
        return JSONResponse({"detail": str(exc), "code": exc.code}, status_code=status)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {"description": "warm-up not finished"}})
    async def readyz() -> JSONResponse:
        ok = ready is None or ready.is_set()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        s = await run(server.stats)
        cur = history.current()["tiers"]
        lat = metrics.latency()
        for tier, d in s["tiers"].items():
            d["read_bps"] = cur.get(tier, {}).get("read_bps", 0.0)
            d["write_bps"] = cur.get(tier, {}).get("write_bps", 0.0)
        s["ops"] = lat
        s["clients"] = len(server.clients)
        return s

    @app.get("/v1/history")
    async def hist() -> dict[str, Any]:
        return {"samples": list(history.samples), "latency_histogram": metrics.histogram()}

    @app.get("/v1/namespaces")
    async def namespaces() -> list[dict[str, Any]]:
        return [ns.info() for ns in list(engine.namespaces.values())]

    @app.get("/v1/blocks/{namespace:path}/{key_hex}", responses={404: NOT_FOUND})
    async def block(namespace: str, key_hex: str = PathParam(
            ..., pattern="^([0-9a-fA-F]{2}){1,64}$",
            description="the key in hex, key_width bytes")) -> dict[str, Any]:
        ns = engine.namespaces.get(namespace)
        key = bytes.fromhex(key_hex)
        if ns is None or len(key) != ns.key_width:
            raise HTTPException(404, f"no namespace {namespace!r}, or not a {namespace!r} key "
                                     "(wrong width)")
        entry = await run(engine.entry, namespace, key)
        if entry is None:
            raise HTTPException(404, "no such block")
        return entry

    @app.get("/v1/clients")
    async def clients() -> list[dict[str, Any]]:
        rows = [c.summary() for c in list(server.clients.values())]
        return sorted(rows, key=lambda r: -r["load_weight"])

    @app.post("/v1/flush", dependencies=[Depends(need_token)],
              responses={401: UNAUTHORIZED, 404: NOT_FOUND})
    async def flush(req: FlushRequest | None = None) -> dict[str, int]:
        ns = req.namespace if req else None
        return {"flushed": await run(engine.flush, ns)}

    @app.post("/v1/evict", dependencies=[Depends(need_token)],
              responses={401: UNAUTHORIZED, 404: NOT_FOUND})
    async def evict(req: EvictRequest) -> dict[str, int]:
        tier = Tier.parse(req.tier)
        return {"evicted": await run(engine.evict, tier, req.count, req.namespace)}

    @app.get("/metrics", response_class=Response, responses={200: {
        "content": {"text/plain; version=0.0.4; charset=utf-8": {}},
        "description": "Prometheus text exposition"}})
    async def prometheus() -> Response:
        body = await run(metrics.exposition)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(_asset("dashboard.html"))

    @app.get("/static/{name}", response_class=Response, responses={404: NOT_FOUND, 200: {
        "content": {"text/javascript": {}, "text/css": {}}, "description": "dashboard asset"}})
    async def static(name: str) -> Response:
        if name not in ("dashboard.js", "dashboard.css"):
            raise HTTPException(404, "no such asset")
        kind = "text/javascript" if name.endswith(".js") else "text/css"
        return Response(_asset(name), media_type=kind)

    return app


def _asset(name: str) -> str:
    return resources.files("kvtier.api").joinpath("static", name).read_text()


class AdminServer:
    """uvicorn inside the running loop, plus the once-a-second history sampler."""

    def __init__(self, engine: Any, server: Any, settings: Settings, metrics: Metrics) -> None:
        self.host, self.port = parse_hostport(settings.admin)
        self.token = admin_token(settings)
        self.engine = engine
        self.metrics = metrics
        self.history = History()
        self.ready = asyncio.Event()
        metrics.bind(server.stats)
        self.app = build_app(engine, server, settings, metrics, self.history, self.token,
                             self.ready)
        guarded = AdminGuard(self.app, self.token, settings.admin_max_body,
                             tuple(settings.admin_hosts.split(",")))
        cfg = uvicorn.Config(guarded, host=self.host, port=self.port, log_level="warning",
                             lifespan="off", access_log=False)
        self._uv = uvicorn.Server(cfg)
        self._uv.install_signal_handlers = lambda: None   # the service owns SIGTERM/SIGINT
        self._tasks: list[asyncio.Task] = []

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def _serve(self) -> None:
        try:
            await self._uv.serve()
        except SystemExit:
            # uvicorn reports a bind failure by sys.exit() from inside serve(); let through,
            # it would end the event loop with a traceback before start() could say why.
            pass

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._serve()))
        while not self._uv.started:
            if self._tasks[0].done():
                raise ConfigError(f"admin API could not listen on {self.url} (address in use?); "
                                  "choose another with --admin HOST:PORT")
            await asyncio.sleep(0.02)
        self._tasks.append(loop.create_task(self._sample()))
        self.ready.set()

    async def _sample(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.history.add(await loop.run_in_executor(None, self.engine.stats))
            await asyncio.sleep(1.0)

    async def stop(self) -> None:
        self._uv.should_exit = True
        for t in self._tasks[1:]:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
