"""Addresses of a decode engine's inbox (:mod:`kvport.engines.vllm.stream`): a transfer link's
address (:mod:`kvport.transfer.links`: ``HOST:PORT`` for TCP, ``shm:NAME`` for shared memory on this
host). The config and the proxy check them without importing the rest of the stream."""

from __future__ import annotations

from kvport.transfer.links import SHM_PREFIX
from kvport.transfer.links import parse_address as parse_dest

DEST_KEY = "kvport_dest"  # a prefill request's kv_transfer_params: its decode engine's inbox (set by the proxy)

__all__ = ["DEST_KEY", "SHM_PREFIX", "parse_dest"]
