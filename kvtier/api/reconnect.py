"""What a client does when its connection to `kvtier serve` is lost (the service stopped or
restarted): which ops may be sent again on a new connection, which error says a put may or may
not have been stored, and how a connection the service has closed is noticed before a call.
Shared by kvtier.api.client and kvtier.api.aclient."""

from __future__ import annotations

import select
from typing import Any

from kvtier.errors import PutOutcomeUnknown, ServiceUnavailable

# Ops that a connection lost mid-call retries once on a new one: their reply does not depend
# on the lost connection (its leases, reservations or mapping of the old service) and sending
# them twice changes nothing. Not retried: a mapped get (its slots would index the caller's
# mapping of the old service; an inline get is retried), reserve, commit, abort and release
# (they act on the old connection's state), put (it may have been stored), delete and flush
# (a repeat would report 0 for what the first did).
RETRY_SAFE = frozenset({"hello", "stats", "match_prefix", "ns_open", "ns_create"})
PUT_OPS = frozenset({"put", "commit"})


def retry_safe(op: str, args: dict[str, Any]) -> bool:
    return op in RETRY_SAFE or (op == "get" and bool(args.get("inline")))


def connection_lost(path: str, why: str, puts: int) -> ServiceUnavailable:
    """The error for a lost connection: PutOutcomeUnknown when puts were unanswered."""
    if puts:
        return PutOutcomeUnknown(
            f"kvtier at {path} went away ({why}) after {puts} put request(s) were sent and "
            "before their replies: those blocks may or may not be stored. Check with "
            "match_prefix or get, or put them again; the next call reconnects")
    return ServiceUnavailable(f"kvtier at {path} went away ({why}); the next call reconnects")


def hung_up(poll: Any) -> bool:
    """True when the service has closed the connection whose socket is registered on poll:
    one poll(0), about a microsecond (a closed AF_UNIX peer shows as POLLHUP on Linux). How a
    call notices a restart before it uses a namespace's mapping of the old service."""
    return any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL)
               for _fd, ev in poll.poll(0))
