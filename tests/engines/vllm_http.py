"""HTTP helpers shared by the ``vllm serve`` tests: a JSON POST, and counters read from /metrics."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from kvport.bench.pd import metric


def post(url: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    """POST ``body`` as JSON and return the parsed answer (an HTTP error raises ``HTTPError``)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


__all__ = ["metric", "post"]
