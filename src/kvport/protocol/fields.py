"""The shared-tier protocol: which frames, which metadata, on top of :mod:`kvport.protocol.frame`.

Every request is one frame; its answer is one frame of the same ``msg_type`` with
``Flags.RESPONSE`` and the request's ``corr_id`` (``Flags.ERROR`` for an error, meta
``{"error": class name, "message": ...}``). Keys on the wire are the client's 16-byte block keys;
the server salts them per tenant and never returns storage keys.

========================  ==========================================  =====================================
request (meta; payload)   answer meta (payload)                       notes
========================  ==========================================  =====================================
AUTH_CHALLENGE (server)   {nonce, page_bytes, max_value_bytes, auth}  first frame on every connection
AUTH_RESPONSE             AUTH_OK {tenant}                            see :mod:`kvport.server.auth`
PUT {key, pin?}; value    {status: "stored"|"exists"} |               chunk_size must be page_bytes;
                          {rejected, retry_after, detail}             visible only after every checksum
GET {key}                 {found: true, length}; value | {found: f}   the read holds a lease
LOOKUP {keys, lease_s?}   {hits: n, lease: id|None}                   longest present prefix of keys
CONTAINS {keys}           {present: [bool]}
PIN / UNPIN {keys}        {count}                                     pins survive the connection
LEASE {keys, ttl_s}       {lease, held}                               released on RELEASE, expiry or close
RELEASE {lease}           {}
DELETE {keys}             {deleted}                                   pinned / leased blocks stay
STATS {}                  usage, tenants, top prefixes, pins, leases  admin sees all tenants
PING {}                   {}
========================  ==========================================  =====================================
"""

from __future__ import annotations

from typing import Any

from kvport.errors import ProtocolError
from kvport.keys import KEY_BYTES


def key_field(meta: dict[str, Any], name: str = "key") -> bytes:
    k = meta.get(name)
    if not isinstance(k, bytes) or len(k) != KEY_BYTES:
        raise ProtocolError(f"'{name}' must be {KEY_BYTES} bytes")
    return k


def keys_field(meta: dict[str, Any], cap: int, name: str = "keys") -> list[bytes]:
    ks = meta.get(name)
    if not isinstance(ks, list) or len(ks) > cap:
        raise ProtocolError(f"'{name}' must be a list of at most {cap} keys")
    for k in ks:
        if not isinstance(k, bytes) or len(k) != KEY_BYTES:
            raise ProtocolError(f"every key in '{name}' must be {KEY_BYTES} bytes")
    return ks


def float_field(meta: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = meta.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise ProtocolError(f"'{name}' must be a number in [{lo}, {hi}]")
    return float(v)


def int_field(meta: dict[str, Any], name: str) -> int:
    v = meta.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ProtocolError(f"'{name}' must be a non-negative integer")
    return v


def str_field(meta: dict[str, Any], name: str, max_len: int = 64) -> str:
    v = meta.get(name)
    if not isinstance(v, str) or not 0 < len(v) <= max_len:
        raise ProtocolError(f"'{name}' must be a string of 1-{max_len} characters")
    return v


def bytes_field(meta: dict[str, Any], name: str, max_len: int) -> bytes:
    v = meta.get(name, b"")
    if not isinstance(v, bytes) or len(v) > max_len:
        raise ProtocolError(f"'{name}' must be at most {max_len} bytes")
    return v
