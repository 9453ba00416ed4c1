"""Against a real server process: killed writers, restart, backpressure, leases, concurrent clients."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvport.client.remote import Stored
from kvport.errors import TierFullError
from kvport.protocol.rejects import Rejected, RejectReason
from tests.waits import until

from .conftest import TOKENS, MiB, base_args


def test_client_killed_mid_write_leaves_no_visible_block(shared_server) -> None:  # type: ignore[no-untyped-def]
    srv = shared_server
    key = b"K" * 16
    before = srv.client().stats()
    script = textwrap.dedent(f"""
        import os, socket, sys
        from kvport.protocol.handshake import client_handshake
        from kvport.protocol.sync import FrameIO
        from kvport.transfer.tcp import TcpTransport
        from kvport.protocol.frame import MsgType, encode_frame
        s = socket.create_connection(("127.0.0.1", {srv.port}))
        io = FrameIO(TcpTransport(s))
        client_handshake(io, "default", None, "killed-writer")
        value = bytes(8 * {MiB})
        parts = encode_frame(MsgType.PUT, {{"key": {key!r}}}, [value[i:i + {MiB}] for i in range(0, len(value), {MiB})])
        half = b"".join(bytes(p) for p in parts)[: 5 * {MiB}]
        s.sendall(half)
        print("sent", flush=True)
        sys.stdin.readline()
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "sent"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(10)
    c = srv.client()
    assert c.contains_many([key]) == [False]
    assert c.lookup([key]).hits == 0
    assert before.server is not None
    # the server learns of the kill from its socket, on its own time: wait for the writer's abort
    # (bounded), then the reserved pages must be back: same blocks, same bytes
    until(lambda: (now := c.stats().server) is not None and now.tiers == before.server.tiers,
          "the killed writer's reserved pages never came back", 10.0)
    s = c.stats()
    assert s.server is not None
    assert s.server.tiers == before.server.tiers
    value = np.full(8 * MiB, 7, dtype=np.uint8)
    assert c.put_value(key, value).existed is False  # type: ignore[union-attr]
    out = bytearray(8 * MiB)
    assert c.get_into(key, out) == 8 * MiB and out == value.tobytes()
    c.close()


def test_restart_keeps_disk_blocks_and_sigterm_drains_inflight_writes(server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    args = base_args("384MiB", "--disk", str(tmp_path / "disk"), "--disk-capacity", "256MiB")
    srv = server_factory(*args)
    c = srv.client(backpressure_timeout_s=0.0, retries=0)
    rng = np.random.default_rng(3)
    values = {bytes([i]) * 16: rng.integers(0, 256, int(rng.integers(MiB, 6 * MiB)), dtype=np.uint8)
              for i in range(8)}  # on host until the graceful shutdown spills them to disk
    for k, v in values.items():
        c.put(k, v)
    late = {bytes([100 + i]) * 16: np.full(16 * MiB, i, dtype=np.uint8) for i in range(4)}
    answers: dict[bytes, object] = {}

    def writer() -> None:
        for k, v in late.items():
            try:
                answers[k] = c.put_value(k, v)
            except Exception as exc:  # the server went away mid-request
                answers[k] = exc

    t = threading.Thread(target=writer)
    t.start()
    time.sleep(0.05)
    srv.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    t.join(60)
    assert srv.proc.wait(60) == 0  # type: ignore[union-attr]  # drained, spilled, manifest synced
    c.close()
    srv2 = server_factory(*args)
    c = srv2.client()
    st = c.stats().server
    assert st is not None and [t.used for t in st.tiers if t.name == "host"] == [0]  # everything is on disk now
    out = bytearray(16 * MiB)
    for k, v in values.items():
        n = c.get_into(k, out)
        assert out[:n] == v.tobytes()
    for k, v in late.items():  # acknowledged -> durable; anything else -> absent, never partial
        if isinstance(answers.get(k), Stored):
            assert c.get_into(k, out) == v.nbytes and out == v.tobytes()
        else:
            assert not isinstance(answers.get(k), Rejected) or answers[k].reason is RejectReason.SHUTTING_DOWN  # type: ignore[union-attr]
            present = c.contains_many([k])[0]
            assert not present or (c.get_into(k, out) == v.nbytes and out == v.tobytes())
    st = c.stats().server
    assert st is not None and [t.blocks for t in st.tiers if t.name == "host"] >= [len(values)]  # reads promoted them
    c.close()


def test_full_and_quota_give_typed_rejections(tenant_server) -> None:  # type: ignore[no-untyped-def]
    srv = tenant_server
    small = srv.client("small", TOKENS["small"], backpressure_timeout_s=0.3)
    small.put_value(b"a" * 16, np.ones(2 * MiB, dtype=np.uint8), pin=True)
    small.put_value(b"b" * 16, np.ones(2 * MiB, dtype=np.uint8), pin=True)
    rej = small.put_value(b"c" * 16, np.ones(MiB, dtype=np.uint8))
    assert isinstance(rej, Rejected) and rej.reason is RejectReason.QUOTA and rej.retry_after_s
    with pytest.raises(TierFullError):
        small.put(b"c" * 16, np.ones(MiB, dtype=np.uint8))
    too_big = small.put_value(b"d" * 16, np.ones(5 * MiB, dtype=np.uint8))
    assert isinstance(too_big, Rejected) and too_big.reason is RejectReason.TOO_LARGE and too_big.retry_after_s is None
    assert small.unpin([b"a" * 16]) == 1
    assert not isinstance(small.put_value(b"c" * 16, np.ones(MiB, dtype=np.uint8)), Rejected)  # drops its own "a"
    assert small.contains_many([b"a" * 16, b"b" * 16, b"c" * 16]) == [False, True, True]
    # the whole host pool pinned, no disk: FULL with a retry-after
    big = srv.client("big", TOKENS["big"], backpressure_timeout_s=0.3)
    host_pages = srv.info["host_capacity"] // MiB
    i = 0
    while True:
        out = big.put_value(i.to_bytes(16, "little"), np.ones(8 * MiB, dtype=np.uint8), pin=True)
        if isinstance(out, Rejected):
            break
        i += 1
        assert i * 8 <= host_pages
    assert out.reason is RejectReason.FULL and out.retry_after_s
    assert big.contains_many([i.to_bytes(16, "little")]) == [False]
    assert big.unpin([j.to_bytes(16, "little") for j in range(i)]) == i
    assert big.delete_many([j.to_bytes(16, "little") for j in range(i)]) == i
    small.close()
    big.close()


def test_leased_blocks_survive_eviction_pressure(shared_server) -> None:  # type: ignore[no-untyped-def]
    srv = shared_server
    c = srv.client()
    first = b"F" * 16
    c.put(first, np.full(4 * MiB, 1, dtype=np.uint8))
    lookup = c.lookup([first], lease_s=60)
    assert lookup.hits == 1 and lookup.lease_id is not None
    for i in range(2 * srv.info["host_capacity"] // (8 * MiB)):
        c.put(i.to_bytes(16, "little"), np.full(8 * MiB, 2, dtype=np.uint8))
    assert c.contains_many([first, (0).to_bytes(16, "little")]) == [True, False]
    assert [ls.blocks for ls in c.stats().leases] == [1]
    c.release(lookup.lease_id)
    assert c.stats().leases == ()
    for i in range(100, 100 + srv.info["host_capacity"] // (8 * MiB)):
        c.put(i.to_bytes(16, "little"), np.full(8 * MiB, 2, dtype=np.uint8))
    assert c.contains_many([first]) == [False]  # released: evictable like any other block
    c.close()


def test_concurrent_clients_never_corrupt_values(shared_server) -> None:  # type: ignore[no-untyped-def]
    errors: list[str] = []

    def worker(w: int) -> None:
        c = shared_server.client(pool_size=1)
        rng = np.random.default_rng(w)
        out = bytearray(6 * MiB)
        try:
            for i in range(6):
                k = bytes([w, i]) * 8
                v = rng.integers(0, 256, int(rng.integers(MiB, 6 * MiB)), dtype=np.uint8)
                c.put(k, v)
                n = c.get_into(k, out)  # small working set: never evicted between put and get
                if out[:n] != v.tobytes():
                    errors.append(f"{w}/{i} corrupt")
                c.delete(k)
        except Exception as exc:  # collected: a thread's failure must fail the test
            errors.append(f"{w}: {exc!r}")
        finally:
            c.close()

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
