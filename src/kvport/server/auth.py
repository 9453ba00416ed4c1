"""Challenge-response authentication: the token never crosses the wire.

::

    server -> client   HELLO  {nonce: 32 random bytes, auth: "hmac-sha256"}
    client -> server   AUTH   {tenant: name, mac: HMAC-SHA256(token, "kvport.auth.v1" | nonce | tenant)}
    server -> client   OK {tenant}   or   ERROR(AuthError) and close

A fresh nonce per connection makes a recorded ``mac`` useless on another connection. The server
compares with :func:`hmac.compare_digest` and answers an unknown tenant exactly like a wrong token
(one message, same work), so the answer does not reveal which tenants exist. A tenant without a
token is accepted only with an empty ``mac``, and only a loopback server may have such tenants.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets

from kvport.server.tenants import Tenant, TenantTable

NONCE_BYTES = 32
MAC_BYTES = 32
_LABEL = b"kvport.auth.v1"
_DUMMY_TOKEN = secrets.token_bytes(32)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def compute_mac(token: bytes | None, nonce: bytes, tenant: str) -> bytes:
    """The client's answer to ``nonce``; empty when the tenant has no token."""
    if not token:
        return b""
    return hmac.new(token, _LABEL + nonce + tenant.encode(), hashlib.sha256).digest()


def verify(table: TenantTable, tenant: str, nonce: bytes, mac: bytes) -> Tenant | None:
    """The authenticated tenant, or None (unknown tenant, wrong or missing mac)."""
    t = table.get(tenant)
    token = t.token if t is not None else _DUMMY_TOKEN
    expected = compute_mac(token, nonce, tenant)
    ok = hmac.compare_digest(expected, mac) if expected else (mac == b"")
    return t if ok and t is not None else None


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and 'localhost'; anything else (0.0.0.0, a NIC) is beyond loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
