"""One client process of ``kvport bench soak`` (``python -m kvport.bench.soak_client ROLE ...``).

Roles, each a loop until SIGTERM (then it writes its last stats and exits) or SIGKILL (the soak's
fault: whatever it held must lapse at its TTL on the server)::

    writer     chains of 1-6 blocks PUT child after parent (PREFIX, or SESSION / REQUEST with a TTL),
               some pinned with a reason and a TTL; reads back its own pinned blocks
    reader     samples the server's keys, LOOKUP with a lease, GET under it (some with a lease kept
               after the read), releases some leases and lets the others lapse
    pinner     PIN / UNPIN with reasons and TTLs, LEASE / RELEASE of sampled keys
    sender     KV transfers to the receiver over TCP with a ledger: blocks registered as its own,
               handed off on commit (HANDED_OFF with the transfer id), freed when a transfer aborts
    receiver   accepts them (ACQUIRE with the same id), checks every byte, hands them to the pool
               (PUT as a SESSION chain) and frees its copy

Every value is a pure function of its key and length (:func:`pattern`), so any read anywhere is
checked: a block missing under this client's own live pin or lease, or with wrong bytes, counts as
``lost``. Stats go to ``--stats`` (written atomically every half second).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvport.client import ClientConfig, RemoteTier
from kvport.errors import KVPortError, LeaseError, TierError, TierUnavailableError, TransferError
from kvport.keys import KEY_BYTES
from kvport.ledger import Ledger, Owner
from kvport.lifetime import Lifetime
from kvport.protocol.rejects import Rejected
from kvport.protocol.server import PinSpec

KiB = 1 << 10
MAX_TTL_S = 8.0  # every lease and pin a client takes lapses within this


def pattern(key: bytes, n: int) -> np.ndarray:
    """The bytes every value of ``key`` must hold: a fast stream seeded by the key."""
    seed = int.from_bytes(key[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def verify(key: bytes, buf: memoryview | bytearray, n: int) -> bool:
    return bool(np.array_equal(np.frombuffer(buf, dtype=np.uint8, count=n), pattern(key, n)))


class StatsFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.c: dict[str, Any] = {"ops": 0, "lost": 0, "corrupt": 0, "errors": 0, "transfers": 0,
                                  "handed_off": 0, "acquired": 0, "engine_owned": 0, "last_error": ""}
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.c[name] = self.c.get(name, 0) + n

    def set(self, name: str, v: Any) -> None:
        with self._lock:
            self.c[name] = v

    def flush(self) -> None:
        with self._lock:
            data = json.dumps(self.c)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(data)
        os.replace(tmp, self.path)


class Role:
    def __init__(self, args: argparse.Namespace, stats: StatsFile) -> None:
        self.args = args
        self.stats = stats
        self.rng = random.Random(args.seed)
        self.stop = threading.Event()
        self.name = f"{args.role}-{args.incarnation}"
        self.tier = RemoteTier(ClientConfig(port=args.port, client=self.name, retries=2, timeout_s=10.0,
                                            backpressure_timeout_s=2.0), name="pool")

    def key(self) -> bytes:
        return self.rng.randbytes(KEY_BYTES)

    def sample(self, n: int) -> list[bytes]:
        keys = list(self.tier.keys())
        return self.rng.sample(keys, min(n, len(keys)))

    def epoch(self) -> int:
        """The server's incarnation (the soak bumps it before a restart; holds do not survive one)."""
        try:
            return int(Path(self.args.epoch).read_text())
        except (OSError, ValueError):
            return -1

    def get_checked(self, key: bytes, buf: bytearray, must_exist: bool, lease_s: float = 0.0,
                    since_epoch: int | None = None) -> int | None:
        epoch = self.epoch() if since_epoch is None else since_epoch
        try:
            n, lease = self.tier.get_leased(key, buf, lease_s)
        except TierUnavailableError:
            raise
        except TierError:
            if must_exist and self.epoch() == epoch:  # under this client's own live pin or lease
                self.stats.add("lost")
                self.stats.set("last_error", f"missing under own hold: {key.hex()}")
            return None
        if not verify(key, buf, n):
            self.stats.add("corrupt")
            self.stats.set("last_error", f"wrong bytes: {key.hex()}")
        self.stats.add("ops")
        return lease

    def loop(self) -> None:
        while not self.stop.is_set():
            try:
                self.step()
            except KVPortError as exc:  # the server restarting, a full pool: keep going
                self.stats.add("errors")
                self.stats.set("last_error", f"{type(exc).__name__}: {str(exc)[:160]}")
                time.sleep(0.2)

    def step(self) -> None:
        raise NotImplementedError


class Writer(Role):
    def __init__(self, args: argparse.Namespace, stats: StatsFile) -> None:
        super().__init__(args, stats)
        self.pinned: dict[bytes, tuple[int, float]] = {}  # key -> (server epoch, pin expiry, local clock)
        self.buf = bytearray(2 << 20)

    def step(self) -> None:
        parent: bytes | None = None
        lifetime = self.rng.choice([Lifetime.PREFIX, Lifetime.SESSION, Lifetime.REQUEST])
        ttl = self.rng.uniform(3.0, 12.0) if lifetime is not Lifetime.PREFIX else 0.0
        for _ in range(self.rng.randint(1, 6)):
            key, n = self.key(), self.rng.randint(16 * KiB, 2 << 20)
            pin = self.rng.random() < 0.2
            pin_ttl = self.rng.uniform(2.0, MAX_TTL_S)
            epoch = self.epoch()
            out = self.tier.put_value(key, pattern(key, n), parent=parent, lifetime=lifetime, ttl_s=ttl,
                                      pin=PinSpec("soak writer", pin_ttl) if pin else None)
            self.stats.add("ops")
            if isinstance(out, Rejected):
                break  # backpressure or a parent that left: start a new chain
            if pin:
                self.pinned[key] = (epoch, time.monotonic() + pin_ttl - 0.5)
            parent = key
        now = time.monotonic()
        for key, (epoch, until) in list(self.pinned.items()):
            if until < now:
                del self.pinned[key]
            elif self.rng.random() < 0.3:
                self.get_checked(key, self.buf, must_exist=True, since_epoch=epoch)


class Reader(Role):
    def __init__(self, args: argparse.Namespace, stats: StatsFile) -> None:
        super().__init__(args, stats)
        self.buf = bytearray(2 << 20)

    def step(self) -> None:
        keys = self.sample(8)
        if not keys:
            time.sleep(0.1)
            return
        for key in keys:
            epoch = self.epoch()
            lk = self.tier.lookup([key], lease_s=self.rng.uniform(1.0, MAX_TTL_S))
            self.stats.add("ops")
            if lk.hits and lk.lease_id is not None:
                keep = self.rng.uniform(1.0, MAX_TTL_S) if self.rng.random() < 0.3 else 0.0
                lease = self.get_checked(key, self.buf, must_exist=True, lease_s=keep, since_epoch=epoch)
                if self.rng.random() < 0.6:
                    self.tier.release(lk.lease_id)  # the others lapse at their TTL
                if lease is not None and self.rng.random() < 0.5:
                    self.tier.release(lease)


class Pinner(Role):
    def step(self) -> None:
        keys = self.sample(6)
        if not keys:
            time.sleep(0.1)
            return
        self.tier.pin(keys[:3], reason=self.rng.choice(["system prompt", "hot session", "eval set"]),
                      ttl_s=self.rng.uniform(1.0, MAX_TTL_S))
        if self.rng.random() < 0.5:
            self.tier.unpin(keys[:1])
        try:
            lease, _held = self.tier.lease(keys[3:], ttl_s=self.rng.uniform(1.0, MAX_TTL_S))
            if lease is not None and self.rng.random() < 0.5:
                self.tier.release(lease)
        except (KVPortError, LeaseError):
            pass  # a block left between the sample and the lease: typed, nothing leased
        self.stats.add("ops", 3)
        time.sleep(0.05)


def _small_spec() -> Any:
    from kvport.spec import DType, KVSpec

    return KVSpec(model_id="soak", num_layers=4, num_kv_heads=2, head_dim=32, dtype=DType.FP16, block_size=16)


class TransferSender(Role):
    """KV transfers to the receiver; the engine ledger owns each block until the commit hands it off."""

    def step(self) -> None:
        from kvport.transfer import Backpressure, Sender, TransferMeta
        from kvport.transfer.tcp import connect

        peer_port = _read_port(self.args.link)
        if peer_port is None:
            time.sleep(0.2)
            return
        me, peer = Owner.engine(self.name), Owner.engine("receiver")
        ledger = Ledger(owners=[me])
        try:
            t = connect("127.0.0.1", peer_port, timeout_s=10.0)
        except TransferError:
            time.sleep(0.2)
            return
        sender = Sender(t, Backpressure(), ledger=ledger, owner=me, peer=peer, credit_timeout_s=10.0)
        spec = _small_spec()
        try:
            while not self.stop.is_set():
                n = self.rng.randint(1, 8)
                keys = tuple(self.key() for _ in range(n))
                for k in keys:
                    ledger.register(k, me)
                blocks = [pattern(k, spec.bytes_per_block).reshape(spec.num_layers, -1) for k in keys]
                try:
                    sender.send(TransferMeta(spec, f"r{self.rng.getrandbits(32)}", keys),
                                lambda layer, bl=blocks: [b[layer].data for b in bl])  # type: ignore[misc]
                    self.stats.add("transfers")
                    self.stats.add("handed_off", n)
                    self.stats.add("ops")
                finally:
                    for k in keys:  # an aborted transfer gave them back: the engine frees its KV
                        if ledger.knows(k):
                            ledger.forget(k)
                    self.stats.set("engine_owned", len(ledger))
        finally:
            sender.close()


class TransferReceiver(Role):
    """Accepts transfers (ACQUIRE), checks every byte, hands the blocks to the pool, frees its copy."""

    def step(self) -> None:
        from kvport.transfer import Backpressure, Receiver
        from kvport.transfer.destination import LayerMajorDestination
        from kvport.transfer.tcp import TcpListener

        spec = _small_spec()
        me = Owner.engine("receiver")
        ledger = Ledger(owners=[me])
        listener = TcpListener("127.0.0.1", 0, timeout_s=10.0)
        _write_port(self.args.link, listener.port)
        try:
            t = listener.accept(timeout_s=5.0)
        except TransferError:
            listener.close()
            return
        listener.close()
        bufs: dict[str, np.ndarray] = {}

        def dest(meta: Any) -> LayerMajorDestination:
            buf = np.zeros((spec.num_layers, meta.n_blocks * spec.bytes_per_layer_block), dtype=np.uint8)
            bufs[meta.request_id] = buf
            return LayerMajorDestination(list(buf), range(meta.n_blocks), meta)

        # credits come back only once a transfer is in the pool: the budget bounds the blocks this
        # engine owns at any time (backpressure on the sender, not an unbounded backlog)
        rx = Receiver(t, spec, dest, 2 << 20, Backpressure(), auto_release=False, ledger=ledger, owner=me,
                        peers=[Owner.engine(f"sender-{i}") for i in range(self.args.peers)])
        rx.start()
        try:
            while True:
                try:
                    inc = rx.next_transfer(timeout=0.5)
                except TransferError:
                    if rx.closed.is_set() or self.stop.is_set():
                        return  # stopping: nothing left in flight
                    continue
                try:
                    inc.wait(timeout=15.0)
                except TransferError:  # aborted: the receiver gave its credits back and linked nothing
                    continue
                self._hand_to_pool(spec, inc.meta, bufs.pop(inc.meta.request_id), ledger)
                rx.release(inc.meta.total_bytes)
        finally:
            rx.close()

    def _hand_to_pool(self, spec: Any, meta: Any, buf: np.ndarray, ledger: Ledger) -> None:
        self.stats.add("transfers")
        self.stats.add("acquired", meta.n_blocks)
        rows = buf.reshape(spec.num_layers, meta.n_blocks, -1)  # layer-major: layer, block, bytes
        parent = None
        for j, k in enumerate(meta.block_keys):
            value = np.ascontiguousarray(rows[:, j, :]).reshape(-1)
            if not np.array_equal(value, pattern(k, spec.bytes_per_block)):
                self.stats.add("lost")  # a committed transfer with bytes that are not the sender's
                self.stats.set("last_error", f"transfer block {k.hex()} differs")
            out = self.tier.put_value(k, value, parent=parent, lifetime=Lifetime.SESSION, ttl_s=10.0)
            self.stats.add("ops")
            parent = None if isinstance(out, Rejected) else k
        for k in meta.block_keys:  # handed to the pool: the engine frees its copy
            if ledger.knows(k):
                ledger.forget(k)
        self.stats.set("engine_owned", len(ledger))


def _read_port(path: str) -> int | None:
    try:
        return int(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _write_port(path: str, port: int) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(str(port))
    os.replace(tmp, path)


ROLES: dict[str, type[Role]] = {"writer": Writer, "reader": Reader, "pinner": Pinner, "sender": TransferSender,
                                "receiver": TransferReceiver}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvport.bench.soak_client")
    ap.add_argument("role", choices=sorted(ROLES))
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--stats", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--incarnation", type=int, default=0)
    ap.add_argument("--link", default="", help="sender/receiver: the file holding the receiver's port")
    ap.add_argument("--epoch", default="", help="the file holding the server's incarnation")
    ap.add_argument("--peers", type=int, default=64, help="receiver: sender incarnations it accepts")
    args = ap.parse_args(argv)
    stats = StatsFile(Path(args.stats))
    role: Role | None = None
    for _ in range(100):  # the server may be restarting
        try:
            role = ROLES[args.role](args, stats)
            break
        except KVPortError as exc:
            stats.set("last_error", f"start: {exc}")
            time.sleep(0.2)
    if role is None:
        stats.flush()
        return 1
    signal.signal(signal.SIGTERM, lambda *_: role.stop.set())
    worker = threading.Thread(target=role.loop, daemon=True)
    worker.start()
    while worker.is_alive():
        stats.flush()
        worker.join(0.5)
    stats.flush()
    role.tier.close()
    socket.setdefaulttimeout(None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
