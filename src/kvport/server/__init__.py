"""The kvport server: the shared external KV tier, and its client (docs/server.md).

Server (``kvport serve``)::

    app        ServerConfig, KVServer (listen, accept, tick, graceful shutdown), serve()
    conn       one connection: state machine, handshake, deadlines, request loop
    handlers   one handler per message type (PUT, GET, LOOKUP, PIN, LEASE, STATS, ...)
    blocks     values as pages over HostTier + DiskTier, catalog, manifest
    catalog    what is stored where for whom; pins, leases, eviction plans (no I/O)
    manifest   disk blocks' owners, replayed on restart
    tenants    tenant table, per-tenant key salting, server secret
    auth       HMAC challenge-response
    limits     ServerLimits, Rejected(reason, retry_after)
    staging    reused buffers for values in flight to or from disk
    aio        asyncio byte streams (plain, TLS) and frame I/O over kvport.protocol.frame
    protocol   message fields and their checks
    stats      the STATS answer (``kvport inspect``)
    http       /metrics and /healthz
    metrics    the server's Prometheus collectors

Client: ``client.RemoteTier`` (a :class:`kvport.tiers.base.Tier`), ``pool.ClientConfig``.
"""
