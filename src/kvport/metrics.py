"""Prometheus metrics: one registry for the whole library.

Modules declare their metrics through :func:`counter` / :func:`gauge` / :func:`histogram`, which
return the existing collector when a name is declared twice (idempotent across imports and tests).
Names are prefixed ``kvport_``. Servers expose :data:`REGISTRY` on ``/metrics``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REGISTRY = CollectorRegistry(auto_describe=True)
_lock = threading.Lock()
_made: dict[str, Any] = {}


def _get(kind: type, name: str, doc: str, labels: Sequence[str], **kw: Any) -> Any:
    full = f"kvport_{name}"
    with _lock:
        existing = _made.get(full)
        if existing is not None:
            if not isinstance(existing, kind):
                raise TypeError(f"metric {full} already declared as {type(existing).__name__}")
            return existing
        made = kind(full, doc, labelnames=tuple(labels), registry=REGISTRY, **kw)
        _made[full] = made
        return made


def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
    c: Counter = _get(Counter, name, doc, labels)
    return c


def gauge(name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
    g: Gauge = _get(Gauge, name, doc, labels)
    return g


def histogram(name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] | None = None) -> Histogram:
    kw: dict[str, Any] = {}
    if buckets is not None:
        kw["buckets"] = tuple(buckets)
    h: Histogram = _get(Histogram, name, doc, labels, **kw)
    return h


def exposition() -> bytes:
    """The text exposition format of every kvport metric."""
    out: bytes = generate_latest(REGISTRY)
    return out


def sample(name: str, labels: dict[str, str] | None = None) -> float | None:
    """Current value of one sample (tests and reports); None if absent."""
    value = REGISTRY.get_sample_value(f"kvport_{name}", labels or {})
    return None if value is None else float(value)
