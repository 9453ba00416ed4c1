"""``python -m kvport.refmodel``: convert the reference model into the cache (idempotent)."""

from __future__ import annotations

import sys

from kvport.config import Settings
from kvport.refmodel.locate import prepare


def main() -> int:
    settings = Settings.from_env()
    path = prepare(settings.model_dir, force="--force" in sys.argv)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
