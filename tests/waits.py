"""Waiting, in a test, for what another process or thread does on its own time (a server noticing a
killed client, a reaper's tick, a replica catching up): bounded, so a test never hangs; the exact
check comes after."""

from __future__ import annotations

import time
from collections.abc import Callable


def until(cond: Callable[[], object], what: str, timeout_s: float = 20.0, every_s: float = 0.05) -> None:
    """Return once ``cond()`` is true; fail the test with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} (waited {timeout_s} s)"
        time.sleep(every_s)
