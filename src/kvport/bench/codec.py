"""``kvport bench codec``: size ratio, one-thread encode/decode speed and quality per codec.

Speed and ratio are measured on *real* KV: K (after RoPE) and V of the reference model over one
window of the ``code`` text, held as bf16 ``(layers, heads, tokens, dim)`` tensors: the lossless
ratio is the one real KV gets. Encode writes into a reused payload buffer and decode into reused
tensors, on one thread (``torch.set_num_threads(1)``); GB/s counts K+V input bytes (bf16). The
limit is a memcpy of the same byte count in the same run. Wall-clock figures are the contract;
``*_cpu`` figures divide by the thread's CPU time and are the ones to read on a loaded machine.
Quality comes from :func:`kvport.eval.evaluate` on the same run (full: 4 windows x 1024 tokens per
text set; ``--quick``: 1 x 256).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvport.bench.harness import Report, SuiteOptions, conditions, finish
from kvport.codec import Codec, KVShape, codec_ids, get_codec
from kvport.config import Settings
from kvport.eval import QualityOptions, evaluate
from kvport.eval.attention import capture_kv
from kvport.eval.texts import windows
from kvport.evidence.limits import memcpy_gbps
from kvport.evidence.timing import gbps, ratio, time_it
from kvport.refmodel import MODEL_ID, load
from kvport.spec import DType

DEFAULT_CODECS = ("raw", "lossless", "int8", "kivi4", "mixed")


def _cpu_time(fn: Callable[[], object], trials: int) -> float:
    fn()
    ts: list[float] = []
    for _ in range(trials):
        t0 = time.thread_time()
        fn()
        ts.append(time.thread_time() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def _speed(codec: Codec, k: torch.Tensor, v: torch.Tensor, trials: int) -> dict[str, Any]:
    nl, nh, nt, nd = (int(s) for s in k.shape)
    shape = KVShape(nl, nh, nt, nd, DType.BF16)
    out = np.empty(codec.max_encoded_size(shape), np.uint8)
    enc = codec.encode(k, v, out=out)
    ko, vo = torch.empty_like(k), torch.empty_like(v)
    codec.decode(enc, ko, vo)
    err = max(float((ko.float() - k.float()).abs().max()), float((vo.float() - v.float()).abs().max()))
    amax = max(float(k.float().abs().max()), float(v.float().abs().max()))
    nbytes = shape.nbytes
    te = time_it(lambda: codec.encode(k, v, out=out), trials)
    td = time_it(lambda: codec.decode(enc, ko, vo), trials)
    return {"ratio": round(enc.ratio, 4), "payload_bytes": enc.nbytes,
            "encode_gbps": round(gbps(nbytes, te.median_s), 3), "decode_gbps": round(gbps(nbytes, td.median_s), 3),
            "encode_gbps_cpu": round(gbps(nbytes, _cpu_time(lambda: codec.encode(k, v, out=out), trials)), 3),
            "decode_gbps_cpu": round(gbps(nbytes, _cpu_time(lambda: codec.decode(enc, ko, vo), trials)), 3),
            "encode_timing": te.as_dict(), "decode_timing": td.as_dict(),
            "max_abs_err_vs_amax": round(err / amax, 6) if amax else None}


def run(opts: SuiteOptions) -> Report:
    names = [str(n) for n in opts.extra.get("codecs", DEFAULT_CODECS)]
    codecs = [get_codec(n) for n in names if n in codec_ids()]
    tokens = opts.number("tokens", 256 if opts.quick else 1024, lo=1, integer=True)
    n_windows = opts.number("windows", 1 if opts.quick else 4, lo=1, integer=True)
    trials = 3 if opts.quick else 5
    model, tok = load(Settings.from_env().model_dir)
    ids = windows(tok, "code", tokens, 1)[0]
    k, v = capture_kv(model, ids, DType.BF16)
    nbytes = 2 * k.numel() * k.element_size()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = np.ones(nbytes, np.uint8)
        dst = np.zeros(nbytes, np.uint8)
        limits: dict[str, Any] = {"memcpy_gbps": round(memcpy_gbps(nbytes, trials), 3),
                                  "memcpy_gbps_cpu": round(gbps(nbytes, _cpu_time(lambda: np.copyto(dst, src),
                                                                                   trials)), 3)}
        per: dict[str, dict[str, Any]] = {c.codec_id: _speed(c, k, v, trials) for c in codecs}
    finally:
        torch.set_num_threads(threads)

    quality = evaluate(model, tok, codecs, QualityOptions(tokens=tokens, windows=n_windows), model_id=MODEL_ID)
    qd = quality.as_dict()
    for c in codecs:
        r = per[c.codec_id]
        q = qd["codecs"].get(c.codec_id, {})
        r["encode_vs_memcpy"] = ratio(r["encode_gbps"], limits["memcpy_gbps"])
        r["decode_vs_memcpy"] = ratio(r["decode_gbps"], limits["memcpy_gbps"])
        r["encode_vs_memcpy_cpu"] = ratio(r["encode_gbps_cpu"], limits["memcpy_gbps_cpu"])
        r["decode_vs_memcpy_cpu"] = ratio(r["decode_gbps_cpu"], limits["memcpy_gbps_cpu"])
        r["params"] = c.params
        for key in ("ppl_delta_pct_code", "ppl_delta_pct_prose", "top1_agreement_code", "top1_agreement_prose",
                    "kl_code", "kl_prose"):
            r[key] = q.get(key)
        r["ratio_in_eval"] = q.get("ratio")
    cond = conditions(model=MODEL_ID, kv_shape=list(k.shape), kv_dtype="bf16", kv_bytes=nbytes, threads=1,
                      speed_source="real K/V of one code window", quality=quality.conditions)
    results: dict[str, Any] = {"codecs": per, "baseline_ppl": qd["baseline_ppl"]}
    return finish(Report("codec", cond, limits, results))
