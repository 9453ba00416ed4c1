"""The client of a kvport server, and the store port every engine reaches storage through.

::

    conn     ClientConfig, ServerConn (handshake, one typed request at a time), ConnPool
    remote   RemoteTier: the server as a Tier (put_block forwards parent / lifetime / TTL), plus
             lookup (RemoteLookup), pin, lease, owners, leaks, stats for callers that know they talk
             to a server
    port     StoreConfig and open_store(): the one TieredStore an engine uses (host, disk, Redis, the
             server as tiers, top down)
    redis_pool   PoolBook: the pool's records kept in Redis / Redis Cluster beside the values (own
             records read from each value's head, leases and pins with native TTLs, owners, leaks)
             when no kvport server holds them

It sits above ``protocol`` and ``store`` (whoever builds a store passes a RemoteTier in; the store
never imports it) and below the engines, the demo and the CLI.
"""

from kvport.client.conn import ClientConfig, ConnPool, ServerConn
from kvport.client.remote import RemoteLookup, RemoteTier, Stored

__all__ = ["ClientConfig", "ConnPool", "RemoteLookup", "RemoteTier", "ServerConn", "Stored"]
