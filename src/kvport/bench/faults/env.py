"""The fault benchmark's environment: what runs for a class, and the server-side checks.

A :class:`Setup` names what a fault class needs (the server's profile, Redis in the workers' stores,
a proxy in front of the server for the prefill worker, the transfer link through a network
namespace, the workers' load deadlines); :meth:`Env.use` brings the running processes there,
restarting only what differs. Everything the environment starts is closed by the ``ExitStack`` it
was given, in reverse order, also after a failure: workers, proxies, relays, the namespace, the
servers, the tmpfs mount, the temporary folder.

Server-side checks go through the bench's own client (tenant ``default``, the workers' tenant):
``present`` (CONTAINS), ``readable`` (a GET of each value: the client verifies every chunk against
the checksums taken at PUT), ``on_disk`` (OWNERS: the tiers holding a block) and ``slab_of`` (the
disk slab file holding a block's value: the tenant's storage key, from the server secret, then the
page key the disk tier files it under).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvport.bench.faults.oracle import Chat, Oracle
from kvport.bench.faults.procs import Netns, ProxyProc, RedisProc, ServerProc, Tmpfs, free_port
from kvport.bench.faults.router import ProxiedLink, RoutedAnswer, Router, WorkerConfig, Workers
from kvport.client import ClientConfig, RemoteTier
from kvport.errors import KVPortError
from kvport.keys import KeyContext, chain_keys
from kvport.lifetime import Lifetime
from kvport.spec import KVSpec

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class ServerProfile:
    name: str = "default"
    capacity: str = "100MiB"  # the whole process: ~36 one-MiB pages of host pool here, the rest on disk
    disk_capacity: str = "2GiB"
    tmpfs_bytes: int = 0  # > 0: --disk on a tmpfs this large (disk full)

    def args(self, disk: Path) -> list[str]:
        return ["--capacity", self.capacity, "--disk", str(disk), "--disk-capacity", self.disk_capacity,
                "--inflight", "8MiB", "--max-value", "2MiB"]


@dataclass(frozen=True, slots=True)
class Setup:
    server: ServerProfile = ServerProfile()
    redis: bool = False  # the workers' stores get a Redis tier above the shared tier
    server_proxy: bool = False  # the prefill worker reaches the server through a fault proxy
    netns: bool = False  # the transfer link crosses a network namespace
    load_deadline: tuple[float, float, float] = (1.0, 4.0, 10.0)


class Env:
    def __init__(self, stack: contextlib.ExitStack, oracle: Oracle, model_dir: Path, spec: KVSpec,
                 link_gbps: float, seed: int, lengths: tuple[int, int]) -> None:
        self.stack, self.oracle, self.spec = stack, oracle, spec
        self.seed, self.lengths = seed, lengths
        self.tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvport-faults-")))
        self.key_ctx = KeyContext(block_size=spec.block_size, spec_fingerprint=spec.fingerprint)
        self.server = ServerProc(free_port(), self.tmp / "server.log")
        stack.callback(self.server.stop)
        self.workers = Workers(model_dir)
        stack.callback(self._close_parts)
        self.router = Router(self.workers, spec.block_size, oracle.shared_prefix_tokens, oracle.max_new, link_gbps)
        self._pool_exec = ThreadPoolExecutor(1, thread_name_prefix="faults-request")
        stack.callback(self._pool_exec.shutdown, wait=False, cancel_futures=True)
        self.setup: Setup | None = None
        self.unreadable_why: list[str] = []
        self.link: ProxiedLink | None = None
        self.netns: Netns | None = None
        self.redis: RedisProc | None = None
        self.tmpfs: Tmpfs | None = None
        self.server_proxy: ProxyProc | None = None
        self.pool: RemoteTier | None = None
        self.disk = self.tmp / "disk"
        self.chats = 0
        self.servers = 0

    # ------------------------------------------------------------------ what runs
    def use(self, want: Setup, fresh: bool = False) -> None:
        """Bring the processes to ``want``; ``fresh``: a new server folder and new workers even when
        nothing differs (the class before left the server's contents changed)."""
        have = self.setup
        restart_workers = fresh or have is None or replace(have, server=want.server) != want
        if fresh or have is None or have.server != want.server:
            self._server(want.server)
            restart_workers = True
        if have is None or have.netns != want.netns:
            if self.link is not None:
                self.link.close()
            if self.netns is not None:
                self.netns.close()
            self.netns = Netns() if want.netns else None
            self.link = ProxiedLink(self.netns)
        if want.redis and self.redis is None:
            self.redis = RedisProc(self.tmp / "redis")
            self.redis.start()
        if want.server_proxy and self.server_proxy is None:
            self.server_proxy = ProxyProc(("127.0.0.1", self.server.port))
        if restart_workers:
            assert self.link is not None
            cfg = WorkerConfig(self.server.port, self.redis.url if want.redis and self.redis else None,
                               want.load_deadline,
                               self.server_proxy.port if want.server_proxy and self.server_proxy else None)
            self.workers.start(cfg, self.link)
        self.setup = want

    def _server(self, profile: ServerProfile) -> None:
        self.server.stop()
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.tmpfs is not None:
            self.tmpfs.close()
            self.tmpfs = None
        self.servers += 1
        self.disk = self.tmp / f"disk-{profile.name}-{self.servers}"
        if profile.tmpfs_bytes:
            self.tmpfs = Tmpfs(self.disk, profile.tmpfs_bytes)
        self.server.start(profile.args(self.disk))
        self.pool = RemoteTier(ClientConfig(port=self.server.port, client="faults-bench", retries=2,
                                            timeout_s=10.0, backpressure_timeout_s=0.5), name="bench")

    def restart_server(self) -> None:
        """The same server (profile, folder, port) again, after a kill or for a clean start."""
        self.server.start()

    def _close_parts(self) -> None:
        self.workers.close()
        for part in (self.link, self.server_proxy, self.netns, self.redis):
            if part is not None:
                with contextlib.suppress(Exception):
                    part.close()
        if self.pool is not None:
            self.pool.close()
        self.server.stop()
        if self.tmpfs is not None:
            self.tmpfs.close()

    def recover(self) -> None:
        """After a hang: both workers afresh (whatever they were stuck in dies with them)."""
        self.workers.restart(prefill=True, decode=True)

    def link_alive(self, settle_s: float = 0.3) -> bool:
        """The prefill worker's connection to the decode worker still runs through the fault proxy."""
        if self.link is None:
            return True
        time.sleep(settle_s)  # a link that just failed is reported by the proxy a moment later
        return self.link.proxy.linked

    def link_closed_why(self) -> str:
        why = self.link.proxy.closed_why if self.link is not None else []
        return why[-1] if why else ""

    # ------------------------------------------------------------------ requests
    def chat(self, name: str, turns: int) -> Chat:
        self.chats += 1
        return self.oracle.chat(f"{name}-{self.chats}", self.seed * 1_000_003 + self.chats, turns, self.lengths)

    def start_turn(self, chat: Chat, t: int, hang_s: float) -> Future[RoutedAnswer]:
        hang_at = time.monotonic() + hang_s
        return self._pool_exec.submit(self.router.request, f"{chat.cid}/t{t + 1}", list(chat.prompts[t]), hang_at)

    # ------------------------------------------------------------------ server-side checks
    @property
    def bench(self) -> RemoteTier:
        if self.pool is None:
            raise KVPortError("no server")
        return self.pool

    def keys(self, tokens: tuple[int, ...] | list[int], partial: bool = False) -> list[bytes]:
        return chain_keys(list(tokens), self.key_ctx, include_partial=partial)

    def cached_keys(self, chat: Chat, t: int) -> list[bytes]:
        """Blocks of turn ``t``'s prompt that turn ``t - 1`` saved (its prompt + answer, full blocks)."""
        prev = list(chat.prompts[t - 1]) + list(chat.expected[t - 1].tokens[:-1])
        n = min(len(prev) // self.spec.block_size, (len(chat.prompts[t]) - 1) // self.spec.block_size)
        return self.keys(chat.prompts[t])[:n]

    @property
    def system_blocks(self) -> int:
        return self.oracle.shared_prefix_tokens // self.spec.block_size

    def present(self, keys: list[bytes]) -> list[bool]:
        return self.bench.contains_many(keys) if keys else []

    def readable(self, keys: list[bytes]) -> int:
        """How many of ``keys`` read back (their chunks verified against the checksums taken at PUT);
        why the others did not is kept in :attr:`unreadable_why` (the last few, for the report)."""
        buf = bytearray(4 * MiB)
        ok = 0
        for k in keys:
            try:
                ok += int(self.bench.get_into(k, buf) > 0)
            except KVPortError as exc:
                self.unreadable_why = [*self.unreadable_why[-4:], f"{k.hex()}: {type(exc).__name__}: {exc}"[:300]]
        return ok

    def blocks_of(self, keys: list[bytes]) -> dict[bytes, tuple[tuple[str, ...], bytes | None]]:
        """(tiers holding it, parent key) of each block the server has."""
        out: dict[bytes, tuple[tuple[str, ...], bytes | None]] = {}
        for i in range(0, len(keys), 512):
            for row in self.bench.owners(keys[i : i + 512]).blocks:
                out[bytes.fromhex(row.key)] = (tuple(row.tiers), bytes.fromhex(row.parent) if row.parent else None)
        return out

    def tiers_of(self, keys: list[bytes]) -> dict[bytes, tuple[str, ...]]:
        return {k: t for k, (t, _) in self.blocks_of(keys).items()}

    def durable_keys(self) -> tuple[list[bytes], int]:
        """Blocks on the server's disk (journaled, in a slab) whose every ancestor is on disk too --
        what a restart after SIGKILL can keep and a lookup can still reach -- and how many more
        disk blocks have an ancestor only in the host pool (dropped at restart: never reachable)."""
        info = self.blocks_of(list(self.bench.keys()))
        on_disk = {k for k, (t, _) in info.items() if "disk" in t}
        memo: dict[bytes, bool] = {}

        def reachable(k: bytes) -> bool:
            chain: list[bytes] = []
            cur: bytes | None = k
            ok = True
            while cur is not None and cur not in memo:
                if cur not in on_disk:
                    ok = False
                    break
                chain.append(cur)
                cur = info[cur][1]
            ok = ok and (cur is None or memo[cur])
            for c in chain:
                memo[c] = ok
            return memo.get(k, ok)

        durable = [k for k in on_disk if reachable(k)]
        return durable, len(on_disk) - len(durable)

    def push_to_disk(self) -> None:
        """Fill the host pool with throwaway blocks (every older block goes down to disk), then delete them."""
        page = int(self.server.info.get("page_bytes", MiB))
        n = int(self.server.info.get("host_capacity", 64 * MiB)) // page + 2
        fill = [os.urandom(16) for _ in range(n)]
        value = bytes(page // 2)
        for k in fill:
            self.bench.put_value(k, value, lifetime=Lifetime.REQUEST, ttl_s=30.0)
        self.bench.delete_many(fill)

    def pages_of(self, key: bytes, most: int = 8) -> list[bytes]:
        """The disk page keys ``key``'s value may use (its first ``most``): the server stores a value
        as pages keyed by the tenant's storage key and the page's index."""
        from kvport.server.tenants import SECRET_FILE, Tenant, TenantTable
        from kvport.tiers.paged_tier import page_keys

        secret = (self.disk / SECRET_FILE).read_bytes()
        return page_keys(TenantTable([Tenant("default")], secret).storage_key("default", key), most)

    def slab_entries(self, slab: Path) -> dict[bytes, tuple[int, int]]:
        """Page key -> (payload offset, length) of each entry in ``slab``'s table ({} if unreadable)."""
        from kvport.tiers.disk import _ENTRY, HEAD_BYTES

        try:
            with slab.open("rb") as f:
                head = f.read(HEAD_BYTES)
                m = int.from_bytes(head[8:12], "little")
                table = f.read(_ENTRY.size * min(m, 1 << 16))
        except OSError:
            return {}
        out: dict[bytes, tuple[int, int]] = {}
        for j in range(len(table) // _ENTRY.size):
            pk, off, length, _, _ = _ENTRY.unpack_from(table, j * _ENTRY.size)
            out[pk] = (off, length)
        return out

    def slab_of(self, key: bytes) -> Path | None:
        """The slab file holding ``key``'s (first) page on the server's disk, or None."""
        pk = self.pages_of(key, 1)[0]
        for slab in (self.disk / "blocks").glob("*.kvs"):
            if pk in self.slab_entries(slab):
                return slab
        return None

    def in_range(self, keys: list[bytes], slab: Path, entries: dict[bytes, tuple[int, int]],
                 start: int, end: int) -> set[bytes]:
        """Of ``keys``, those with a page whose payload in ``slab`` (``entries``: its table, read before
        any damage) overlaps bytes ``[start, end)``: what a fault to those bytes destroys."""
        hit: set[bytes] = set()
        for k in keys:
            for pk in self.pages_of(k):
                loc = entries.get(pk)
                if loc is not None and loc[0] < end and start < loc[0] + loc[1]:
                    hit.add(k)
                    break
        return hit

    def stack_of(self, pid: int) -> str:
        """Where a process waits (py-spy, when installed), for a hung request's report."""
        exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not Path(exe).exists():
            return "py-spy not installed"
        r = subprocess.run([exe, "dump", "--pid", str(pid)], check=False, capture_output=True, text=True, timeout=30)
        return (r.stdout or r.stderr)[-3000:]


def describe(setup: Setup) -> dict[str, Any]:
    return {"server": setup.server.args(Path("<disk>")) + ([f"tmpfs {setup.server.tmpfs_bytes}"]
                                                            if setup.server.tmpfs_bytes else []),
            "redis": setup.redis, "server_proxy": setup.server_proxy, "netns": setup.netns,
            "load_deadline": dict(zip(("min_s", "factor", "max_s"), setup.load_deadline, strict=True))}
