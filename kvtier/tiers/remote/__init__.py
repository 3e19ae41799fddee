"""The shared remote tier: Redis or Valkey (single server, independent shards, or a Cluster)."""

from kvtier.tiers.remote.store import RemoteStore, RemoteTier

__all__ = ["RemoteStore", "RemoteTier"]
