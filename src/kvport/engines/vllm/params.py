"""The ``kv_transfer_params`` of a prefill/decode hand-off, typed: what the proxy asks a prefill engine
for, and what the prefill engine answers. No vLLM import: the proxy and the config read it too.

On the wire (JSON, carried by vLLM and the proxy; byte for byte what kvport has always sent)::

    proxy   -> prefill   HandoffAsk     {"do_remote_decode": true, "kvport_dest": "HOST:PORT" | "shm:NAME"}
                                        (``kvport_dest`` only when the decode engine has an inbox)
    prefill -> decode    HandoffAnswer  {"do_remote_prefill": true, "do_remote_decode": false,
                                         "kvport": {"v": 1, "tokens": N, "last_key": HEX | null,
                                                    "spec": {KVSpec.as_dict()}, "engine": "ROLE:ID",
                                                    "lease_s": SECONDS | null, "stream": 32 HEX | null}}

Each has ``to_params()`` and one ``parse()``, which returns the value or raises a
:class:`~kvport.errors.HandoffParamsError` that says what is wrong: never sent
(:class:`~kvport.errors.HandoffNotSentError`: no hand-off asked, or none in the params), another
version (:class:`~kvport.errors.HandoffVersionError`) or unreadable
(:class:`~kvport.errors.HandoffUnreadableError`: a field missing, of the wrong type or past its cap).
Every length is capped before anything is built from it: these come from a client's request body.
"""

from __future__ import annotations

import math
import re
import secrets
from dataclasses import dataclass
from typing import Any

from kvport.errors import HandoffNotSentError, HandoffUnreadableError, HandoffVersionError, KVPortError
from kvport.keys import key_from_hex
from kvport.spec import KVSpec
from kvport.transfer.links import parse_address as parse_dest

DEST_KEY = "kvport_dest"  # a prefill request's kv_transfer_params: its decode engine's inbox (set by the proxy)
PD_KEY = "kvport"  # our field in the prefill engine's answer
PD_VERSION = 1
MAX_TOKENS = 1 << 24  # tokens one hand-off carries (16 Mi: far above any context vLLM serves)
MAX_ENGINE_CHARS = 256  # "kv_producer:ENGINE_ID"
MAX_SPEC_FIELDS = 64  # KVSpec has ~20
MAX_LEASE_S = 7 * 86400.0
_STREAM_ID = re.compile(r"[0-9a-f]{32}")


MAX_RANKS = 64  # decode ranks a hand-off names inboxes for


def parse_dests(value: object) -> tuple[str, ...] | None:
    """The inboxes a ``kvport_dest`` (or ``kvport_pd_inbox``) names, one per tensor-parallel rank of the
    decode engine, comma-separated (``HOST:PORT``, ``shm:NAME`` or ``nixl:HOST:PORT`` each; one at TP 1),
    or None when it is not that."""
    if not isinstance(value, str) or not value or len(value) > MAX_RANKS * 301:
        return None
    parts = tuple(value.split(","))
    if len(parts) > MAX_RANKS or any(parse_dest(p) is None for p in parts):
        return None
    return parts


def new_stream_id() -> str:
    """A fresh, single-use stream id: 32 lowercase hex digits."""
    return secrets.token_hex(16)


def is_stream_id(value: object) -> bool:
    return isinstance(value, str) and _STREAM_ID.fullmatch(value) is not None


@dataclass(frozen=True, slots=True)
class HandoffAsk:
    """The proxy -> prefill engine ask: compute the prompt and hand its KV off, streamed to ``dest``
    (a decode engine's inbox; at TP > 1 one per rank, comma-separated: :func:`parse_dests`) when
    given, else through the store."""

    dest: str | None = None

    def __post_init__(self) -> None:
        if self.dest is not None and parse_dests(self.dest) is None:
            raise HandoffUnreadableError(f"{DEST_KEY} is HOST:PORT, shm:NAME or nixl:HOST:PORT (one per rank, "
                                         f"comma-separated), got {self.dest[:300]!r}")

    @property
    def dests(self) -> tuple[str, ...]:
        """The inboxes, in decode rank order (none: through the store)."""
        return () if self.dest is None else parse_dests(self.dest) or ()

    def to_params(self) -> dict[str, Any]:
        out: dict[str, Any] = {"do_remote_decode": True}
        if self.dest is not None:
            out[DEST_KEY] = self.dest
        return out

    @classmethod
    def parse(cls, params: object) -> HandoffAsk:
        """The ask in a request's ``kv_transfer_params``. HandoffNotSentError: no hand-off asked
        (``do_remote_decode`` not set); HandoffUnreadableError: asked, with a ``kvport_dest`` that is
        not an address (the hand-off may still go through the store)."""
        if not isinstance(params, dict) or not params.get("do_remote_decode"):
            raise HandoffNotSentError("no hand-off asked (do_remote_decode not set)")
        dest = params.get(DEST_KEY)
        if dest is None:
            return cls()
        if parse_dests(dest) is None:
            shown = dest[:64] if isinstance(dest, str) else type(dest).__name__
            raise HandoffUnreadableError(f"{DEST_KEY} is HOST:PORT, shm:NAME or nixl:HOST:PORT (one per rank, "
                                         f"comma-separated), got {shown!r}")
        return cls(dest)


@dataclass(frozen=True, slots=True)
class HandoffAnswer:
    """The prefill engine's answer: ``tokens`` of the prompt handed off (whole blocks), the last
    block's key, the sender's KVSpec (checked field by field by the decode engine), the sending
    engine, how long the shared tier holds the blocks leased for the decode engine (None: not
    leased there) and the stream they went out in (None: through the store)."""

    tokens: int
    last_key: str | None
    spec: KVSpec
    engine: str
    lease_s: float | None = None
    stream: str | None = None

    def to_params(self) -> dict[str, Any]:
        return {"do_remote_prefill": True, "do_remote_decode": False,
                PD_KEY: {"v": PD_VERSION, "tokens": self.tokens, "last_key": self.last_key,
                         "spec": self.spec.as_dict(), "engine": self.engine, "lease_s": self.lease_s,
                         "stream": self.stream}}

    @classmethod
    def parse(cls, params: object) -> HandoffAnswer:
        """The answer in a decode request's ``kv_transfer_params``; raises what is wrong with it."""
        kv = params.get(PD_KEY) if isinstance(params, dict) else None
        if not isinstance(kv, dict):
            raise HandoffNotSentError("do_remote_prefill without kvport's hand-off (the KV was never sent)")
        v = kv.get("v")
        if isinstance(v, bool) or v != PD_VERSION:
            shown = v if isinstance(v, int) else type(v).__name__
            raise HandoffVersionError(f"a kvport hand-off of version {shown!r}; this engine reads version "
                                      f"{PD_VERSION} (the KV was never sent in a form it reads)")
        try:
            return cls(tokens=_tokens(kv), last_key=_last_key(kv), spec=_spec(kv), engine=_engine(kv),
                       lease_s=_lease(kv), stream=_stream(kv))
        except KeyError as exc:
            raise HandoffUnreadableError(f"kvport hand-off without {exc}") from None


def _unreadable(field: str, value: object, what: str) -> HandoffUnreadableError:
    shown = value[:64] if isinstance(value, str) else type(value).__name__
    return HandoffUnreadableError(f"kvport hand-off's {field} must be {what}, got {shown!r}")


def _tokens(kv: dict[str, Any]) -> int:
    v = kv["tokens"]
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TOKENS:
        raise _unreadable("tokens", v, f"an integer in 0..{MAX_TOKENS}")
    return v


def _last_key(kv: dict[str, Any]) -> str | None:
    v = kv.get("last_key")
    if v is None:
        return None
    try:
        if isinstance(v, str) and len(v) <= 64:
            key_from_hex(v)
            return v
    except KVPortError:
        pass
    raise _unreadable("last_key", v, "a block key in hex, or null")


def _spec(kv: dict[str, Any]) -> KVSpec:
    v = kv["spec"]
    if not isinstance(v, dict) or len(v) > MAX_SPEC_FIELDS:
        raise _unreadable("spec", v, f"an object of at most {MAX_SPEC_FIELDS} fields")
    try:
        return KVSpec.from_dict(v)
    except KVPortError as exc:
        raise HandoffUnreadableError(f"kvport hand-off's spec is unreadable ({exc})") from exc


def _engine(kv: dict[str, Any]) -> str:
    v = kv.get("engine", "")
    if not isinstance(v, str) or len(v) > MAX_ENGINE_CHARS:
        raise _unreadable("engine", v, f"a string of at most {MAX_ENGINE_CHARS} characters")
    return v


def _lease(kv: dict[str, Any]) -> float | None:
    v = kv.get("lease_s")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and 0 <= v <= MAX_LEASE_S):
        raise _unreadable("lease_s", v, f"seconds in 0..{MAX_LEASE_S:.0f}, or null")
    return v


def _stream(kv: dict[str, Any]) -> str | None:
    v = kv.get("stream")
    if v is None or is_stream_id(v):
        return v
    raise _unreadable("stream", v, "32 hex digits, or null")


__all__ = ["DEST_KEY", "MAX_TOKENS", "PD_KEY", "PD_VERSION", "HandoffAnswer", "HandoffAsk", "is_stream_id",
           "new_stream_id", "parse_dest", "parse_dests"]
