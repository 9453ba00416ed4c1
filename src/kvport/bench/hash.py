"""``kvport bench hash``: chained block keys per second, against raw xxh3-128 of the same bytes.

The limit is the hash function alone over pre-made block views (no chaining, no conversion); the
results are :func:`kvport.keys.chain_keys` on int32 token arrays (what the engines hand over) and on
int64 arrays (what a tokenizer's tensors are), for 16- and 256-token blocks, on one thread.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import xxhash

from kvport.bench.harness import Report, SuiteOptions, conditions, finish
from kvport.evidence.timing import time_it
from kvport.keys import HashAlgo, KeyContext, chain_keys
from kvport.spec import from_preset


def run(opts: SuiteOptions) -> Report:
    n_tokens = (1 << 22) if opts.quick else (1 << 25)  # 4M or 32M tokens
    trials = 3 if opts.quick else 5
    rng = np.random.default_rng(0)
    toks32 = rng.integers(0, 150_000, n_tokens).astype("<i4")
    toks64 = toks32.astype(np.int64)
    spec = from_preset("llama-3.1-8b")
    limits: dict[str, float] = {}
    results: dict[str, object] = {}
    mv = toks32.data.cast("B")
    for bs in (16, 256):
        step = bs * 4
        n_blocks = n_tokens // bs
        views = [mv[i * step : (i + 1) * step] for i in range(n_blocks)]
        def raw(views: list[memoryview] = views, h: object = xxhash.xxh3_128_digest) -> None:
            for v in views:
                h(v)  # type: ignore[operator]

        limits[f"raw_xxh3_128_blocks_per_second_{bs}"] = round(time_it(raw, trials).rate(n_blocks))
        ctx = KeyContext(block_size=bs, spec_fingerprint=spec.fingerprint)
        t32 = time_it(partial(chain_keys, toks32, ctx), trials)
        t64 = time_it(partial(chain_keys, toks64, ctx), trials)
        results[f"blocks_per_second_{bs}"] = round(t32.rate(n_blocks))
        results[f"blocks_per_second_{bs}_from_int64"] = round(t64.rate(n_blocks))
        results[f"vs_raw_hash_{bs}"] = round(t32.rate(n_blocks) / limits[f"raw_xxh3_128_blocks_per_second_{bs}"], 4)
        results[f"timing_{bs}"] = t32.as_dict()
    sha_ctx = KeyContext(block_size=256, algo=HashAlgo.SHA256)
    small = toks32[: n_tokens // 8]
    results["sha256_blocks_per_second_256"] = round(time_it(lambda: chain_keys(small, sha_ctx), trials)
                                                    .rate(len(small) // 256))
    cond = conditions(tokens=n_tokens, threads=1, algo="xxh3_128", token_dtype="int32 (and int64)")
    return finish(Report("hash", cond, limits, results))
