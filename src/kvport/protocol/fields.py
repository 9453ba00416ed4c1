"""Field checks for the few metadata maps written by hand instead of through :mod:`kvport.protocol.schema`.

The handshake (:mod:`kvport.protocol.handshake`) reads its maps with ``str_field`` and
``bytes_field``: each field type- and length-checked, a bad one a :class:`~kvport.errors.ProtocolError`
that names it (``key_field``, ``keys_field``, ``float_field`` and ``int_field`` have no caller
today). Every other message is typed; the shared-tier protocol's table of requests and answers is
in :mod:`kvport.protocol.server`.
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
