"""The pool over Redis (or a Redis Cluster): its ownership records, beside the values they are about.

A kvport server keeps its pool's book in its ledger. With Redis as the shared tier there is no
server: every engine writes and reads the pool directly, and a client can die at any moment. So
the records that must outlive a client live in Redis, each under its block's hash tag (one slot:
every script below touches one slot only), each with a native TTL, so Redis itself reaps what a
dead client held, at its expiry and never later::

    <head> (its own record) the block's hand-off to the pool, inside the value's head (RedisTier
                            writes it with the value: it expires and goes with it): msgpack {by:
                            the client that put it, lt: lifetime, p: parent key hex, t: unix ms}
    <head>:lease:<id hex>   a lease (hash: holder, since ms, ttl ms, blocks), PX its TTL
    <head>:pin:<holder>     a holder's pin (hash: count, reason, since ms, ttl ms), PX its TTL;
                            pinning again renews it and counts one more
    <head>:holds            the names of the block's lease and pin records (a set: inspect reads it
                            instead of scanning), PX the longest of them

A lease or a pin keeps its block: the value's head and its chunks get their TTL raised to at least
the record's (``PEXPIRE ... GT``: a block without a TTL stays without one).
A lease is taken on a chain: :meth:`PoolBook.lease` holds the leading blocks present and counts
those only (prefix-aware: a child whose parent is gone is never held nor counted). What a lease or
a pin cannot stop is Redis evicting under ``maxmemory`` with an ``allkeys-*`` policy: run the
shared tier with ``volatile-ttl`` or ``noeviction`` (docs/deployment.md); a value evicted anyway is
a miss (its chunks or head gone: CorruptBlockError, never a wrong byte).

Reports (``kvport inspect --redis URL``) answer in the server's own types
(:class:`~kvport.protocol.server.OwnersAnswer`, :class:`~kvport.protocol.server.LeaksAnswer`):
owners walk the chain a key ends through the own records' parents; leaks scan every primary
for blocks without an own record (put by a client without records, or an older kvport) and
children whose parent is gone. A record without its block cannot exist (it is in the block), nor
leases and pins past their TTL (Redis reaped them): those rows stay empty by construction.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvport.errors import LeaseExpiredError, TierError
from kvport.lifetime import Lifetime
from kvport.protocol.server import MAX_ROWS, BlockOwners, LeaksAnswer, LeaseRow, OwnersAnswer, PinRow
from kvport.tiers.redis_tier import _REDIS_ERRORS, MAX_CLIENT, MAX_OWN, TRAILER_BYTES, _map, parse_own

if TYPE_CHECKING:
    from kvport.tiers.redis_tier import RedisTier

DEFAULT_PIN_S = 600.0  # a pin's TTL when the caller names none (a pin in a shared pool always lapses)
MAX_TTL_S = 7 * 86400.0
MAX_HOLDER = MAX_CLIENT
MAX_REASON = 256

# Raise the TTL of a block's head and its chunks (named by the version in its trailer) to at least
# ARGV ttl ms. Inlined in each script below (Lua has no shared functions here).
_EXTEND = """
local function u64(s, at)
  local v = 0
  for i = at + 7, at, -1 do v = v * 256 + string.byte(s, i) end
  return v
end
local function extend(head, ttl)
  redis.call('PEXPIRE', head, ttl, 'GT')
  local tail = redis.call('GETRANGE', head, -40, -1)
  if #tail == 40 and string.sub(tail, 1, 4) == 'KVPR' and string.byte(tail, 5) == 2 then
    local chunk, n = u64(tail, 9), u64(tail, 17)
    if chunk > 0 then
      local hex = ''
      for i = 40, 33, -1 do hex = hex .. string.format('%02x', string.byte(tail, i)) end
      for i = 0, math.ceil(n / chunk) - 1 do redis.call('PEXPIRE', head .. ':' .. hex .. ':' .. i, ttl, 'GT') end
    end
  end
end
local function hold(holds, rec, ttl)
  redis.call('SADD', holds, rec)
  if redis.call('PTTL', holds) == -1 then redis.call('PEXPIRE', holds, ttl)
  else redis.call('PEXPIRE', holds, ttl, 'GT') end
end
"""

# KEYS: head, lease record, holds. ARGV: ttl ms, holder, since ms, lease id, blocks. 1 if leased.
_LEASE = _EXTEND + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], 'holder', ARGV[2], 'since', ARGV[3], 'ttl', ARGV[1], 'id', ARGV[4], 'blocks', ARGV[5])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
hold(KEYS[3], KEYS[2], ARGV[1])
extend(KEYS[1], ARGV[1])
return 1
"""

# KEYS: head, pin record, holds. ARGV: ttl ms, holder, reason, since ms. The holder's count after.
_PIN = _EXTEND + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local c = redis.call('HINCRBY', KEYS[2], 'count', 1)
redis.call('HSET', KEYS[2], 'holder', ARGV[2], 'reason', ARGV[3], 'since', ARGV[4], 'ttl', ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
hold(KEYS[3], KEYS[2], ARGV[1])
extend(KEYS[1], ARGV[1])
return c
"""

# KEYS: a record (pin: one count less; lease: gone), holds. ARGV: "pin" | "lease". 1 if it held.
_DROP = """
if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('SREM', KEYS[2], KEYS[1]) return 0 end
if ARGV[1] == 'pin' and redis.call('HINCRBY', KEYS[1], 'count', -1) > 0 then return 1 end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], KEYS[1])
return 1
"""

# KEYS: head, holds. ARGV: bytes of the head's tail to read. The block's book: {head strlen, head pttl,
# its tail (own record and trailer), records}; each record {name, pttl, flat hash}; names in holds
# whose record lapsed are removed.
_BOOK = """
local out = {redis.call('STRLEN', KEYS[1]), redis.call('PTTL', KEYS[1]),
             redis.call('GETRANGE', KEYS[1], -tonumber(ARGV[1]), -1)}
local recs = {}
for _, name in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local ttl = redis.call('PTTL', name)
  if ttl == -2 then redis.call('SREM', KEYS[2], name)
  else table.insert(recs, {name, ttl, redis.call('HGETALL', name)}) end
end
table.insert(out, recs)
return out
"""


def _ttl_ms(ttl_s: float, what: str) -> int:
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not 0 < ttl_s <= MAX_TTL_S:
        raise TierError(f"{what} TTL must be seconds in (0, {MAX_TTL_S:.0f}], got {ttl_s!r}")
    return max(1, int(ttl_s * 1000))


def _name(value: str, what: str, cap: int) -> str:
    if not isinstance(value, str) or len(value) > cap or any(c in value for c in "{}\r\n"):
        raise TierError(f"{what} must be a string of at most {cap} characters without braces or line breaks, "
                        f"got {value!r}")
    return value


def _hash(flat: Sequence[bytes]) -> dict[str, str]:
    it = iter(flat)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in zip(it, it, strict=False)}


def _int(v: str | None, default: int = 0) -> int:
    try:
        return int(v) if v is not None else default
    except ValueError:
        return default


class PoolBook:
    """Leases, pins and hand-off records of the blocks in one :class:`RedisTier` (module docstring)."""

    def __init__(self, tier: RedisTier) -> None:
        self.tier = tier
        self.client = tier.client  # the holder of this client's leases and pins, unless named
        r = tier._r
        self._scripts = {name: r.register_script(src) for name, src in
                         (("lease", _LEASE), ("pin", _PIN), ("drop", _DROP), ("book", _BOOK))}
        self._leases: dict[int, tuple[str, list[bytes]]] = {}  # this client's: id -> (holder, record names)

    # ------------------------------------------------------------------ names
    def _head(self, key: bytes) -> bytes:
        return self.tier._k(key)

    def _run(self, calls: Sequence[tuple[str, list[bytes], list[Any]]]) -> list[Any]:
        """Scripts in one pipeline (routed per slot in a cluster); a missing script (a new primary
        after a failover has an empty script cache) is loaded and the batch run once more."""
        if not calls:
            return []
        import redis

        for attempt in range(2):
            pipe = self.tier._pipe()
            for name, keys, args in calls:
                s = self._scripts[name]
                pipe.evalsha(s.sha, len(keys), *keys, *args)
            try:
                out = pipe.execute(raise_on_error=False)
            except _REDIS_ERRORS as exc:
                raise _map(self.tier.name, exc) from exc
            noscript = [o for o in out if isinstance(o, redis.exceptions.NoScriptError)]
            if noscript and attempt == 0:
                try:
                    for s in {n for n, _, _ in calls}:
                        self.tier._r.script_load(self._scripts[s].script)  # a cluster: every primary
                except _REDIS_ERRORS as exc:
                    raise _map(self.tier.name, exc) from exc
                continue
            bad = next((o for o in out if isinstance(o, Exception)), None)
            if bad is not None:
                raise _map(self.tier.name, bad) from bad
            return list(out)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ leases
    def lease(self, keys: Sequence[bytes], ttl_s: float, holder: str | None = None) -> tuple[int | None, int]:
        """Lease the leading blocks of ``keys`` present (a chain, root first) for ``ttl_s``:
        (lease id, blocks held); (None, 0) when the first is absent. Like the server's lease."""
        ks = list(keys)
        who = _name(holder or self.client, "lease holder", MAX_HOLDER)
        ms = _ttl_ms(ttl_s, "lease")
        if not ks:
            return None, 0
        lid = int.from_bytes(os.urandom(8), "little") >> 1 or 1
        since = int(time.time() * 1000)
        recs = [self._head(k) + b":lease:%016x" % lid for k in ks]
        got = self._run([("lease", [self._head(k), rec, self._head(k) + b":holds"], [ms, who, since, lid, len(ks)])
                         for k, rec in zip(ks, recs, strict=True)])
        held = next((i for i, ok in enumerate(got) if not ok), len(ks))
        past = [(rec, self._head(k) + b":holds") for k, rec, ok in zip(ks[held:], recs[held:], got[held:],
                                                                       strict=True) if ok]
        self._run([("drop", list(p), ["lease"]) for p in past])  # past a gap: not the chain's, not held
        if held == 0:
            return None, 0
        self._leases[lid] = (who, [self._head(k) + b":holds" for k in ks[:held]])
        return lid, held

    def release(self, lease_id: int) -> None:
        """Drop a lease this client took; LeaseExpiredError when every record of it lapsed already."""
        entry = self._leases.pop(lease_id, None)
        if entry is None:
            raise LeaseExpiredError(f"lease {lease_id} is not one of this client's live leases")
        _, holds = entry
        recs = [h[: -len(b":holds")] + b":lease:%016x" % lease_id for h in holds]
        got = self._run([("drop", [rec, h], ["lease"]) for rec, h in zip(recs, holds, strict=True)])
        if not any(got):
            raise LeaseExpiredError(f"lease {lease_id} lapsed at its TTL before it was released")

    # ------------------------------------------------------------------ pins
    def pin(self, keys: Sequence[bytes], reason: str = "", ttl_s: float = 0.0, holder: str | None = None) -> int:
        """Pin the present blocks of ``keys`` for ``holder`` (this client by default); ``ttl_s`` 0:
        :data:`DEFAULT_PIN_S`. Returns how many blocks were pinned."""
        who = _name(holder or self.client, "pin holder", MAX_HOLDER)
        why = _name(reason, "pin reason", MAX_REASON)
        ms = _ttl_ms(ttl_s or DEFAULT_PIN_S, "pin")
        since = int(time.time() * 1000)
        got = self._run([("pin", [self._head(k), self._head(k) + b":pin:" + who.encode(), self._head(k) + b":holds"],
                          [ms, who, why, since]) for k in keys])
        return sum(1 for c in got if c)

    def unpin(self, keys: Sequence[bytes], holder: str | None = None) -> int:
        who = _name(holder or self.client, "pin holder", MAX_HOLDER)
        got = self._run([("drop", [self._head(k) + b":pin:" + who.encode(), self._head(k) + b":holds"], ["pin"])
                         for k in keys])
        return sum(1 for c in got if c)

    # ------------------------------------------------------------------ reports
    def _books(self, keys: Sequence[bytes]) -> list[list[Any]]:
        return self._run([("book", [self._head(k), self._head(k) + b":holds"], [TRAILER_BYTES + MAX_OWN])
                          for k in keys])

    def _row(self, key: bytes, book: list[Any], now_ms: int) -> BlockOwners | None:
        strlen, pttl, tail, recs = book
        if not strlen:
            return None
        o = parse_own(tail)
        pins, leases = [], []
        for name, ttl, flat in recs:
            h = _hash(flat)
            left = None if ttl < 0 else ttl / 1000
            since = max(0.0, (now_ms - _int(h.get("since"))) / 1000)
            if b":pin:" in name:
                pins.append(PinRow(holder=h.get("holder", "?")[:MAX_HOLDER] or "?", reason=h.get("reason", "")[:256],
                                   since_s=since, expires_in_s=left, count=max(1, _int(h.get("count"), 1)),
                                   key=key.hex()))
            else:
                leases.append(LeaseRow(lease=max(1, _int(h.get("id"), 1)), holder=h.get("holder", "?")[:MAX_HOLDER]
                                       or "?", blocks=max(0, min(_int(h.get("blocks")), 1 << 20)),
                                       expires_in_s=0.0 if left is None else left))
        ver = self.tier._versions([key])[0]
        length = 0 if ver is None or ver.n < 0 else ver.n
        lt = Lifetime(o["lt"]) if o is not None and o.get("lt") in {x.value for x in Lifetime} else Lifetime.PREFIX
        return BlockOwners(key=key.hex(), tenant="redis", owner="pool:pool", state="stored",
                           since_s=max(0.0, (now_ms - int(o.get("t", now_ms))) / 1000) if o else 0.0,
                           handed_off_by=(o or {}).get("by", "")[:128], lifetime=lt,
                           expires_in_s=None if pttl < 0 else pttl / 1000, tiers=(self.tier.name,), length=length,
                           parent=(o or {}).get("p", "")[:32], children=0, pins=tuple(pins), leases=tuple(leases))

    def owners(self, keys: Sequence[bytes] = (), prefix: str = "") -> OwnersAnswer:
        """Rows for ``keys``; one key also brings the chain it ends (ancestors, root first, walked
        through the ``own`` records' parents); ``prefix``: every block whose key hex starts so."""
        now = int(time.time() * 1000)
        want: list[bytes] = []
        ks = list(keys)
        if len(ks) == 1:
            chain: list[bytes] = []
            cur: bytes | None = ks[0]
            while cur is not None and len(chain) < MAX_ROWS and cur not in chain:
                chain.append(cur)
                own = self.tier.own_of([cur])[0]
                cur = bytes.fromhex(own["p"]) if own and _is_key_hex(own.get("p")) else None
            want.extend(reversed(chain))
        else:
            want.extend(ks)
        if prefix:
            want.extend(k for k in self._scan_heads(prefix) if k not in want)
        rows = [r for k, b in zip(want[:MAX_ROWS], self._books(want[:MAX_ROWS]), strict=True)
                if (r := self._row(k, b, now)) is not None]
        kids: dict[str, int] = {}
        for r in rows:
            if r.parent:
                kids[r.parent] = kids.get(r.parent, 0) + 1
        rows = [replace(r, children=kids.get(r.key, 0)) for r in rows]
        return OwnersAnswer(tuple(rows), truncated=len(want) > MAX_ROWS)

    def leaks(self) -> LeaksAnswer:
        """Blocks without an own record and children whose parent is gone. Leases and pins past
        their TTL, records without their block: none here (Redis reaped the ones, the others are in
        their blocks)."""
        heads = sorted(k for k, rest in (_split(self.tier.prefix, n) for n in self._scan(b"*}")) if k and rest == b"")
        present = set(heads)
        owns: list[dict[str, Any] | None] = []
        for lo in range(0, len(heads), 1000):
            owns += self.tier.own_of(heads[lo : lo + 1000])
        without = [k.hex() for k, o in zip(heads, owns, strict=True) if o is None]
        orphans = [k.hex() for k, o in zip(heads, owns, strict=True)
                   if o is not None and _is_key_hex(o.get("p")) and bytes.fromhex(o["p"]) not in present]
        return LeaksAnswer((), (), tuple(without[:MAX_ROWS]), (), tuple(orphans[:MAX_ROWS]))

    # ------------------------------------------------------------------ reading
    def _scan(self, pattern: bytes) -> Iterable[bytes]:
        """Every key under this tier's prefix matching ``pattern`` after it (all primaries of a cluster)."""
        try:
            return list(self.tier._r.scan_iter(match=self.tier.prefix + b"{" + pattern, count=1000))
        except _REDIS_ERRORS as exc:
            raise _map(self.tier.name, exc) from exc

    def _scan_heads(self, prefix: str) -> list[bytes]:
        out = []
        for name in self._scan(prefix.encode() + b"*}"):
            inner, rest = _split(self.tier.prefix, name)
            if inner is not None and rest == b"":
                out.append(inner)
        return sorted(out)


def _split(prefix: bytes, name: bytes) -> tuple[bytes | None, bytes]:
    """(block key, what follows its hash tag) of a Redis key name under ``prefix``; (None, b"") else."""
    if not name.startswith(prefix + b"{"):
        return None, b""
    end = name.find(b"}", len(prefix))
    inner = name[len(prefix) + 1 : end]
    if end < 0 or len(inner) != 32:
        return None, b""
    try:
        return bytes.fromhex(inner.decode()), name[end + 1 :]
    except ValueError:
        return None, b""


def _is_key_hex(v: object) -> bool:
    return isinstance(v, str) and len(v) == 32 and all(c in "0123456789abcdef" for c in v)


