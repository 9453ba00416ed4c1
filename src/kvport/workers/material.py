# ruff: noqa: E501  (log lines and tool results keep their real width)
"""What the demo's long sessions paste: an incident log, a code module, a tool catalogue, tool results.

Written for kvport (no third-party text, nothing downloaded; the project's licence), realistic in
shape: a log with timestamps, request ids and latencies that change from line to line; a Python
module with docstrings and its tests; an agent's system prompt of tool descriptions with parameters
and rules; the JSON and log lines those tools return. Each text is split on newlines when a smaller workload cuts it
(:func:`kvport.workers.workload.default_workload`), so a cut keeps whole lines.
"""

from __future__ import annotations

CHAT_SYSTEM = (
    "You are Kestrel, the engineering assistant of a company that runs a photo storage service. "
    "Engineers paste logs, code and documents and ask about them. Answer in one or two short "
    "sentences, quote identifiers exactly as they appear, and say so when the pasted text does not "
    "contain the answer."
)

INCIDENT_LOG = """\
2026-11-18T02:14:07.118Z INFO  upload-gw-3  req=7f3a91c2 POST /v2/albums/88412/photos 201 size=4.1MB dur=412ms node=eu-west-1b
2026-11-18T02:14:12.338Z INFO  scheduler    cron=nightly-compaction shard=17 state=started owner=compactor-4
2026-11-18T02:14:12.912Z INFO  compactor-4  shard=17 segments=412 target=96 bytes_in=38.2GB
2026-11-18T02:14:15.661Z WARN  upload-gw-3  req=7f3a9231 slow metadata write: 902ms (budget 500ms) album=88412
2026-11-18T02:14:17.550Z ERROR meta-db-proxy pool=primary exhausted: 64/64 connections busy, 27 callers waiting
2026-11-18T02:14:17.553Z WARN  compactor-4  shard=17 holding 12 connections for segment merge batch 3 of 9
2026-11-18T02:14:18.019Z ERROR upload-gw-2  req=7f3a9247 POST /v2/albums/55010/photos 503 dur=2001ms error="metadata write timed out after 2000ms"
2026-11-18T02:14:18.020Z INFO  upload-gw-2  req=7f3a9247 blob kept in staging bucket for retry key=stg/55010/7f3a9247
2026-11-18T02:14:18.442Z ERROR upload-gw-1  req=7f3a924c POST /v2/albums/31876/photos 503 dur=2000ms error="metadata write timed out after 2000ms"
2026-11-18T02:14:19.005Z INFO  autoscaler   upload-gw replicas 3 -> 5 reason=p95_latency>1500ms
2026-11-18T02:14:20.113Z ERROR upload-gw-3  req=7f3a9251 POST /v2/albums/88412/photos 503 dur=2002ms error="metadata write timed out after 2000ms"
2026-11-18T02:14:20.377Z ERROR upload-gw-3  req=7f3a9258 POST /v2/albums/90003/photos 503 dur=2000ms error="metadata write timed out after 2000ms"
2026-11-18T02:14:23.940Z ERROR upload-gw-4  req=7f3a9270 POST /v2/albums/47120/photos 503 dur=2390ms error="metadata write timed out after 2000ms"
2026-11-18T02:14:25.006Z WARN  health       check=upload-success-rate value=0.71 threshold=0.95 window=60s
2026-11-18T02:14:25.007Z INFO  pager        incident=INC-2291 opened severity=2 service=upload-gw on-call=mbauer
2026-11-18T02:14:27.319Z ERROR upload-gw-5  req=7f3a9291 POST /v2/albums/55010/photos 503 dur=2001ms error="metadata write timed out after 2000ms"
2026-11-18T02:14:28.774Z WARN  meta-db      primary cpu=97% lock_waits=311 longest_txn=41s txn_owner=compactor-4
2026-11-18T02:14:30.662Z ERROR upload-gw-2  req=7f3a92a8 POST /v2/albums/61234/photos 503 dur=2000ms error="metadata write timed out after 2000ms"
2026-11-18T02:14:31.448Z INFO  mbauer       ack incident=INC-2291 "looking at meta-db lock waits"
2026-11-18T02:14:33.021Z WARN  compactor-4  shard=17 merge transaction open for 46s (soft limit 30s)
2026-11-18T02:14:35.870Z ERROR upload-gw-4  req=7f3a92c3 POST /v2/albums/88412/photos 503 dur=2000ms error="metadata write timed out after 2000ms"
2026-11-18T02:14:36.105Z INFO  mbauer       ran: kvctl compaction pause --shard 17 --reason INC-2291
2026-11-18T02:14:36.330Z INFO  scheduler    cron=nightly-compaction shard=17 state=pausing owner=compactor-4
2026-11-18T02:14:38.912Z INFO  compactor-4  shard=17 merge batch 4 committed, releasing 12 connections, paused at batch 5 of 9
2026-11-18T02:14:39.450Z INFO  meta-db-proxy pool=primary active=41/64 waiting=0 p99_wait=12ms
2026-11-18T02:14:40.633Z INFO  upload-gw-2  retry queue drained: 6 staged blobs committed (7f3a9247, 7f3a924c, 7f3a9251, 7f3a9258, 7f3a9270, 7f3a9291)
2026-11-18T02:14:41.207Z WARN  upload-gw-2  2 staged blobs not found for retry: 7f3a92a8, 7f3a92c3 (staging TTL 20s exceeded)
2026-11-18T02:14:43.880Z INFO  health       check=upload-success-rate value=0.98 threshold=0.95 window=60s
2026-11-18T02:14:52.118Z INFO  mbauer       note incident=INC-2291 "compaction on shard 17 held 12 of 64 primary connections in one long txn; paused"
2026-11-18T02:15:03.774Z INFO  pager        incident=INC-2291 resolved by=mbauer duration=38s customer_impact="11 uploads failed, 2 lost"
"""

QUOTA_MODULE = '''\
"""Storage quotas: what each account may still upload, reserved before a blob is written.

An upload first reserves its size (``reserve``), writes the blob, then commits (``commit``) or
gives the reservation back (``release``). Reservations expire: a gateway that dies mid-upload
leaves a reservation that ``sweep`` returns after ``RESERVATION_TTL_S`` seconds.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

RESERVATION_TTL_S = 900.0
GIB = 1 << 30


class QuotaExceeded(Exception):
    """The account has not enough room left for this upload."""

    def __init__(self, account: str, wanted: int, free: int) -> None:
        super().__init__(f"{account}: {wanted} bytes wanted, {free} free")
        self.account, self.wanted, self.free = account, wanted, free


@dataclass
class Reservation:
    account: str
    nbytes: int
    created: float
    upload_id: str


@dataclass
class Account:
    name: str
    limit: int
    used: int = 0
    reserved: int = 0
    history: list[tuple[float, int]] = field(default_factory=list)

    @property
    def free(self) -> int:
        return max(0, self.limit - self.used - self.reserved)


class QuotaBook:
    """All accounts' quotas in one process; every method is thread-safe."""

    def __init__(self, clock=time.monotonic) -> None:
        self._lock = threading.Lock()
        self._accounts: dict[str, Account] = {}
        self._open: dict[str, Reservation] = {}
        self._clock = clock

    def open_account(self, name: str, plan_gib: int) -> Account:
        with self._lock:
            acct = self._accounts.setdefault(name, Account(name, plan_gib * GIB))
            acct.limit = plan_gib * GIB
            return acct

    def reserve(self, account: str, nbytes: int, upload_id: str) -> Reservation:
        """Hold ``nbytes`` of the account's free space for one upload, or raise QuotaExceeded."""
        if nbytes <= 0:
            raise ValueError(f"a reservation needs a positive size, got {nbytes}")
        with self._lock:
            acct = self._accounts[account]
            if upload_id in self._open:
                return self._open[upload_id]  # a retried request: the same reservation
            if acct.free < nbytes:
                raise QuotaExceeded(account, nbytes, acct.free)
            acct.reserved += nbytes
            res = Reservation(account, nbytes, self._clock(), upload_id)
            self._open[upload_id] = res
            return res

    def commit(self, upload_id: str, stored_bytes: int) -> None:
        """The blob is written: its real size becomes used space, the reservation ends."""
        with self._lock:
            res = self._open.pop(upload_id)
            acct = self._accounts[res.account]
            acct.reserved -= res.nbytes
            acct.used += stored_bytes
            acct.history.append((self._clock(), stored_bytes))

    def release(self, upload_id: str) -> bool:
        """The upload failed: give its reservation back. False when it was already gone."""
        with self._lock:
            res = self._open.pop(upload_id, None)
            if res is None:
                return False
            self._accounts[res.account].reserved -= res.nbytes
            return True

    def refund(self, account: str, nbytes: int) -> None:
        """A photo was deleted: its bytes are free again (never below zero)."""
        with self._lock:
            acct = self._accounts[account]
            acct.used = max(0, acct.used - nbytes)
            acct.history.append((self._clock(), -nbytes))

    def sweep(self) -> list[str]:
        """Return the reservations older than RESERVATION_TTL_S; the ids of those released."""
        now = self._clock()
        with self._lock:
            stale = [r for r in self._open.values() if now - r.created > RESERVATION_TTL_S]
            for r in stale:
                del self._open[r.upload_id]
                self._accounts[r.account].reserved -= r.nbytes
        return [r.upload_id for r in stale]

    def usage(self, account: str, since: float | None = None) -> int:
        """Bytes the account added (uploads minus deletions) since ``since``, or in all."""
        with self._lock:
            rows = self._accounts[account].history
            return sum(n for t, n in rows if since is None or t >= since)

    def report(self) -> list[dict[str, int | str]]:
        with self._lock:
            return [{"account": a.name, "limit": a.limit, "used": a.used, "reserved": a.reserved,
                     "free": a.free, "open": sum(1 for r in self._open.values() if r.account == a.name)}
                    for a in sorted(self._accounts.values(), key=lambda a: a.name)]
'''

QUOTA_TESTS = '''\
import threading

import pytest

from quota import GIB, RESERVATION_TTL_S, QuotaBook, QuotaExceeded


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def book() -> QuotaBook:
    b = QuotaBook(clock=FakeClock())
    b.open_account("ana", plan_gib=1)
    return b


def test_reserve_commit_moves_reserved_to_used(book: QuotaBook) -> None:
    book.reserve("ana", 300, "up-1")
    book.commit("up-1", stored_bytes=280)
    row = book.report()[0]
    assert (row["used"], row["reserved"], row["open"]) == (280, 0, 0)


def test_a_retried_reserve_returns_the_same_reservation(book: QuotaBook) -> None:
    first = book.reserve("ana", 300, "up-1")
    assert book.reserve("ana", 300, "up-1") is first
    assert book.report()[0]["reserved"] == 300


def test_over_quota_is_refused_with_the_free_space(book: QuotaBook) -> None:
    book.reserve("ana", GIB - 10, "big")
    with pytest.raises(QuotaExceeded) as err:
        book.reserve("ana", 11, "small")
    assert err.value.free == 10


def test_release_twice_is_harmless(book: QuotaBook) -> None:
    book.reserve("ana", 300, "up-1")
    assert book.release("up-1") is True
    assert book.release("up-1") is False
    assert book.report()[0]["reserved"] == 0


def test_concurrent_reserves_never_exceed_the_limit(book: QuotaBook) -> None:
    ok: list[str] = []

    def worker(i: int) -> None:
        try:
            book.reserve("ana", GIB // 4, f"up-{i}")
            ok.append(f"up-{i}")
        except QuotaExceeded:
            pass

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ok) == 4


def test_refund_never_goes_below_zero(book: QuotaBook) -> None:
    book.reserve("ana", 100, "up-1")
    book.commit("up-1", stored_bytes=100)
    book.refund("ana", 500)
    assert book.report()[0]["used"] == 0
'''

TOOL_PROMPT = """\
You are Wren, the operations agent of a company that runs a photo storage service in three regions \
(eu-west, us-east, ap-south). You investigate incidents and failed jobs for the on-call engineer. \
You act only through the tools below. To call a tool, answer with exactly one JSON object on one \
line, {"tool": NAME, "arguments": {...}}, and nothing else; the result comes back in the next \
message, starting with "Tool result". When you know the answer, reply in plain text: the cause in \
one sentence, the evidence (ids, timestamps, values, quoted exactly), and the next step.

Rules:
- Read before you change anything. Tools marked CHANGES STATE need a reason, and the reason must \
name the incident or ticket id.
- Never restart a database primary, never delete backups, never change quotas.
- Prefer the narrowest time window that answers the question; logs are large.
- If two tools disagree, say so and trust the one closer to the source (the database over the proxy, \
the job runner over the scheduler).
- Times are UTC in RFC 3339. Sizes are bytes unless a unit is given.
- One tool call per message. Wait for its result before the next call; do not guess what a tool \
would have returned, and do not call the same tool twice with the same arguments.

Tools:

1. search_logs(service: string, query: string, since: string, until: string, limit: int = 50)
   Full-text search over one service's logs. `query` uses the log query language: words, "quoted \
phrases", field filters such as level:ERROR, req:7f3a*, node:eu-west-1b, and AND / OR / NOT. \
Returns up to `limit` lines, newest first, with a `truncated` flag. Services: upload-gw, \
thumbnailer, meta-db, meta-db-proxy, compactor, scheduler, backup-runner, autoscaler, cdn-edge.

2. get_metric(name: string, region: string, since: string, until: string, step: string = "60s", \
agg: string = "avg")
   A time series from the metrics store. Common names: upload.latency.p95 (ms), \
upload.success_rate (0..1), meta_db.pool.active, meta_db.pool.waiting, meta_db.cpu (%), \
meta_db.lock_waits, backup.bytes_written, backup.duration_s, cdn.egress_gbps, disk.free_bytes \
(label host). `agg` is one of avg, max, min, sum, p95. Returns [{"t": ..., "v": ...}].

3. get_job_runs(job: string, limit: int = 10)
   The latest runs of a scheduled job, newest first: run id, state (succeeded, failed, running, \
cancelled), start and end time, exit code, host, and the last 5 lines of its output. Jobs include \
nightly-compaction, nightly-backup-billing, nightly-backup-meta, thumbnail-backfill, \
cdn-log-export, quota-recount.

4. read_job_output(run_id: string, offset: int = 0, lines: int = 200)
   Lines of one job run's full output, from `offset`. Use get_job_runs first to find the run id.

5. describe_host(host: string)
   Host facts: role, region, zone, kernel, uptime, CPU count, memory, disks (mount point, size, \
free bytes, inode use), the services running there with their versions, recent reboots.

6. list_deploys(service: string, since: string)
   Deploys of a service since a time: version, author, time, change summary, and whether it was \
rolled back. Useful when a problem starts at a precise moment.

7. get_config(service: string, key: string = "")
   The live configuration of a service, or of one key in it (dotted path, e.g. pool.size or \
retry.staging_ttl_s), with the commit that last changed it.

8. query_db(database: string, sql: string)
   A read-only SQL query against a replica (never the primary) of: meta, billing, quotas. Runs \
with a 10 s timeout and returns at most 100 rows. Statements other than SELECT are refused.

9. pause_job(job: string, reason: string)   CHANGES STATE
   Pause a scheduled job so that no new run starts and a running one stops at its next checkpoint. \
Returns the job's new state.

10. resume_job(job: string, reason: string)   CHANGES STATE
   Resume a paused job; the next run starts at its scheduled time, not at once.

11. scale_service(service: string, region: string, replicas: int, reason: string)   CHANGES STATE
   Set the replica count of a stateless service (upload-gw, thumbnailer, cdn-edge only). The \
autoscaler may change it again within 5 minutes unless it is paused for the service.

12. open_ticket(title: string, body: string, severity: int, team: string)   CHANGES STATE
   Open a ticket for a team (storage, platform, network, billing). Severity 1 is the highest. \
Returns the ticket id. Put the evidence in the body, not only the conclusion.

13. notify(channel: string, message: string)   CHANGES STATE
   Post a short message to a chat channel, e.g. #incidents or #storage-oncall. At most 300 \
characters; no secrets, no customer data.

14. get_alerts(region: string = "", since: string = "", state: string = "firing")
   Alerts from the monitoring system: name, severity, labels, when it started, when it resolved, and \
the runbook link. `state` is firing, resolved or all. An alert that fires and resolves within two \
minutes is flapping; say so instead of treating it as the cause.

15. rollback_deploy(service: string, to_version: string, reason: string)   CHANGES STATE
   Roll a service back to an earlier version that list_deploys reported, region by region, with a \
health check between regions. Refused for databases and for versions older than 30 days. Only \
suggest it unless the on-call engineer asked you to act; when you do act, notify #incidents.

Answers, once you have the evidence:
- Start with the cause in one sentence, e.g. "The backup failed because its spool volume was full."
- Then the evidence as short quotes: run ids, hosts, timestamps, config keys with their values.
- Then one next step, and who should take it (a team or the on-call engineer). Do not repeat \
the tool results in full, and do not guess values that no tool returned.

Examples of good calls:
{"tool": "get_job_runs", "arguments": {"job": "nightly-backup-billing", "limit": 3}}
{"tool": "search_logs", "arguments": {"service": "meta-db-proxy", "query": "level:ERROR exhausted", \
"since": "2026-11-18T02:00:00Z", "until": "2026-11-18T02:30:00Z", "limit": 20}}
{"tool": "get_metric", "arguments": {"name": "meta_db.pool.waiting", "region": "eu-west", \
"since": "2026-11-18T02:00:00Z", "until": "2026-11-18T02:30:00Z", "step": "30s", "agg": "max"}}

Examples of bad calls, and why:
- {"tool": "query_db", "arguments": {"database": "meta", "sql": "DELETE FROM uploads"}}: not a SELECT.
- {"tool": "search_logs", "arguments": {"service": "upload-gw", "query": "error"}}: no time window.
- {"tool": "scale_service", "arguments": {"service": "meta-db", "region": "eu-west", "replicas": 3}}: \
meta-db is not stateless, and there is no reason.
"""

BACKUP_TASK = (
    "The nightly backup of the billing database failed twice this week (ticket OPS-4471). Find out why "
    "and tell me what to change. Start by looking at the job's recent runs."
)

BACKUP_RESULTS = (
    """Tool result (get_job_runs): bk-20261119-0200 failed, exit 28, host bk-runner-2, last line \
"write /var/spool/bk/billing.part413: no space left on device"; bk-20261118-0200 succeeded on bk-runner-1; \
bk-20261117-0200 failed, exit 28, host bk-runner-2.""",
    """Tool result (describe_host): bk-runner-2, backup-runner in eu-west, up 41 days; / 50 GiB with 31.2 GiB \
free; /var/spool/bk 200 GiB with 2.1 GiB free, 184 GiB of it in /var/spool/bk/stale/ (files from 2026-10-02 \
to 2026-11-19).""",
    """Tool result (get_config): {"service": "backup-runner", "key": "spool", "value": {"dir": "/var/spool/bk", \
"cleanup_on_failure": false, "stale_dir": "/var/spool/bk/stale", "max_age_days": null}, \
"commit": "c81f0e2 (2026-10-01, a.ruiz): keep failed spools for debugging"}""",
    """Tool result (list_deploys): [{"service": "backup-runner", "version": "3.8.1", "author": "a.ruiz", \
"time": "2026-10-01T14:22:10Z", "summary": "keep spool files of failed runs in stale/ for debugging", \
"rolled_back": false}]""",
)

UPLOAD_TASK = (
    "Customers in eu-west say photo uploads have been slow since about 09:00 today (ticket SUP-10342). "
    "Find out what changed and whether it is still happening."
)

UPLOAD_RESULTS = (
    """Tool result (get_metric): upload.latency.p95 in eu-west (ms): 08:00 410, 08:30 415, 09:00 1260, \
09:30 1290, 10:00 1302; us-east and ap-south flat at 380-420 over the same window.""",
    """Tool result (list_deploys): upload-gw 2026.11.4 by j.okafor at 2026-11-20T08:58:41Z, "thumbnails \
generated inline for albums with cover auto-update; new config thumbnailer.inline_sizes"; 2026.11.3 by l.chen \
at 2026-11-17T10:03:12Z, "metadata pool size 8 -> 16".""",
    """Tool result (get_config): {"service": "upload-gw", "key": "thumbnailer.inline_sizes", \
"value": {"eu-west": [256, 1024, 2048], "us-east": [], "ap-south": []}, \
"commit": "9d02b7a (2026-11-20, j.okafor): enable inline thumbnails in eu-west first"}""",
    """Tool result (search_logs): 3 of 812 lines, newest first: \
2026-11-20T10:04:51Z WARN upload-gw-2 req=a91c0f33 inline thumbnail 2048px took 733ms (album=71120 cover_auto=true); \
2026-11-20T10:04:49Z WARN upload-gw-1 req=a91c0f1d inline thumbnail 2048px took 802ms (album=30511 cover_auto=true); \
2026-11-20T10:04:47Z INFO upload-gw-1 req=a91c0f02 POST /v2/albums/30511/photos 201 dur=1288ms""",
)

CHAT_LOG_QUESTIONS = (
    "Which request ids failed, and what did they have in common?",
    "Were any uploads lost for good, and why those?",
    "What should we change first so that this cannot happen again?",
    "Write a two-sentence summary of INC-2291 for the status page.",
)

CHAT_CODE_QUESTIONS = (
    "What happens when the same upload_id is reserved twice?",
    "Can reserved go negative? Point to the line.",
    "How would you test sweep without waiting fifteen minutes?",
    "Thanks, that is all for now.",
)
