"""The admin API's front door: an ASGI wrapper that refuses before FastAPI reads anything.

Three checks, in this order, on every HTTP request (issue 20, items 11, 12 and 14):

1. **Host.** Only an IP literal, ``localhost`` (or a ``*.localhost`` name, which browsers
   resolve to loopback themselves) or a name listed in ``admin_hosts`` is answered; anything
   else gets 421. A web page on a name whose DNS record is switched to 127.0.0.1 (DNS
   rebinding) sends its own name as Host, so it can no longer read /v1/clients (pids, uids),
   /v1/stats, /metrics or the page table. IP literals cannot be rebound.
2. **Token first.** A request that may change state (any method but GET, HEAD, OPTIONS) must
   carry exactly ``Authorization: Bearer <token>``, checked from the headers alone: a 200 MiB
   body without a token used to be read (and kept, +400 MB RSS) before the 401.
3. **Body cap.** Bodies are tiny JSON; one announced or sent beyond ``admin_max_body`` gets
   413 and is not buffered.

build_app's own token dependency uses the same comparison (``token_matches``), so the app keeps
its rules when it runs without this wrapper (tests drive it in process).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from typing import Any, Awaitable, Callable

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
_SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


def token_matches(authorization: str | None, token: str) -> bool:
    """The header is exactly 'Bearer <token>': no stripping, no case folding."""
    if not authorization or not token:
        return False
    return hmac.compare_digest(authorization.encode("utf-8", "surrogateescape"),
                               f"Bearer {token}".encode())


def host_allowed(host_header: str, extra: tuple[str, ...]) -> bool:
    """True for an IP literal, localhost names, or a name in ``extra`` (port ignored)."""
    host = host_header.strip().lower()
    if host.startswith("["):                       # [::1]:8787
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    if not host:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return host == "localhost" or host.endswith(".localhost") or host in extra


class AdminGuard:
    """Wrap an ASGI app with the checks of the module docstring."""

    def __init__(self, app: ASGIApp, token: str, max_body: int,
                 extra_hosts: tuple[str, ...] = ()) -> None:
        self.app = app
        self.token = token
        self.max_body = max_body
        self.extra_hosts = tuple(h.strip().lower() for h in extra_hosts if h.strip())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        host = headers.get("host", "")
        if not host_allowed(host, self.extra_hosts):
            await _reply(send, 421, f"Host {host!r} is not one this service answers to (a guard "
                                    "against DNS rebinding); use 127.0.0.1 or localhost, or add "
                                    "the name to admin_hosts")
            return
        if scope["method"] not in _SAFE_METHODS and not token_matches(
                headers.get("authorization"), self.token):
            await _reply(send, 401, "missing or wrong bearer token; see admin_token or "
                                    "<data_dir>/admin.token", {"www-authenticate": "Bearer"})
            return
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            await _reply(send, 413, self._too_large(length))
            return
        body, more = b"", True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > self.max_body:
                await _reply(send, 413, self._too_large(f"more than {self.max_body}"))
                return
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return await receive()             # the app waits for the disconnect
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _too_large(self, length: str) -> str:
        return (f"request body of {length} bytes exceeds admin_max_body ({self.max_body}); the "
                "admin API takes small JSON bodies")


async def _reply(send: Send, status: int, detail: str, extra: dict[str, str] | None = None
                 ) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
