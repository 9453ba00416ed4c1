"""One tensor-parallel rank of the transformers engine, prefill or decode, for a re-shard between TP
widths (``kvport bench reshard`` drives them; :mod:`kvport.transfer.reshard` is the mechanism).

Every rank is a process of a gloo process group of its side's width (transformers' ``tp_plan``: the
rank computes, and caches, its KV heads only). ``cfg``: ``role`` (prefill | decode), ``rank``,
``size``, ``master_port`` (its side's group), ``model_dir``, ``prompt`` (token ids), ``request_id``,
``max_new_tokens``; a decode rank also ``timeout_s``, a prefill rank ``destinations`` (every decode
rank's hand-off address, in rank order), ``decode_size`` and ``drop`` (sends nothing: a rank lost
before its hand-off); every rank ``secret``, the run's hand-off secret (hex), as the demo's workers get
it (over the spawn pipe, never on a command line).

::

    decode rank r of D                                  prefill rank p of P
      listen (Receiver(reshard=True) into Assemblies)     prefill(prompt): this rank's heads, all layers
      -> ready {address}, then wait for "go"              blocks = the prompt's full blocks (LKHTD)
      take(request, keys checked against the prompt)      for each decode rank r: the heads both hold
      store the blocks under this rank's keys               (piece_for) -> split -> one transfer to r
      generate(prompt): every block loaded, the ranks     -> {sent_bytes, first_token}
        agreeing on the prefix -> {tokens, cached_tokens}

A decode rank whose heads do not all arrive in ``timeout_s`` reports the ReshardError and
generates by recomputing (the group agrees on 0 blocks), so the output stays the one-process answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvport.config import export
from kvport.errors import KVPortError
from kvport.workers import messages
from kvport.workers.quiet import quiet_transformers

_START_S = 300.0  # a decode rank waits this long for its driver's "go" (the prefill ranks loading)


def _join_group(cfg: dict[str, Any]) -> None:
    """The environment transformers' ``tp_plan`` reads to join this side's gloo group."""
    if cfg["size"] > 1:
        export({"RANK": str(cfg["rank"]), "LOCAL_RANK": str(cfg["rank"]), "WORLD_SIZE": str(cfg["size"]),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(cfg["master_port"])})


def main(conn: Connection, cfg: dict[str, Any]) -> None:
    try:
        torch.set_num_threads(1)
        quiet_transformers()
        _join_group(cfg)
        from kvport.engines.hf import HFEngine

        engine = HFEngine.from_model_dir(Path(cfg["model_dir"]), None, tp_plan=cfg["size"] > 1)
        secret = bytes.fromhex(str(cfg["secret"]))
        run = _decode if cfg["role"] == "decode" else _prefill
        messages.send(conn, {"op": "result", "ok": True, **run(conn, cfg, engine, secret)})
    except KVPortError as exc:
        messages.send(conn, {"op": "result", "ok": False, "error": f"{type(exc).__name__}: {exc}"})
    except Exception as exc:  # a worker reports every failure to its driver, then ends
        messages.send(conn, {"op": "result", "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        if cfg.get("size", 1) > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _prompt_blocks(engine: Any, prompt: np.ndarray) -> int:
    """The prompt's blocks that travel: all full ones but a last token that is always computed."""
    return int((len(prompt) - 1) // engine.spec.block_size)


def _prefill(conn: Connection, cfg: dict[str, Any], engine: Any, secret: bytes) -> dict[str, Any]:
    from kvport.engines.hf import cache_layers
    from kvport.transfer import TransferMeta
    from kvport.transfer.handoff import HandoffDialer
    from kvport.transfer.reshard import piece_for, piece_keys, split

    messages.send(conn, {"op": "ready", "ok": True})
    prompt = np.asarray(cfg["prompt"], dtype=np.int64)
    spec, n = engine.spec, _prompt_blocks(engine, prompt)
    t0 = time.perf_counter()
    pf = engine.prefill(prompt)
    t_prefill = time.perf_counter() - t0
    blocks = engine.layout.scatter_from_cache(cache_layers(pf.cache), 0, n).numpy().reshape(n, -1).view(np.uint8)
    dests: list[str] = list(cfg["destinations"])
    dialer = HandoffDialer(secret, dests)
    sent, pieces = 0, []
    t1 = time.perf_counter()
    try:
        for r, addr in enumerate(dests):
            piece = piece_for(spec, spec.for_rank(r, int(cfg["decode_size"])))
            if piece is None or cfg.get("drop"):  # drop: a rank that dies before it sends (fault injection)
                continue
            part = split(blocks, spec, piece)
            keys = piece_keys(prompt[: n * spec.block_size], piece)
            s = dialer.sender(addr)
            h = s.send(TransferMeta(piece, cfg["request_id"], tuple(keys)), _layer_views(part))
            dialer.keep(addr, s)
            sent += h.sent_bytes
            pieces.append([r, *piece.head_range])
    finally:
        dialer.close()
    return {"sent_bytes": sent, "pieces": pieces, "first_token": pf.first_token, "prefill_s": t_prefill,
            "send_s": time.perf_counter() - t1, "blocks": n, "block_bytes": spec.bytes_per_block}


def _layer_views(part: np.ndarray) -> Callable[[int], list[memoryview]]:
    """Layer ``la`` of every block of a split piece, one view per block (what ``Sender.send`` reads)."""
    return lambda la: [part[i, la].data for i in range(part.shape[0])]


def _decode(conn: Connection, cfg: dict[str, Any], engine: Any, secret: bytes) -> dict[str, Any]:
    from kvport.codec.envelope import stored_bytes
    from kvport.engines.hf import Lifetime, StoreBlocks
    from kvport.store import TieredStore, TierPolicy
    from kvport.tiers import HostTier
    from kvport.transfer.handoff import HandoffListener
    from kvport.transfer.reshard import Assemblies, piece_keys

    spec = engine.spec
    prompt = np.asarray(cfg["prompt"], dtype=np.int64)
    n = _prompt_blocks(engine, prompt)
    head = prompt[: n * spec.block_size]
    asms = Assemblies(spec)
    listener = HandoffListener("127.0.0.1:0", secret, spec, asms, reshard=True)
    error, wire, t_take = None, 0, 0.0
    try:
        messages.send(conn, {"op": "ready", "ok": True, "address": listener.address})
        messages.recv(conn, _START_S)  # "go": the prefill ranks are up, the request's deadline starts now
        t0 = time.perf_counter()
        vb = stored_bytes(spec)
        store = TieredStore([HostTier((n + 1) * vb, vb, name="host")],
                            tier_policies={"host": TierPolicy(high_watermark=1.0, low_watermark=1.0)})
        blocks = StoreBlocks(store, spec)
        try:
            asm = asms.take(cfg["request_id"], float(cfg["timeout_s"]),
                            keys_for=lambda ps: piece_keys(head, ps))
            blocks.write(engine.keys(head), torch.from_numpy(asm.blocks), Lifetime.REQUEST)
            wire = asm.wire_bytes
        except KVPortError as exc:  # the group recomputes what this rank lacks: same answer, no KV reuse
            error = f"{type(exc).__name__}: {exc}"
        t_take = time.perf_counter() - t0
        engine.store = blocks
        res = engine.generate(prompt, int(cfg["max_new_tokens"]), store_output=False)
    finally:
        listener.close()
    return {"tokens": list(res.tokens), "cached_tokens": res.cached_tokens, "ttft_s": res.ttft_s,
            "take_s": t_take, "wire_bytes": wire, "error": error, "fallback": res.fallback,
            "heads": list(spec.head_range)}


__all__ = ["main"]
