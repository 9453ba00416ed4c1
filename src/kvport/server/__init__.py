"""The kvport server (``kvport serve``): the shared external KV tier (docs/server.md).

Modules, top to bottom (import-linter keeps ``state`` below ``connection``, ``handlers`` and ``reports``)::

    app         ServerConfig, KVServer (listen, accept, tick, graceful shutdown), serve()
    handlers    Handlers: one method per typed request (PUT, GET, LOOKUP, PIN, LEASE, STATS, ...)
    connection  one connection: state machine, handshake, deadlines, request loop
    reports     what ``kvport inspect`` shows (STATS, OWNERS, LEAKS), built from the store and the ledger
    state       ServerState: store, ledger, tenants, limits, metrics, held tally, admission, hit counts,
                draining; what connections, handlers and reports share
    storage     open_storage(): one TieredStore (host pages + disk) and its ledger; Attrs kept per block
    admission   who may hold a connection: a cap on all, on those still logging in, and per peer
    held        leases and pins charged before they are recorded: per connection, per tenant, in bytes
    tenants     tenant table, per-tenant key salting, the server secret
    limits      ServerLimits: every byte a peer can make the server hold, bounded before it is allocated
    staging     StagingPool: reused buffers for values in flight to or from disk
    http        /metrics and /healthz
    metrics     the server's Prometheus collectors

Its client is :mod:`kvport.client` (``RemoteTier``, a :class:`kvport.tiers.base.Tier`); its wire is
:mod:`kvport.protocol` (``protocol.server``: the requests and answers; ``protocol.aio``: the asyncio
streams and frame I/O).
"""
