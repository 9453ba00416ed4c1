"""``kvport bench transfer``: KV between two processes over TCP and shared memory, against the raw
machine paths measured in the same run, plus layer-wise overlap and a 3x overload with and without
backpressure.

Fair comparisons (same process layout, same bytes, same buffers, trials interleaved):

* TCP: the parent sends, a spawned child receives into one preallocated destination (LKHTD block
  table). The raw baseline is plain ``sendall`` of 4 MiB memoryview slices of the *same* source and
  ``recv_into`` of 4 MiB slices of the *same* destination on a second connection to the same child,
  tuned like kvport's (``transfer.tcp.tune``: buffers, TCP_NODELAY, and on loopback a congestion
  control that does not pace; ``conditions.tcp_congestion`` says which both got); kvport sends LAYER
  frames of at most 4 MiB (64 KiB chunks, each checksummed with xxh3-64 on both sides, in ~1 MiB
  batches hashed right before each send; with more than two CPUs the hashing overlaps the socket
  calls, see ``protocol.sync``). ``tcp_producer_digests_*`` is the same transfer with checksums the
  producer already had (``send_layer(..., digests=)``, nothing hashed at send): what the sender's
  hashing costs. The generic ``evidence.limits.raw_socket_gbps`` (4 MiB reused receive buffer, system
  socket defaults) is reported beside it.
* Shared memory: the producer's KV lives in memory registered with the transport (one copy in all:
  the receiver copies and verifies it into its block table, see ``transfer.shm``). The producer
  writes the KV there block-layer by block-layer and takes each chunk's checksum right after writing
  it (``shm_producer_write_and_digest_s`` against ``shm_producer_write_s`` for the same writes
  without: the checksums' cost where they are made); those checksums travel with the transfer.
  ``shm_hash_at_send_*`` is the same transfer with the sender hashing every chunk, out of RAM, at
  each send. ``shm_vs_memcpy`` compares with
  numpy memcpy of the same bytes (from those shared pages into private memory, interleaved trials), and
  ``shm_vs_memcpy_limit`` with ``evidence.limits.memcpy_gbps`` (private, huge-page backed buffers; tmpfs
  here has no transparent huge pages). The unregistered path (copy in, copy out through the ring)
  is reported as ``shm_ring_copy_*``.
* Ideal lower bound: size / raw bandwidth (the calculator's transfer time) beside the measured time.
* Layer-wise overlap (``results.layerwise``, :func:`kvport.bench.transfer_load.layerwise_overlap`): the
  producer's compute is the reference model's real decoder-layer forward of a 2048-token prompt
  (``--quick``: 256; ``--set layerwise_tokens=N``), fp32 on the suite's one torch thread, each layer's
  KV sent while the next computes, over a link balanced against the measured layer compute.
  ``--set compute=sleep`` runs the stand-in (25 ms sleeps); ``results.layerwise.compute`` and
  ``conditions.layerwise_compute`` say which ran.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import socket
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from kvport import memops
from kvport.bench.harness import Report, SuiteOptions, conditions, finish
from kvport.bench.transfer_load import SleepCompute, layerwise_overlap, overload
from kvport.config import Settings
from kvport.errors import UserInputError
from kvport.evidence.limits import memcpy_gbps, raw_socket_gbps
from kvport.evidence.netlink import in_netns
from kvport.evidence.timing import gbps, ratio
from kvport.spec import DType, KVSpec, from_hf_config, from_preset
from kvport.transfer import BlockTableDestination, Receiver, Sender, TransferMeta
from kvport.transfer import shm as shm_mod
from kvport.transfer import tcp as tcp_mod

_RAW_CHUNK = 4 << 20
_FRAME = 4 << 20  # TCP LAYER frames: the raw baseline's sendall size
_SHM_FRAME = 32 << 20  # shared memory: one frame per layer (descriptors, no per-frame copy cost)


def _spec() -> KVSpec:
    return from_preset("llama-3.1-8b", block_size=16)  # bf16: 64 KiB per block-layer, 4 MiB per block


def _keys(n: int) -> tuple[bytes, ...]:
    return tuple(i.to_bytes(16, "little") for i in range(n))


# ---------------------------------------------------------------------- child process (receiver)
def _child(kind: str, where: int | str, nbytes: int, host: str = "127.0.0.1", secret: bytes | None = None) -> None:
    spec = _spec()
    nb = nbytes // spec.bytes_per_block
    dst = np.zeros((nb, spec.bytes_per_block), dtype=np.uint8)  # allocated and faulted once, reused
    if kind == "tcp":
        raw = socket.create_connection((host, int(where)))
        tcp_mod.tune(raw)
        t: Any = tcp_mod.connect(host, int(where), secret=secret, timeout_s=120)
    else:
        raw = None
        t = shm_mod.connect(str(where), timeout_s=120)
    rx = Receiver(t, spec, lambda m: BlockTableDestination(dst, range(nb), m), budget_bytes=nbytes)
    th = rx.start()
    if raw is not None:  # raw rounds: until the parent closes the raw connection
        mv = dst.data.cast("B")
        try:
            while True:
                for off in range(0, nbytes, _RAW_CHUNK):
                    view = mv[off : off + _RAW_CHUNK]
                    got = 0
                    while got < view.nbytes:
                        n = raw.recv_into(view[got:])
                        if n == 0:
                            raise EOFError
                        got += n
                raw.sendall(b"k")
        except (EOFError, OSError):
            pass
        raw.close()
    th.join()


def _layer_views(src: np.ndarray, spec: KVSpec) -> list[list[memoryview]]:
    lb = spec.bytes_per_layer_block
    return [[src[i, layer * lb : (layer + 1) * lb].data for i in range(src.shape[0])]
            for layer in range(spec.num_layers)]


def _median_gbps(nbytes: int, times: list[float]) -> float | None:
    return None if not times else gbps(nbytes, statistics.median(times))


@contextlib.contextmanager
def _receiver_child(kind: str, listener: Any, where: int | str, nbytes: int, host: str = "127.0.0.1",
                    secret: bytes | None = None, netns: str | None = None) -> Iterator[None]:
    """The receiving child process for the duration (in network namespace ``netns``: the other host
    of an emulated link); the listener is closed and the child reaped after."""
    proc = mp.get_context("spawn").Process(target=_child, args=(kind, where, nbytes, host, secret), daemon=True)
    with contextlib.nullcontext() if netns is None else in_netns(netns):  # the child inherits it
        proc.start()
    try:
        yield
    finally:
        listener.close()
        proc.join(20)
        if proc.is_alive():
            proc.kill()


def _tcp(nbytes: int, trials: int, host: str = "127.0.0.1", secret: bytes | None = None,
         netns: str | None = None) -> dict[str, Any]:
    """kvport's TCP transfer against raw sockets, this process sending: on loopback, or (``host``,
    ``netns``) from this process's namespace to a child in ``netns`` across an emulated link."""
    spec = _spec()
    nb = nbytes // spec.bytes_per_block
    listener = tcp_mod.TcpListener(host, secret=secret)
    with _receiver_child("tcp", listener, listener.port, nbytes, host, secret, netns):
        listener.sock.settimeout(60)
        raw, _ = listener.sock.accept()
        tcp_mod.tune(raw)
        t = listener.accept(timeout_s=60)
        t.settimeout(120)
        sender = Sender(t, max_frame_bytes=_FRAME)
        src = np.ones((nb, spec.bytes_per_block), dtype=np.uint8)
        views = _layer_views(src, spec)
        meta = TransferMeta(spec, "bench", _keys(nb))
        flat = src.data.cast("B")
        digests = [memops.xxh3_many(layer) for layer in views]
        congestion = {"kvport": _congestion(t.sock), "raw_same_layout": _congestion(raw)}
        raw_t: list[float] = []
        kv_t: list[float] = []
        known_t: list[float] = []
        for r in range(trials + 1):  # first round of each is a warm-up
            t0 = time.perf_counter()
            for off in range(0, nbytes, _RAW_CHUNK):
                raw.sendall(flat[off : off + _RAW_CHUNK])
            raw.recv(1)
            t1 = time.perf_counter()
            sender.send(meta, lambda layer: views[layer])
            t2 = time.perf_counter()
            sender.send(meta, lambda layer: views[layer], layer_digests=lambda layer: digests[layer])
            t3 = time.perf_counter()
            if r:
                raw_t.append(t1 - t0)
                kv_t.append(t2 - t1)
                known_t.append(t3 - t2)
        raw.close()
        sender.close()
    raw_gbps, kv_gbps = _median_gbps(nbytes, raw_t), _median_gbps(nbytes, kv_t)
    return {"raw_same_layout_gbps": raw_gbps, "tcp_gbps": kv_gbps, "tcp_median_s": statistics.median(kv_t),
            "raw_median_s": statistics.median(raw_t), "tcp_trials_s": kv_t, "raw_trials_s": raw_t,
            "producer_digests_gbps": _median_gbps(nbytes, known_t), "producer_digests_trials_s": known_t,
            "congestion": congestion}


def _congestion(sock: socket.socket) -> str | None:
    """The TCP congestion control a socket got (None where the platform does not say)."""
    opt = getattr(socket, "TCP_CONGESTION", None)
    if opt is None:
        return None
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, opt, 16).rstrip(b"\0").decode()
    except OSError:
        return None


def _produce(reg_views: list[list[memoryview]], src_views: list[list[memoryview]]
             ) -> tuple[dict[str, float], list[bytes]]:
    """The producer writes its KV into registered memory block-layer by block-layer, plain and with
    each chunk's checksum taken right after it was written (still in cache): the digests the shm
    transfer then sends, and what they cost at write time (median of 3 of each, interleaved)."""
    plain: list[float] = []
    hashed: list[float] = []
    digests: list[bytes] = []
    for _ in range(3):
        t0 = time.perf_counter()
        for regs, srcs in zip(reg_views, src_views, strict=True):
            for d, c in zip(regs, srcs, strict=True):
                d[:] = c
        t1 = time.perf_counter()
        digests = []
        for regs, srcs in zip(reg_views, src_views, strict=True):
            layer = bytearray()
            for d, c in zip(regs, srcs, strict=True):
                d[:] = c
                layer += memops.xxh3_many([d])
            digests.append(bytes(layer))
        t2 = time.perf_counter()
        plain.append(t1 - t0)
        hashed.append(t2 - t1)
    return {"write_s": statistics.median(plain), "write_and_digest_s": statistics.median(hashed)}, digests


def _shm(nbytes: int, trials: int) -> dict[str, Any]:
    spec = _spec()
    nb = nbytes // spec.bytes_per_block
    listener = shm_mod.ShmListener()
    with _receiver_child("shm", listener, listener.address, nbytes):
        t = listener.accept(timeout_s=60)
        sender = Sender(t, max_frame_bytes=_SHM_FRAME, batch_bytes=_SHM_FRAME)
        reg = np.frombuffer(t.register(nbytes), dtype=np.uint8).reshape(nb, spec.bytes_per_block)
        reg.fill(1)
        plain = np.ones((nb, spec.bytes_per_block), dtype=np.uint8)
        copy_dst = np.zeros_like(plain)
        reg_views, plain_views = _layer_views(reg, spec), _layer_views(plain, spec)
        produced, digests = _produce(reg_views, plain_views)
        meta = TransferMeta(spec, "bench", _keys(nb))
        times: dict[str, list[float]] = {"memcpy": [], "shm": [], "hash_at_send": [], "ring": []}
        for r in range(trials + 1):
            t0 = time.perf_counter()
            np.copyto(copy_dst, reg)  # memcpy of the same bytes: from the shared pages to private memory
            t1 = time.perf_counter()
            sender.send(meta, lambda layer: reg_views[layer], layer_digests=lambda layer: digests[layer])
            t2 = time.perf_counter()
            sender.send(meta, lambda layer: reg_views[layer])
            t3 = time.perf_counter()
            sender.send(meta, lambda layer: plain_views[layer])
            t4 = time.perf_counter()
            if r:
                for k, dt in (("memcpy", t1 - t0), ("shm", t2 - t1), ("hash_at_send", t3 - t2), ("ring", t4 - t3)):
                    times[k].append(dt)
        sender.close()
    return {"memcpy_same_run_gbps": _median_gbps(nbytes, times["memcpy"]),
            "shm_gbps": _median_gbps(nbytes, times["shm"]),
            "shm_median_s": statistics.median(times["shm"]),
            "shm_hash_at_send_gbps": _median_gbps(nbytes, times["hash_at_send"]),
            "shm_ring_copy_gbps": _median_gbps(nbytes, times["ring"]), "producer": produced,
            "shm_trials_s": times["shm"], "hash_at_send_trials_s": times["hash_at_send"],
            "memcpy_trials_s": times["memcpy"]}


# ---------------------------------------------------------------------- layer-wise overlap
_LAYERWISE_TOKENS = 2048  # the full run's prompt; --quick: 256


class ModelLayerCompute:
    """The reference model's real layer compute for :func:`layerwise_overlap`: one fp32 prefill of a
    real prompt on the current torch threads; a forward hook after each decoder layer copies that
    layer's K/V from the ``DynamicCache`` into LKHTD blocks (as the demo's prefill worker does) and
    hands them on while the next layer computes. A layer's time runs from the end of the previous
    hand-off (the embedding counts in layer 0) to the end of its copy."""

    def __init__(self, model: Any, spec: KVSpec, ids: Any, name: str) -> None:
        tokens = int(ids.shape[1])
        if tokens % spec.block_size:
            raise UserInputError(f"layer-wise prompt of {tokens} tokens is not whole blocks of {spec.block_size}")
        self.model, self.spec, self.ids = model, spec, ids
        self.n_blocks = tokens // spec.block_size
        self._buf = np.zeros(self.n_blocks * spec.bytes_per_block, dtype=np.uint8)
        self._rows = self._buf.reshape(self.n_blocks, spec.bytes_per_block)
        import torch

        n = torch.get_num_threads()
        self.description = (f"{name} layer forward, {tokens} tokens (fp32, {n} torch thread{'s' * (n != 1)}, "
                            f"each layer's KV copied into LKHTD blocks)")

    def run(self, on_layer: Callable[[int, Sequence[memoryview]], None]) -> list[float]:
        import torch
        from transformers import DynamicCache

        from kvport.planner.hfkv import block_view

        spec, nb = self.spec, self.n_blocks
        h, bs, d, lb = spec.kv_heads_per_rank, spec.block_size, spec.head_dim, spec.bytes_per_layer_block
        blocks = block_view(self._buf, spec, nb)
        cache = DynamicCache(config=self.model.config)
        times: list[float] = []
        mark = [0.0]

        def hook(i: int) -> Callable[..., None]:
            def after_layer(_module: Any, _args: Any, _out: Any) -> None:
                lyr = cache.layers[i]
                for kv, t in ((0, lyr.keys), (1, lyr.values)):
                    blocks[:, i, kv].copy_(t[0].reshape(h, nb, bs, d).permute(1, 0, 2, 3))
                times.append(time.perf_counter() - mark[0])
                on_layer(i, [self._rows[j, i * lb : (i + 1) * lb].data for j in range(nb)])
                mark[0] = time.perf_counter()

            return after_layer

        handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(self.model.model.layers)]
        try:
            with torch.inference_mode():
                mark[0] = time.perf_counter()
                self.model(self.ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        finally:
            for hd in handles:
                hd.remove()
        return times


def _layerwise(opts: SuiteOptions) -> dict[str, Any]:
    """``--set compute=model`` (default): the reference model's layers; ``compute=sleep``: the stand-in."""
    kind = str(opts.extra.get("compute", "model"))
    if kind == "sleep":
        return layerwise_overlap(SleepCompute(8 if opts.quick else 16, 0.025), layer_transfer_s=0.025)
    if kind != "model":
        raise UserInputError(f"--set compute={kind}: expected model or sleep")
    from kvport.planner.calibrate import reference_ids
    from kvport.refmodel import MODEL_ID, load

    model_dir = Settings.from_env().model_dir
    model, tok = load(model_dir)
    spec = from_hf_config(model_dir, dtype=DType.FP32, model_id=MODEL_ID)
    tokens = int(opts.extra.get("layerwise_tokens", 256 if opts.quick else _LAYERWISE_TOKENS))
    compute = ModelLayerCompute(model, spec, reference_ids(tok, tokens), "smollm2-135m")
    return layerwise_overlap(compute)


def run(opts: SuiteOptions) -> Report:
    import torch

    torch.set_num_threads(1)
    spec = _spec()
    cond = conditions(model=spec.model_id, dtype=spec.dtype.value, block_size=spec.block_size,
                      chunk_bytes=spec.bytes_per_layer_block, frame_bytes=_FRAME, shm_frame_bytes=_SHM_FRAME,
                      raw_chunk_bytes=_RAW_CHUNK, link="tcp 127.0.0.1 / shm same host", threads=1,
                      process_layout="parent sends, spawned child receives",
                      shm_sender_checksums="shm_*: the producer's, taken as it wrote each block-layer into "
                                           "registered memory (results.shm_producer_write_and_digest_s against "
                                           "shm_producer_write_s without them), not re-hashed per send; "
                                           "shm_hash_at_send_*: the sender hashes every chunk on every send")
    nbytes = int(opts.extra.get("mib", 64 if opts.quick else 256)) << 20
    trials = int(opts.extra.get("trials", 2 if opts.quick else 5))
    overload_s = opts.extra.get("overload_s")
    limits: dict[str, Any] = {
        "memcpy_gbps": memcpy_gbps(nbytes, trials),
        "raw_socket_gbps": raw_socket_gbps(nbytes, trials=2 if opts.quick else 3),
    }
    tcp = _tcp(nbytes, trials)
    sh = _shm(nbytes, trials)
    limits["raw_socket_same_layout_gbps"] = tcp["raw_same_layout_gbps"]
    limits["memcpy_same_bytes_gbps"] = sh["memcpy_same_run_gbps"]
    raw_bps = (tcp["raw_same_layout_gbps"] or 0) * 1e9
    mc_bps = (sh["memcpy_same_run_gbps"] or 0) * 1e9
    results: dict[str, Any] = {
        "bytes": nbytes,
        "tcp_gbps": tcp["tcp_gbps"],
        "tcp_vs_raw_socket": ratio(tcp["tcp_gbps"], tcp["raw_same_layout_gbps"]),
        "tcp_vs_raw_socket_generic": ratio(tcp["tcp_gbps"], limits["raw_socket_gbps"]),
        "tcp_producer_digests_gbps": tcp["producer_digests_gbps"],
        "tcp_producer_digests_vs_raw_socket": ratio(tcp["producer_digests_gbps"], tcp["raw_same_layout_gbps"]),
        "tcp_time": {"measured_s": round(tcp["tcp_median_s"], 4),
                     "ideal_s": round(nbytes / raw_bps, 4) if raw_bps else None,
                     "trials_s": [round(x, 4) for x in tcp["tcp_trials_s"]],
                     "raw_trials_s": [round(x, 4) for x in tcp["raw_trials_s"]],
                     "producer_digests_trials_s": [round(x, 4) for x in tcp["producer_digests_trials_s"]]},
        "shm_gbps": sh["shm_gbps"],
        "shm_vs_memcpy": ratio(sh["shm_gbps"], sh["memcpy_same_run_gbps"]),
        "shm_vs_memcpy_limit": ratio(sh["shm_gbps"], limits["memcpy_gbps"]),
        "shm_hash_at_send_gbps": sh["shm_hash_at_send_gbps"],
        "shm_hash_at_send_vs_memcpy": ratio(sh["shm_hash_at_send_gbps"], sh["memcpy_same_run_gbps"]),
        "shm_producer_write_s": round(sh["producer"]["write_s"], 4),
        "shm_producer_write_and_digest_s": round(sh["producer"]["write_and_digest_s"], 4),
        "shm_native_copy": memops.NATIVE,
        "shm_ring_copy_gbps": sh["shm_ring_copy_gbps"],
        "shm_ring_copy_vs_memcpy": ratio(sh["shm_ring_copy_gbps"], sh["memcpy_same_run_gbps"]),
        "shm_time": {"measured_s": round(sh["shm_median_s"], 4),
                     "ideal_s": round(nbytes / mc_bps, 4) if mc_bps else None,
                     "trials_s": [round(x, 4) for x in sh["shm_trials_s"]],
                     "hash_at_send_trials_s": [round(x, 4) for x in sh["hash_at_send_trials_s"]],
                     "memcpy_trials_s": [round(x, 4) for x in sh["memcpy_trials_s"]]},
        "layerwise": _layerwise(opts),
    }
    cond["layerwise_compute"] = results["layerwise"]["compute"]
    ov_s = None if overload_s is None else float(overload_s)
    results["overload"] = overload(backpressure=True, quick=opts.quick, duration_s=ov_s)
    results["overload_no_backpressure"] = overload(backpressure=False, quick=opts.quick, duration_s=ov_s)
    cond.update(tokens=(nbytes // spec.bytes_per_block) * spec.block_size, trials=trials,
                tcp_congestion=tcp["congestion"])
    return finish(Report("transfer", cond, limits, results))
