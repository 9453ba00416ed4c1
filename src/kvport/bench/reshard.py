"""``kvport bench reshard``: prefill and decode at different tensor-parallel widths, rank processes of
the transformers engine (reference model, fp32, transformers' ``tp_plan`` over gloo), the KV heads
re-sharded on the way (:mod:`kvport.transfer.reshard`, :mod:`kvport.workers.tp_rank`).

For each case ``P -> D`` (prefill width to decode width; the reference model's 3 KV heads allow 1 and
3) every decode rank listens, every prefill rank prefills the prompt and sends each decode rank the
heads both hold, and the decode ranks generate from the loaded prefix. The limits, measured in the same
run: the prompt's KV size at width 1 (what the wire must carry, once) and one process answering the
prompt without kvport (its tokens, its time to first token). Results per case:

    tokens_equal      every decode rank's answer equals the one process's answer
    cached_tokens     prompt tokens every decode rank loaded (the rest it computed)
    wire_bytes        KV payload the prefill ranks sent (sum)    wire_vs_kv  wire_bytes / kv_bytes: 1.0
    send_s / ttft_s   the slowest prefill rank's send; the slowest decode rank's time to first token
    decode_ttft_vs_one_process   that decode TTFT (the prefix loaded) over the one process's TTFT
                      (the whole prompt computed); the prefill ranks' time is not in it

``--set cases=3-1,1-3`` picks cases; ``tokens`` (prompt length), ``max_new_tokens``; ``drop=R``: prefill
rank R sends nothing (a rank lost before its hand-off: each decode rank missing its heads waits
``take_s`` seconds, then the group recomputes -- ``errors`` names the heads, the tokens still equal).
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import time
from typing import Any

import numpy as np

from kvport.bench.harness import Report, SuiteOptions, conditions, finish
from kvport.config import Settings
from kvport.errors import ConfigError
from kvport.workers import tp_rank
from kvport.workers.process import Worker

_TEXT = ("Key-value caches grow with every token a model reads. Serving systems keep them on the GPU, "
         "move them to host memory and disks when they cool, and hand them from the engine that read a "
         "prompt to the engine that answers it. When the two engines split the model's attention heads "
         "differently, each head must still arrive exactly once. ")
_START_S = 180.0  # a rank loads the model and joins its group within this


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cases(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        try:
            p, d = (int(x) for x in part.strip().split("-"))
        except ValueError as exc:
            raise ConfigError(f"--set cases: {part!r} is not PREFILL-DECODE (e.g. 3-1)") from exc
        if p not in (1, 3) or d not in (1, 3):
            raise ConfigError(f"--set cases: {part!r}: the reference model's 3 KV heads allow widths 1 and 3")
        out.append((p, d))
    return out


def _prompt(tokenizer: Any, tokens: int) -> list[int]:
    ids: list[int] = tokenizer(_TEXT * (1 + tokens // 40))["input_ids"]
    return ids[:tokens]


def _case(p: int, d: int, cfg: dict[str, Any], timeout_s: float, drop: int | None = None) -> dict[str, Any]:
    """Run one P -> D hand-off with real rank processes; the workers' answers."""
    rid = f"reshard-{p}-{d}-{secrets.token_hex(4)}"
    workers: list[Worker] = []
    try:
        port = _free_port()
        dec = [Worker(f"decode-{r}", tp_rank.main, {**cfg, "role": "decode", "rank": r, "size": d, "master_port": port,
                                                    "request_id": rid, "timeout_s": timeout_s}) for r in range(d)]
        workers += dec
        addrs = [w.ready(_START_S)["address"] for w in dec]
        port = _free_port()
        pre = [Worker(f"prefill-{r}", tp_rank.main, {**cfg, "role": "prefill", "rank": r, "size": p,
                                                     "master_port": port, "request_id": rid, "destinations": addrs,
                                                     "decode_size": d, "drop": r == drop}) for r in range(p)]
        workers += pre
        for w in pre:
            w.ready(_START_S)
        for w in dec:  # the request arrives: each decode rank's deadline starts now
            w.send({"op": "go"})
        pres = [w.recv(timeout_s + 60) for w in pre]
        decs = [w.recv(timeout_s + 120) for w in dec]
    finally:
        for w in workers:
            with contextlib.suppress(Exception):
                w.kill()
    return {"prefill": pres, "decode": decs}


def run(opts: SuiteOptions) -> Report:
    import torch

    from kvport.engines.hf import HFEngine

    settings = Settings.from_env()
    tokens = int(opts.extra.get("tokens", 160 if opts.quick else 1024))
    max_new = int(opts.extra.get("max_new_tokens", 8 if opts.quick else 24))
    cases = _cases(str(opts.extra.get("cases", "3-1,1-3" if opts.quick else "1-1,3-1,1-3,3-3")))
    take_s = float(opts.extra.get("take_s", 120.0))
    drop = None if opts.extra.get("drop") is None else int(opts.extra["drop"])
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(settings.model_dir))
    prompt = _prompt(tok, tokens)
    one = HFEngine.from_model_dir(settings.model_dir)
    ref = one.generate(np.asarray(prompt, dtype=np.int64), max_new)
    spec = one.spec
    n_blocks = (len(prompt) - 1) // spec.block_size
    kv_bytes = n_blocks * spec.bytes_per_block
    del one
    limits = {"kv_bytes": kv_bytes, "one_process_ttft_s": round(ref.ttft_s, 4),
              "one_process_tokens": list(ref.tokens)}
    cond = conditions(model=spec.model_id, dtype=spec.dtype.value, prompt_tokens=len(prompt), blocks=n_blocks,
                      block_size=spec.block_size, kv_heads=spec.num_kv_heads, max_new_tokens=max_new,
                      transport="tcp loopback (the hand-off, authenticated)", group="gloo (transformers tp_plan)",
                      threads_per_rank=1, cases=[f"{p}-{d}" for p, d in cases], take_s=take_s,
                      dropped_prefill_rank=drop)
    cfg = {"model_dir": str(settings.model_dir), "prompt": prompt, "max_new_tokens": max_new,
           "secret": secrets.token_bytes(32).hex()}  # to the ranks over the spawn pipe, never a command line
    results: dict[str, Any] = {}
    for p, d in cases:
        t0 = time.perf_counter()
        got = _case(p, d, cfg, timeout_s=take_s, drop=drop)
        row = _summary(got, ref.tokens, kv_bytes, time.perf_counter() - t0)
        row["decode_ttft_vs_one_process"] = round(row["ttft_s"] / ref.ttft_s, 4) if ref.ttft_s > 0 else None
        results[f"tp{p}_to_tp{d}"] = row
    results["all_tokens_equal"] = all(r["tokens_equal"] for r in results.values() if isinstance(r, dict))
    return finish(Report("reshard", cond, limits, results))


def _summary(got: dict[str, Any], ref: tuple[int, ...], kv_bytes: int, seconds: float) -> dict[str, Any]:
    errors = [m.get("error") for m in got["prefill"] + got["decode"] if not m.get("ok") or m.get("error")]
    ok_dec = [m for m in got["decode"] if m.get("ok")]
    wire = sum(int(m.get("sent_bytes", 0)) for m in got["prefill"] if m.get("ok"))
    return {
        "tokens_equal": bool(ok_dec) and len(ok_dec) == len(got["decode"])
        and all(tuple(m["tokens"]) == tuple(ref) for m in ok_dec),
        "cached_tokens": min((int(m["cached_tokens"]) for m in ok_dec), default=0),
        "wire_bytes": wire,
        "received_bytes": sum(int(m.get("wire_bytes", 0)) for m in ok_dec),
        "wire_vs_kv": round(wire / kv_bytes, 4) if kv_bytes else None,
        "pieces": [pc for m in got["prefill"] if m.get("ok") for pc in m.get("pieces", [])],
        "send_s": round(max((float(m.get("send_s", 0)) for m in got["prefill"] if m.get("ok")), default=0), 4),
        "ttft_s": round(max((float(m.get("ttft_s", 0)) for m in ok_dec), default=0), 4),
        "case_s": round(seconds, 2),
        "errors": errors,
    }


__all__ = ["run"]
