"""Cold reads: drop a file's pages from the kernel's page cache, so that the next read comes from disk.

The one implementation: the physical disk limit, the tiers suite, the planner's disk calibration
and the vLLM runner's cold-cache loads all call it.
"""

from __future__ import annotations

import os
from pathlib import Path


def drop_file_cache(path: str | Path) -> None:
    """Ask the kernel to drop a file's pages (posix_fadvise DONTNEED) so the next read is cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
