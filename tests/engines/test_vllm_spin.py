"""kvport_idle_spin_ms: vLLM's shared-memory queue readers stop busy-polling after the cap, readers made
before the cap included (the real SpinCondition, its real zmq sockets)."""

import time

import pytest

pytest.importorskip("vllm")

import zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

from kvport.engines.vllm import spin


def test_a_capped_reader_stops_spinning_and_sleeps_on_its_socket() -> None:
    ctx = zmq.Context()
    addr = "inproc://kvport-spin-test"
    writer = SpinCondition(is_reader=False, context=ctx, notify_address=addr)
    reader = SpinCondition(is_reader=True, context=ctx, notify_address=addr)  # made before the cap
    old = spin.idle_spin_s()
    try:
        assert reader.busy_loop_s == 1
        spin.restore_idle_spin()  # idempotent, and nothing to restore yet
        spin.limit_idle_spin(0.002)
        assert spin.idle_spin_s() == 0.002
        time.sleep(0.01)  # idle past the cap: the next wait polls the socket instead of yielding
        t0 = time.perf_counter()
        reader.wait(timeout_ms=200)  # nothing written: it sleeps until the timeout
        assert reader.busy_loop_s == 0.002
        assert time.perf_counter() - t0 >= 0.15
        writer.notify()
        reader.record_read()  # a read just happened: inside the window, wait returns at once
        t0 = time.perf_counter()
        reader.wait(timeout_ms=200)
        assert time.perf_counter() - t0 < 0.1
    finally:
        if old is None:
            spin.restore_idle_spin()
        else:
            spin.limit_idle_spin(old)
        ctx.destroy(linger=0)
