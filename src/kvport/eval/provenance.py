"""Where a result came from: date, the command that made it, kvport's version and source commit.

Written into every ``kvport eval quality`` result (its ``provenance`` block), so a file shipped as
measured defaults, or passed to ``kvport calibrate --quality``, says how to reproduce it::

    {"date": "2026-12-01T15:04:05Z", "command": "kvport eval quality --codec int8 ...",
     "kvport_version": "0.1.0", "commit": "6ece980...", "uncommitted": ["src/kvport/codec/int8.py"]}

``commit`` is the HEAD of the git checkout kvport runs from (``null`` for an installed wheel);
``uncommitted`` lists changed files under the packages that decide a quality figure (codec, eval,
refmodel): empty means the figures belong to that commit.
"""

from __future__ import annotations

import shlex
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import kvport

_QUALITY_PACKAGES = ("codec", "eval", "refmodel")


def provenance(argv: Sequence[str]) -> dict[str, Any]:
    """The provenance block for a ``kvport`` command run with ``argv`` (without the program name)."""
    commit, uncommitted = _git_state(Path(kvport.__file__).resolve().parent)
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": shlex.join(["kvport", *argv]), "kvport_version": kvport.__version__,
            "commit": commit, "uncommitted": uncommitted}


def _git_state(pkg: Path) -> tuple[str | None, list[str]]:
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(pkg), *args], capture_output=True, text=True, timeout=10,
                                 check=True)
        except (OSError, subprocess.SubprocessError):  # no git, or not a checkout
            return None
        return out.stdout

    head = git("rev-parse", "HEAD")
    if head is None:
        return None, []
    status = git("status", "--porcelain", "--", *(str(pkg / p) for p in _QUALITY_PACKAGES)) or ""
    return head.strip(), sorted(line[3:] for line in status.splitlines() if line.strip())
