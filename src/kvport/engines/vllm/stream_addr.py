"""Addresses of a decode engine's inbox (:mod:`kvport.engines.vllm.stream`): ``HOST:PORT`` (TCP) or
``shm:NAME`` (shared memory on this host: an abstract Unix socket names the rings). No imports
beyond the standard library: the config and the proxy check them."""

from __future__ import annotations

import re

DEST_KEY = "kvport_dest"  # a prefill request's kv_transfer_params: its decode engine's inbox (set by the proxy)
SHM_PREFIX = "shm:"
_SHM_NAME = re.compile(r"[A-Za-z0-9._-]{1,100}")


def parse_dest(value: object) -> str | None:
    """``value`` when it is an inbox address (``HOST:PORT`` or ``shm:NAME``), else None."""
    if not isinstance(value, str) or len(value) > 300:
        return None
    if value.startswith(SHM_PREFIX):
        return value if _SHM_NAME.fullmatch(value[len(SHM_PREFIX):]) else None
    host, sep, port = value.rpartition(":")
    return value if sep and host and port.isdigit() and 0 < int(port) < 65536 else None


__all__ = ["DEST_KEY", "SHM_PREFIX", "parse_dest"]
