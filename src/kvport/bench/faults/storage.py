"""Fault classes of ``kvport bench faults`` on the storage path (the shared tier, its disk, Redis).

All are two-turn chats: turn 1 runs without a fault and the decode worker saves its prompt and
answer in the shared tier; the fault hits turn 2, whose prompt extends turn 1 and is loaded from
there. ``inj.lost`` counts committed blocks gone or wrong, by each class's rule:

* ``kill_server``   blocks on the server's disk before the turn, missing or unreadable after the
                    SIGKILL and a restart on the same folder (host-only blocks are not durable)
* ``disk_*``        the chat's blocks before the damaged one (its ancestors, the system prompt's
                    among them; pinned before the damage, so that the pool's eviction cannot take
                    them) missing or unreadable afterwards, except those whose own bytes the fault
                    destroyed (a page in the cut half or the deleted file: counted apart)
* ``server_stall``  turn 1's blocks present before the stall and missing after it
* ``disk_full``     turn 1's blocks (pinned before the disk filled) missing after, or a block the
                    server still lists that does not read back
* ``tier_full``     the pinned blocks that fill the tier, missing after any request
* ``lease_expiry``  leased blocks that a DELETE removed while the lease was live
* ``redis_restart`` none: Redis runs without persistence here, a restart is a clean miss by design

"Unreadable" is a GET that fails: the client verifies every chunk against the checksums the
server took at PUT, so a block with wrong bytes is unreadable, never served.
"""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import Future
from pathlib import Path
from typing import ClassVar

from kvport.bench.faults.classes import GET, FaultClass, Injection, wait_event
from kvport.bench.faults.env import Env, ServerProfile, Setup
from kvport.bench.faults.router import RoutedAnswer
from kvport.errors import KVPortError
from kvport.lifetime import Lifetime
from kvport.protocol.rejects import Rejected
from kvport.protocol.server import PinSpec

MiB = 1 << 20


def _sleep_unless_done(turn: Future[RoutedAnswer], seconds: float) -> bool:
    """Sleep ``seconds``; False when the turn finished meanwhile."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if turn.done():
            return False
        time.sleep(0.005)
    return not turn.done()


def _missing(env: Env, keys: list[bytes]) -> int:
    return sum(1 for p in env.present(keys) if not p)


def _lost(env: Env, keys: list[bytes], sample: int | None = None, rng: random.Random | None = None) -> int:
    """Of ``keys`` (blocks that were there): missing now, or present but unreadable (of a sample)."""
    present = [k for k, p in zip(keys, env.present(keys), strict=True) if p]
    check = present if sample is None or rng is None else rng.sample(present, min(sample, len(present)))
    return len(keys) - len(present) + len(check) - env.readable(check)


class KillServer(FaultClass):
    """SIGKILL of ``kvport serve`` at a random moment of the turn (lookup, load or the decode
    worker's save); it stays dead until the turn is answered, then starts again on its folder."""

    name, turns = "kill_server", 2
    dirties_server = True
    MAX_DELAY_S: ClassVar[float] = 0.4

    def before(self, env: Env, inj: Injection) -> None:
        env.push_to_disk()  # everything older than the fault turn is durable now
        inj.data["durable"], orphans = env.durable_keys()
        self.count("disk_blocks_below_a_host_parent", orphans)

    def during(self, env: Env, inj: Injection, turn: Future[RoutedAnswer]) -> None:
        if not _sleep_unless_done(turn, self.rng.uniform(0.0, self.MAX_DELAY_S)):
            inj.detail = "the turn was answered before the kill"
            return
        env.server.kill()
        inj.applied = True

    def after(self, env: Env, inj: Injection, ans: RoutedAnswer | None) -> None:
        if inj.applied:
            env.restart_server()
        durable: list[bytes] = inj.data["durable"]
        inj.lost = _lost(env, durable, 16, self.rng)
        self.count("durable_blocks_checked", len(durable))
        if ans is not None and "no_parent" in str(ans.decode.get("store_error") or ""):
            self.count("saves_refused_no_parent")


class RedisRestart(FaultClass):
    """The workers' stores hold a Redis tier (``redis-server``, no persistence) above the shared tier;
    Redis is killed at a random moment of the turn and started again at once, empty."""

    name, turns = "redis_restart", 2
    setup = Setup(redis=True)

    def during(self, env: Env, inj: Injection, turn: Future[RoutedAnswer]) -> None:
        if not _sleep_unless_done(turn, self.rng.uniform(0.0, 0.05)):
            inj.detail = "the turn was answered before the restart"
            return
        if env.redis is not None:
            env.redis.kill()
            env.redis.start()
            inj.applied = True

    def after(self, env: Env, inj: Injection, ans: RoutedAnswer | None) -> None:
        cached = len(env.cached_keys(inj.chat, 1)) * env.spec.block_size
        if ans is not None and inj.applied and int(ans.prefill.get("hit_tokens") or 0) < cached:
            self.count("turns_that_missed_blocks_redis_lost")


class _DiskDamage(FaultClass):
    """Between turn 1's save and turn 2's load, one of the chat's blocks (a random one past the system
    prompt, pushed down to the server's disk) has its slab file damaged. A slab holds the pages one
    demotion wrote, so an ancestor (a system prompt block promoted by a hit and demoted again beside
    the chat's) can share the damaged file: one whose own bytes the fault destroyed is reported in
    ``details.ancestors_destroyed_by_the_fault``, not as lost; every other ancestor must survive."""

    turns = 2

    def damage(self, slab: Path, target: tuple[int, int]) -> tuple[int, int]:
        """Damage ``slab`` (``target``: the target page's payload offset and length); returns the
        byte range ``[start, end)`` of the file the damage destroyed."""
        raise NotImplementedError

    def before(self, env: Env, inj: Injection) -> None:
        keys = env.cached_keys(inj.chat, 1)
        own = keys[env.system_blocks :]
        if not own:
            inj.detail = "the chat has no block of its own to damage"
            return
        env.push_to_disk()
        tiers = env.tiers_of(own)
        on_disk = [k for k in own if tiers.get(k) == ("disk",)]
        if not on_disk:
            inj.detail = "none of the chat's blocks reached the disk"
            return
        target = self.rng.choice(on_disk)
        slab = env.slab_of(target)
        if slab is None:
            inj.detail = "no slab file holds the target block"
            return
        entries = env.slab_entries(slab)
        anc = keys[: keys.index(target)]
        anc = [k for k, p in zip(anc, env.present(anc), strict=True) if p]
        # pinned (a client that must keep them): a long-running pool evicts unpinned blocks under
        # pressure, as a cache may, and that is not the fault's loss
        env.bench.pin(anc, "bench faults: ancestors of a damaged block", 600.0)
        inj.data["pinned"] = anc
        start, end = self.damage(slab, entries[env.pages_of(target, 1)[0]])
        inj.applied = True
        destroyed = env.in_range(anc, slab, entries, start, end)
        self.count("ancestors_destroyed_by_the_fault", len(destroyed))
        inj.data["ancestors"] = [k for k in anc if k not in destroyed]
        inj.data["destroyed"] = [target, *destroyed]

    def after(self, env: Env, inj: Injection, ans: RoutedAnswer | None) -> None:
        # the server finds the damage now if the turn did not read those blocks (a load that ended
        # before them): a later injection must not pin, as an intact ancestor, a block this one destroyed
        env.readable(inj.data.get("destroyed", []))
        anc: list[bytes] = inj.data.get("ancestors", [])
        inj.lost = _lost(env, anc)
        if inj.lost:
            self.count("lost_missing", _missing(env, anc))
        if inj.data.get("pinned"):
            env.bench.unpin(inj.data["pinned"])
        if ans is not None and int(ans.prefill.get("loaded_tokens") or 0) == 0 and ans.prefill.get("fallback"):
            self.count("loads_refused")


class DiskCorrupt(_DiskDamage):
    name = "disk_corrupt"

    def damage(self, slab: Path, target: tuple[int, int]) -> tuple[int, int]:
        off, length = target
        with slab.open("r+b") as f:  # one byte of the target's own payload
            at = self.rng.randrange(off, off + length)
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0xFF]))
        return at, at + 1


class DiskTruncate(_DiskDamage):
    name = "disk_truncate"

    def damage(self, slab: Path, target: tuple[int, int]) -> tuple[int, int]:
        size = slab.stat().st_size
        cut = min(size // 2, target[0] + target[1] // 2)  # the target's page is always cut
        os.truncate(slab, cut)
        return cut, size


class DiskMissing(_DiskDamage):
    name = "disk_missing"

    def damage(self, slab: Path, target: tuple[int, int]) -> tuple[int, int]:
        slab.unlink()
        return 0, 1 << 62


class ServerStall(FaultClass):
    """SIGSTOP of ``kvport serve`` at a random moment of the turn; SIGCONT only once the turn is
    answered (or its hang deadline passed): every wait on the server must be bounded."""

    name, turns = "server_stall", 2

    def before(self, env: Env, inj: Injection) -> None:
        keys = env.keys(list(inj.chat.prompts[0]) + list(inj.chat.expected[0].tokens[:-1]))
        inj.data["saved"] = [k for k, p in zip(keys, env.present(keys), strict=True) if p]

    def during(self, env: Env, inj: Injection, turn: Future[RoutedAnswer]) -> None:
        if not _sleep_unless_done(turn, self.rng.uniform(0.0, 0.3)):
            inj.detail = "the turn was answered before the stop"
            return
        env.server.signal(signal.SIGSTOP)
        inj.applied = True

    def after(self, env: Env, inj: Injection, ans: RoutedAnswer | None) -> None:
        env.server.signal(signal.SIGCONT)
        inj.lost = _missing(env, inj.data["saved"])


class DiskFull(FaultClass):
    """The server's ``--disk`` is a small tmpfs; before turn 2 turn 1's blocks are pinned (a client
    that must keep them) and a file takes all of the tmpfs but 64 KiB, so turn 2's saves need
    demotions that cannot be written (ENOSPC); the file goes, and the pins, after the turn.

    Unpinned blocks may leave the pool to admit new ones (eviction: with the disk full they are
    dropped instead of demoted; counted in ``details.dropped_unpinned``). Lost: a pinned block gone,
    or a block the server still lists that does not read back with its own bytes (a sample, pinned
    before it is read: reading promotes blocks to the pool, which may evict unpinned ones, and a
    block evicted between the listing and its read is not a loss)."""

    name, turns = "disk_full", 2
    setup = Setup(server=ServerProfile("disk_full", tmpfs_bytes=192 * MiB))
    MAX_FILL_BYTES: ClassVar[int] = 2 << 30  # without a tmpfs, a shared disk is filled only if this is all it has

    def before(self, env: Env, inj: Injection) -> None:
        if env.tmpfs is None:
            return
        self.details["tmpfs_mounted"] = env.tmpfs.mounted
        if not env.tmpfs.mounted and env.tmpfs.free_bytes() > self.MAX_FILL_BYTES:
            inj.detail = (f"no tmpfs (mount refused) and {env.tmpfs.free_bytes() >> 30} GiB free on the folder's "
                          "file system: not filled")
            return
        keys = list(env.bench.keys())
        held = [k for k, p in zip(keys, env.present(keys), strict=True) if p]
        saved = env.cached_keys(inj.chat, 1)
        pinned = [k for k, p in zip(saved, env.present(saved), strict=True) if p]
        env.bench.pin(pinned, "bench faults: disk full", 600.0)
        inj.data.update(held=[k for k in held if k not in set(pinned)], pinned=pinned)
        env.tmpfs.fill(64 << 10)
        inj.applied = True

    def after(self, env: Env, inj: Injection, ans: RoutedAnswer | None) -> None:
        if env.tmpfs is not None:
            env.tmpfs.unfill()
        pinned: list[bytes] = inj.data.get("pinned", [])
        held: list[bytes] = inj.data.get("held", [])
        present = [k for k, p in zip(held, env.present(held), strict=True) if p]
        self.count("dropped_unpinned", len(held) - len(present))
        self.count("pinned_blocks", len(pinned))
        sample = self.rng.sample(present, min(16, len(present)))
        if sample:  # pinned while read back: the reads promote blocks, and a full pool evicts unpinned ones
            env.bench.pin(sample, "bench faults: a sample read back", 60.0)
            sample = [k for k, p in zip(sample, env.present(sample), strict=True) if p]
        lost_pinned, unreadable = _lost(env, pinned), len(sample) - env.readable(sample)
        if sample:
            env.bench.unpin(sample)
        inj.lost = lost_pinned + unreadable
        if inj.lost:
            self.count("lost_pinned_missing", _missing(env, pinned))
            self.count("lost_pinned", lost_pinned)
            self.count("listed_but_unreadable", unreadable)
            if unreadable:
                self.details["unreadable_why"] = env.unreadable_why[-3:]
        if pinned:
            env.bench.unpin(pinned)
        if ans is not None and ans.decode.get("store_error"):
            self.count("saves_refused")


class TierFull(FaultClass):
    """The server's pool and disk are full of pinned blocks (pinned by the bench, for an hour); the
    turn's save is refused; the pins must hold."""

    name, turns = "tier_full", 1
    dirties_server = True
    setup = Setup(server=ServerProfile("tier_full", disk_capacity="48MiB"))

    def prepare(self, env: Env) -> None:
        self.pinned: list[bytes] = []
        value = bytes(int(env.server.info.get("page_bytes", MiB)) // 2)
        while len(self.pinned) < 4096:
            k = os.urandom(16)
            out = env.bench.put_value(k, value, lifetime=Lifetime.PREFIX,
                                      pin=PinSpec("bench faults: tier full", 3600.0))
            if isinstance(out, Rejected):
                break
            self.pinned.append(k)
        self.details["pinned_blocks"] = len(self.pinned)

    def before(self, env: Env, inj: Injection) -> None:
        probe = env.bench.put_value(os.urandom(16), bytes(1024), lifetime=Lifetime.REQUEST, ttl_s=5.0)
        inj.applied = isinstance(probe, Rejected)
        inj.detail = "" if inj.applied else "the tier took a write"

    def after(self, env: Env, inj: Injection, ans: RoutedAnswer | None) -> None:
        inj.lost = _missing(env, self.pinned)
        if ans is not None and ans.decode.get("store_error"):
            self.count("saves_refused")

    def finish(self, env: Env) -> None:
        try:
            for i in range(0, len(getattr(self, "pinned", [])), 512):
                env.bench.unpin(self.pinned[i : i + 512])
                env.bench.delete_many(self.pinned[i : i + 512])
        except KVPortError:
            pass


class LeaseExpiry(FaultClass):
    """A lease on turn 2's cached blocks (as a scheduler takes at lookup for the load to come) with a
    ``TTL_S`` TTL; the load is held in flight (a proxy before the server holds its second GET) while
    the lease is live -- a DELETE must leave the blocks -- and after it lapsed -- a DELETE removes
    them; then the load goes on and must miss and recompute, never use a partial or wrong block."""

    name, turns = "lease_expiry", 2
    setup = Setup(server_proxy=True, load_deadline=(5.0, 4.0, 10.0))
    TTL_S: ClassVar[float] = 0.5

    def before(self, env: Env, inj: Injection) -> None:
        keys = env.cached_keys(inj.chat, 1)[env.system_blocks :]
        if not keys or env.server_proxy is None:
            inj.detail = "no block of the chat to lease"
            return
        _lease, held = env.bench.lease(keys, self.TTL_S)
        inj.data.update(keys=keys, leased=held, t_lease=time.monotonic())
        env.server_proxy.drain()
        env.server_proxy.send("arm", action="hold", type=GET, nth=2)

    def during(self, env: Env, inj: Injection, turn: Future[RoutedAnswer]) -> None:
        p = env.server_proxy
        keys: list[bytes] = inj.data.get("keys", [])
        if p is None or not keys or wait_event(p, "held", turn, 10.0) is None:
            inj.detail = inj.detail or "the load never reached a second GET"
            return
        inj.applied = True
        live = time.monotonic() - inj.data["t_lease"] < self.TTL_S
        removed_live = env.bench.delete_many(keys) if live else 0
        inj.lost = removed_live + (_missing(env, keys) if live else 0)
        self.count("deletes_under_live_lease", int(live))
        time.sleep(max(0.0, inj.data["t_lease"] + self.TTL_S + 1.2 - time.monotonic()))
        removed = 0
        for _ in range(10):
            removed += env.bench.delete_many(keys)
            if removed:
                break
            time.sleep(0.2)
        self.count("removed_after_lapse", int(removed > 0))
        p.send("release")

    def after(self, env: Env, inj: Injection, ans: RoutedAnswer | None) -> None:
        if env.server_proxy is not None:
            env.server_proxy.send("disarm")


STORE_CLASSES: tuple[type[FaultClass], ...] = (
    KillServer, DiskCorrupt, DiskTruncate, DiskMissing, ServerStall, RedisRestart, DiskFull, TierFull,
    LeaseExpiry,
)
