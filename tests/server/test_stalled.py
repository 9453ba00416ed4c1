"""A stalled server (SIGSTOP: it neither answers nor closes) never holds a load past its deadline."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from kvport.deadline import Deadline
from kvport.errors import DeadlineExceeded
from kvport.store import TieredStore

from .conftest import base_args


def test_a_read_from_a_stalled_server_ends_at_the_deadline(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = server_factory(*base_args("256MiB"))
    tier = srv.client(retries=3, timeout_s=30.0)
    tier.put(b"s" * 16, np.ones(1 << 20, dtype=np.uint8))
    store = TieredStore([tier])
    os.kill(srv.pid, signal.SIGSTOP)  # the server stops answering (not closed: a stall, not a failure)
    try:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            store.get_into(b"s" * 16, bytearray(1 << 20), deadline=Deadline.after(1.0))
        assert time.monotonic() - t0 < 10.0  # the socket's own 30 s and three retries never ran out
    finally:
        os.kill(srv.pid, signal.SIGCONT)
    assert store.get_into(b"s" * 16, bytearray(1 << 20), deadline=Deadline.after(10.0)) == 1 << 20
    tier.close()
