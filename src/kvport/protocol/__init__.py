"""The protocol layer: how kvport peers talk, below both ``transfer/`` and ``server/`` (and ``client/``).

Modules, bottom to top (only the shells do I/O)::

    frame       the frame codec: 40-byte header, msgpack metadata, checksummed chunks; Limits, MsgType
                (pure, no I/O; docs/wire-format.md is the byte-level reference)
    schema      typed messages <-> msgpack maps, every field type- and cap-checked
    rejects     Rejected(reason, retry_after): backpressure as a value, for every protocol
    errors      one error mapping: exception <-> ERROR/REFUSE/ABORT metadata
    fields      field checks for the few hand-written maps (handshake)
    handshake   the one mutual HMAC handshake (shared secret or tenant token)
    transfer    the KV-transfer protocol's messages and TransferMeta
    server      the shared-tier protocol's requests and answers
    transport   the blocking byte-stream interface (Transport) and iovec helpers
    net         blocking sockets (plain / TLS) as transports, is_loopback, tune
    sync        FrameIO: frames over a Transport (blocking shell)
    aio         AsyncFrames over SockStream / TlsStream, bulk I/O threads (asyncio shell)
"""
