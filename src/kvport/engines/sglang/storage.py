"""``KVPortStorage``: kvport as SGLang HiCache's storage backend (its L3), loaded by module path::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvport",
            "module_path": "kvport.engines.sglang.storage", "class_name": "KVPortStorage",
            "interface_v1": 1, "kvport_disk_dir": "/var/kvport", "kvport_server": "127.0.0.1:7070"}'

``interface_v1`` makes SGLang call the zero-copy ``batch_exists`` / ``batch_get_v1`` /
``batch_set_v1`` with host-pool indices; the byte-copy ``get`` / ``set`` / ``batch_*`` calls work too.
The ``kvport_*`` keys are the vLLM connector's (:mod:`kvport.engines.vllm.config`: host RAM, a shared
disk folder, the kvport server, Redis, tenant salt, model revision, calibration profile, load
deadline), read by the same parser and opened by the same store port, so an SGLang engine and a vLLM
engine configure kvport alike.

Keys. SGLang names a page by a sha256 chained over its tokens (64 hex characters), without the TP
rank, the model or the KV format. kvport's key of a page is ``xxh3_128(root | "sglang" | hash)``, the
root being :class:`~kvport.keys.KeyContext`'s (the KV spec's fingerprint: model config and weights,
dtype, page size, TP rank and width, latent or not; and the tenant salt), so pages of another model,
rank or width are other keys: a miss, recomputed. Host layouts do not need to differ: every one is
converted to the one stored format (:mod:`.pages`).

Every stored page carries kvport's envelope (identity, key, one xxh3 per layer), checked before a
byte reaches the host pool; a page not intact is deleted and it and every page after it are reported
missing. Any error inside a call (a tier down, a deadline passed, a corrupt or evicted page, host
indices that are not whole pages) is a log line, a metric and a miss (or a failed save): never an
exception into SGLang's scheduler, never a page linked that was not checked. ``batch_exists`` asks
the cost planner (``kvport_profile``) whether loading the hit beats recomputing it, as the vLLM
connector does, and answers 0 when it does not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from kvport.extras import require

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
except ImportError:
    require("sglang", __name__)
    raise

import xxhash

from kvport import logs, metrics
from kvport.client.port import OpenedStore
from kvport.codec.envelope import block_format
from kvport.config import Settings
from kvport.deadline import Deadline
from kvport.engines.vllm.config import ConnectorConfig
from kvport.engines.vllm.gate import gate
from kvport.engines.vllm.identity import engine_spec
from kvport.engines.vllm.store import open_connector_store, read_checked
from kvport.errors import EngineError, KVPortError
from kvport.keys import KeyContext
from kvport.planner import Planner, Profile
from kvport.spec import KVSpec, Layout

from .pages import HostPages

log = logging.getLogger(__name__)

_PAGES = metrics.counter("sglang_storage_pages", "pages HiCache asked kvport's SGLang storage backend for, by "
                         "op (hit, miss, loaded, stored, refused: failed its envelope; failed: an error made "
                         "it a miss or a failed save; declined: the cost planner chose recompute)", ["op"])
_ERRORS = metrics.counter("sglang_storage_errors", "calls of kvport's SGLang storage backend that ended in an "
                          "error (turned into a miss or a failed save), by call", ["call"])
_SECONDS = metrics.counter("sglang_storage_seconds", "seconds kvport's SGLang storage backend spent, by call",
                           ["call"])

NAMESPACE = b"sglang.page.v1"
MAX_KEY_CHARS = 512  # a page name longer than this is refused (SGLang's are 64 hex characters)
DEFAULT_STAGING_PAGES = 32
T = TypeVar("T")


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


class _Slots:
    """``capacity`` stored values, allocated and touched once, reused by every call of one direction."""

    def __init__(self, value_bytes: int, header: int, capacity: int) -> None:
        self.array = np.ones((capacity, value_bytes), dtype=np.uint8)
        self.values = tuple(self.array[j].data for j in range(capacity))
        self.payloads = tuple(self.array[j, header:].data for j in range(capacity))
        self.lock = threading.Lock()
        self.capacity = capacity


class KVPortStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang ships no type information
    """HiCache's storage backend over a kvport store (see the module's docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        logs.attach(Settings.from_env().log_level)  # kvport's records in SGLang's log, with their time
        extra = dict(storage_config.extra_config or {})
        model = extra.pop("kvport_model_dir", None) or storage_config.model_name
        self.cfg = ConnectorConfig.from_extra_config(extra)
        self.storage_config = storage_config
        self.tp_rank, self.tp_size = int(storage_config.tp_rank), int(storage_config.tp_size)
        self.mla = bool(storage_config.is_mla_model)
        if any(int(getattr(storage_config, f, 1) or 1) > 1 for f in ("pp_size", "attn_cp_size", "dcp_size")):
            raise EngineError("kvport's SGLang backend keys pages by TP rank only: pipeline, attention context "
                              "and decode context parallelism (pages split across those ranks) are not supported")
        if self.mla and self.tp_size > 1 and self.cfg.host_capacity_bytes > 0:
            raise EngineError("MLA pages are written by TP rank 0 only: a host-RAM tier would keep them from the "
                              "other ranks; use kvport_disk_dir, kvport_server or kvport_redis alone")
        if not model or not Path(str(model)).is_dir():
            raise EngineError(f"kvport's SGLang backend needs the model as a local folder, got {model!r} "
                              "(its config and weights name the KV that pages are keyed by): serve a local "
                              "folder, or name it with kvport_model_dir in the extra config")
        self.model_dir = Path(str(model))
        self.planner = None if self.cfg.profile_path is None else Planner(Profile.load(self.cfg.profile_path))
        self.spec: KVSpec | None = None
        self.opened: OpenedStore | None = None
        self.pages: HostPages | None = None
        self._root = b""
        self._read_bps: float | None = None
        self._stats_lock = threading.Lock()
        self.stats = {"hit": 0, "miss": 0, "loaded": 0, "stored": 0, "refused": 0, "failed": 0, "declined": 0}

    # ------------------------------------------------------------------ set-up
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands over its host pool once it exists: the spec is checked against it, the store opened."""
        super().register_mem_pool_host(mem_pool_host)
        dtype = _dtype_name(mem_pool_host.dtype)
        if int(getattr(mem_pool_host, "layer_num", 0)) != int(getattr(mem_pool_host, "target_layer_num",
                                                                     getattr(mem_pool_host, "layer_num", 0))):
            raise EngineError("the host pool holds speculative decoding's draft layers beside the model's: "
                              "kvport's SGLang backend keys the model's layers only (not supported)")
        # a latent cache is replicated on every rank: its pages are the same on each (keyed at width 1)
        rank, width = (0, 1) if self.mla else (self.tp_rank, self.tp_size)
        spec = engine_spec(str(self.model_dir), dtype=dtype, block_size=int(mem_pool_host.page_size),
                           tp_size=width, tp_rank=rank, revision=self.cfg.model_revision, layout=Layout.VLLM_NHD)
        self.pages = HostPages(mem_pool_host, spec, mla=self.mla)
        self.spec = spec
        self.format = block_format(spec)
        self._root = KeyContext(spec.block_size, spec.fingerprint, self.cfg.tenant_salt).root + NAMESPACE
        cap = max(1, min(DEFAULT_STAGING_PAGES, self.cfg.staging_tokens // spec.block_size))
        self._get_slots = _Slots(self.format.value_bytes, self.format.header_len, cap)
        self._set_slots = _Slots(self.format.value_bytes, self.format.header_len, cap)
        self.opened = open_connector_store(self.cfg, spec)
        log.info("kvport SGLang storage: %s, %s layout, %d-token pages of %d bytes, rank %d of %d, tiers %s",
                 spec.model_id, self.pages.layout, spec.block_size, self.format.value_bytes, self.tp_rank,
                 self.tp_size, ", ".join(self.opened.store.tiers))

    @property
    def store(self) -> Any:
        if self.opened is None:
            raise EngineError("kvport's SGLang backend has no host pool yet (register_mem_pool_host)")
        return self.opened.store

    def _ready(self) -> tuple[KVSpec, HostPages]:
        if self.spec is None or self.pages is None or self.opened is None:
            raise EngineError("kvport's SGLang backend was never given SGLang's host pool (register_mem_pool_host)")
        return self.spec, self.pages

    def keys_of(self, names: Sequence[str]) -> list[bytes]:
        """kvport's key of each SGLang page name (EngineError for a name that is no page hash)."""
        out = []
        for name in names:
            if not isinstance(name, str) or not name or len(name) > MAX_KEY_CHARS:
                raise EngineError(f"page name {str(name)[:80]!r} is not an SGLang page hash")
            try:  # tagged: a hex name and a text name never hash alike
                raw = b"h" + bytes.fromhex(name)
            except ValueError:
                raw = b"s" + name.encode()
            out.append(xxhash.xxh3_128_digest(self._root + raw))
        return out

    def _parent(self, extra_info: HiCacheStorageExtraInfo | None) -> bytes | None:
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        if not prefix:
            return None
        return self.keys_of([prefix[-1]])[0]

    def _guard(self, call: str, fallback: T, fn: Callable[[], T]) -> T:
        """Run ``fn``; any error is logged, counted and answered with ``fallback`` (a miss / failed save)."""
        t0 = time.perf_counter()
        try:
            return fn()
        except Exception as exc:
            _ERRORS.labels(call=call).inc()
            level = logging.WARNING if isinstance(exc, KVPortError) else logging.ERROR
            log.log(level, "kvport SGLang storage: %s failed (%s: %s); SGLang recomputes", call,
                    type(exc).__name__, exc, exc_info=not isinstance(exc, KVPortError))
            return fallback
        finally:
            _SECONDS.labels(call=call).inc(time.perf_counter() - t0)

    def _count(self, op: str, n: int) -> None:
        if n:
            with self._stats_lock:
                self.stats[op] += n
            _PAGES.labels(op=op).inc(n)

    # ------------------------------------------------------------------ exists
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages kvport holds (0 when the planner says recomputing them is faster)."""
        return self._guard("batch_exists", 0, lambda: self._batch_exists(keys, extra_info))

    def _batch_exists(self, names: list[str], extra_info: HiCacheStorageExtraInfo | None) -> int:
        if not names:
            return 0
        spec, _ = self._ready()
        # a query waits on the store (and a shared tier) at most the load deadline's minimum: SGLang's
        # prefetch thread, and through its all-reduce every TP rank, waits on this answer
        hits = int(self.store.lookup(self.keys_of(names),
                                     deadline=self.cfg.load_deadline.for_expected(0.0)).prefix_blocks)
        self._count("hit", hits)
        self._count("miss", len(names) - hits)
        if hits and self.planner is not None:
            before = len(getattr(extra_info, "prefix_keys", None) or ())
            page = spec.block_size
            loaded = gate(self.planner, spec, (before + len(names)) * page, before * page, hits * page)
            if loaded == 0:
                self._count("declined", hits)
                return 0
        return hits

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------------ get
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Load pages into the host pool at ``host_indices``; True for each leading page loaded intact."""
        ok: list[bool] = self._guard("batch_get_v1", [], lambda: self._batch_get(keys, host_indices))
        return ok + [False] * (len(keys) - len(ok))

    def _deadline(self, n: int) -> Deadline:
        """One call's deadline: the policy's factor x what the observed read speed predicts for ``n`` pages."""
        bps = self._read_bps
        return self.cfg.load_deadline.for_expected(None if bps is None else n * self.format.value_bytes / bps)

    def _batch_get(self, names: list[str], host_indices: torch.Tensor) -> list[bool]:
        _, pages = self._ready()
        page_ids = pages.page_ids(host_indices, len(names))
        return self._load(names, "batch_get_v1", lambda at, payloads: pages.scatter(
            page_ids[at : at + len(payloads)], payloads))

    def _load(self, names: list[str], call: str, place: Callable[[int, Sequence[memoryview]], None]) -> list[bool]:
        """Read the pages of ``names`` chunk by chunk into the staging slots, all under one deadline, and
        hand each chunk's leading checked payloads to ``place(first page, payloads)``; True for each
        leading page placed. An error in a chunk ends the run there: pages placed before it stand."""
        keys = self.keys_of(names)
        deadline = self._deadline(len(keys))
        done: list[bool] = []
        slots = self._get_slots
        with slots.lock:
            for at in range(0, len(keys), slots.capacity):
                chunk = keys[at : at + slots.capacity]
                try:
                    good = self._read(chunk, slots, deadline)
                    place(at, slots.payloads[:good])
                except Exception as exc:  # pages placed before this chunk stand
                    _ERRORS.labels(call=call).inc()
                    log.warning("kvport SGLang storage: %s of %d pages failed (%s: %s); SGLang recomputes "
                                "from page %d", call, len(chunk), type(exc).__name__, exc, at)
                    good = 0
                done += [True] * good
                self._count("loaded", good)
                if good < len(chunk):
                    self._count("failed", len(keys) - at - good)
                    break
        return done

    def _read(self, keys: list[bytes], slots: _Slots, deadline: Deadline) -> int:
        """Read ``keys`` into the slots; how many leading ones arrived whole and passed their envelope."""
        r = read_checked(self.store, self.format, keys, slots.values[: len(keys)], deadline=deadline,
                         engine="SGLang")
        if r.whole and r.seconds > 0:
            bps = r.good * self.format.value_bytes / r.seconds
            self._read_bps = bps if self._read_bps is None else 0.7 * self._read_bps + 0.3 * bps
        self._count("refused", r.refused)
        return r.good

    # ------------------------------------------------------------------ set
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` under ``keys``; True for each page stored."""
        ok: list[bool] = self._guard("batch_set_v1", [], lambda: self._batch_set(keys, host_indices, extra_info))
        return ok + [False] * (len(keys) - len(ok))

    def _batch_set(self, names: list[str], host_indices: torch.Tensor,
                   extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        _, pages = self._ready()
        page_ids = pages.page_ids(host_indices, len(names))
        return self._save(names, self._parent(extra_info), lambda at, payloads: pages.gather(
            page_ids[at : at + len(payloads)], payloads))

    def _save(self, names: list[str], parent: bytes | None,
              fill: Callable[[int, Sequence[memoryview]], None]) -> list[bool]:
        """Store the pages of ``names`` chunk by chunk: ``fill(first page, payloads)`` writes a chunk's
        payloads into the save slots, each is sealed under its key and the chunk put as one chain under
        ``parent`` (the page before the first, if any)."""
        keys = self.keys_of(names)
        slots = self._set_slots
        done: list[bool] = []
        with slots.lock:
            for at in range(0, len(keys), slots.capacity):
                chunk = keys[at : at + slots.capacity]
                fill(at, slots.payloads[: len(chunk)])
                for j, key in enumerate(chunk):
                    self.format.seal(slots.values[j], key)
                self.store.put_many([(key, slots.values[j]) for j, key in enumerate(chunk)], parent=parent)
                parent = chunk[-1]
                done += [True] * len(chunk)
                self._count("stored", len(chunk))
        return done

    # ------------------------------------------------------------------ byte-copy calls (SGLang's generic path)
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        out = self.batch_get([key], [target_location], [target_sizes])
        return out[0] if out else None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Pages into flat tensors SGLang gives (``get_dummy_flat_data_page``: its layout-first page)."""
        return self._guard("batch_get", [None] * len(keys), lambda: self._batch_get_flat(keys, target_locations))

    def _batch_get_flat(self, names: list[str], targets: Any) -> list[torch.Tensor | None]:
        _, pages = self._ready()
        if targets is None or len(targets) != len(names):
            raise EngineError("batch_get needs one target tensor per key")

        def place(at: int, payloads: Sequence[memoryview]) -> None:
            for j, payload in enumerate(payloads):
                pages.flat_into(payload, targets[at + j])

        done = self._load(names, "batch_get", place)
        return [targets[i] if i < len(done) else None for i in range(len(names))]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Flat pages (``get_data_page``: the host layout's page, flattened) stored under ``keys``."""
        return self._guard("batch_set", False, lambda: self._batch_set_flat(keys, values))

    def _batch_set_flat(self, names: list[str], values: Any) -> bool:
        _, pages = self._ready()
        if values is None or len(values) != len(names):
            raise EngineError("batch_set needs one value per key")

        def fill(at: int, payloads: Sequence[memoryview]) -> None:
            for j, payload in enumerate(payloads):
                pages.block_from_flat(values[at + j], payload)

        return all(self._save(names, None, fill))

    # ------------------------------------------------------------------ the rest of HiCacheStorage
    def clear(self) -> None:
        """SGLang's ``/clear_hicache_storage_backend``: drops the pages held only in this engine's own
        tiers (host RAM, a disk folder not shared); what sits in a shared tier (a shared folder, Redis,
        the kvport server) stays: other engines, vLLM's among them, read it."""
        def run() -> None:
            store = self.store
            own = {name for name, tier in store.tiers.items() if not tier.caps.shared}
            for key in store.blocks():
                if set(store.where(key)) <= own:
                    store.delete(key)
        self._guard("clear", None, run)

    def get_stats(self) -> None:
        """SGLang's storage metrics (``--enable-storage-metrics``) expect its own ``StorageMetrics``;
        kvport's counters are its Prometheus metrics and :attr:`stats`."""
        return None

    def close(self) -> None:
        if self.opened is not None:
            self.opened.store.close()
            self.opened = None
