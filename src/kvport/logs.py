"""kvport's log records: one format, with a timestamp, in kvport's own processes and inside engines.

* kvport's commands (``kvport serve``, ``kvport proxy``, ...) configure the root logger once
  (:func:`setup`), at the level of ``KVPORT_LOG_LEVEL``.
* Inside an engine's process (vLLM's engine core and workers, SGLang's scheduler) kvport's code runs
  as a plug-in: the engine configures its own loggers only, and a ``kvport.*`` record would reach
  Python's last-resort handler (WARNING and up, the bare message: no time, no source).
  :func:`attach` gives the ``kvport`` logger its own handler there, in the same format, unless the
  process already routes records somewhere (a root handler, or one on ``kvport``).
"""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def setup(level: str) -> None:
    """A kvport command's process: every logger, this format."""
    logging.basicConfig(level=level, format=FORMAT)


def attach(level: str) -> None:
    """kvport's code in someone else's process: the ``kvport`` logger gets a timestamped handler of
    its own (and stops propagating, so nothing is printed twice) where no handler would take its
    records. Idempotent."""
    logger = logging.getLogger("kvport")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
