"""kvtier: a KV-cache tiering service for LLM inference (HBM, pinned host memory, NVMe, Redis).

The client library is re-exported here: ``kvtier.Client`` and ``kvtier.AsyncClient``.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Client", "AsyncClient", "__version__"]


def __getattr__(name: str):
    # Lazy, so that importing kvtier for the engine does not import the socket client.
    if name == "Client":
        from kvtier.api.client import Client
        return Client
    if name == "AsyncClient":
        from kvtier.api.aclient import AsyncClient
        return AsyncClient
    raise AttributeError(name)
