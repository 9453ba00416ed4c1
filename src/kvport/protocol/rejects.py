"""Backpressure as a value: why new work was refused, and when to ask again.

One set of reasons for the transfer sender's admission and the kvport server's writes, so a
scheduler handles a busy decode worker and a full shared tier with one code path. On the wire a
refusal is the answer's metadata ``{"rejected": reason, "retry_after": seconds | None, "detail":
str}``; :meth:`Rejected.from_meta` gives the caller the same value the peer built, ``retry_after``
included.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from kvport.errors import ProtocolError

MAX_RETRY_AFTER_S = 3600.0
MAX_DETAIL = 1000


class RejectReason(enum.Enum):
    BUSY = "busy"  # buffers or in-flight budget above the high watermark: retry soon
    QUOTA = "quota"  # the tenant's quota is full of pinned/leased blocks
    FULL = "full"  # the store is full of pinned/leased blocks
    TOO_LARGE = "too_large"  # can never fit (over the value limit or the quota)
    NO_PARENT = "no_parent"  # the block's parent is not stored: the child could never be hit
    SHUTTING_DOWN = "shutting_down"
    PEER_FAILED = "peer_failed"  # the connection is gone: reconnect before retrying


@dataclass(frozen=True, slots=True)
class Rejected:
    """Admission refused, as a value (not an exception): a scheduler stops admitting new work and
    retries after ``retry_after_s`` (None when retrying cannot help)."""

    reason: RejectReason
    retry_after_s: float | None
    detail: str = ""

    def to_meta(self) -> dict[str, Any]:
        return {"rejected": self.reason.value, "retry_after": self.retry_after_s, "detail": self.detail}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> Rejected | None:
        """The refusal an answer carries, or None when it is not one; malformed: ProtocolError."""
        if "rejected" not in meta:
            return None
        try:
            reason = RejectReason(meta["rejected"])
        except ValueError as exc:
            raise ProtocolError(f"unknown rejection {meta['rejected']!r}") from exc
        ra = meta.get("retry_after")
        if ra is not None and (isinstance(ra, bool) or not isinstance(ra, int | float) or not math.isfinite(ra)
                               or not 0 <= ra <= MAX_RETRY_AFTER_S):
            raise ProtocolError(f"retry_after must be None or a number in [0, {MAX_RETRY_AFTER_S}], got {ra!r}")
        detail = meta.get("detail", "")
        return cls(reason, None if ra is None else float(ra), str(detail)[:MAX_DETAIL])
