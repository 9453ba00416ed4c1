"""``kvport demo``: for now the calculator on the source documents' example and the hash benchmark.

The prefill/decode disaggregation scenario replaces this once the engine integration lands.
"""

from __future__ import annotations

import click

from kvport.bench import hash as hash_suite
from kvport.bench.harness import SuiteOptions
from kvport.spec import from_preset
from kvport.units import format_bytes, parse_bandwidth


def run() -> None:
    spec = from_preset("llama-3.1-8b", dtype="fp16")
    kv = spec.request_bytes(65536)
    bw = parse_bandwidth("20GiB/s")
    click.echo(f"Llama-3.1-8B fp16, 65,536 tokens: {format_bytes(kv)} of KV; "
               f"ideal transfer at 20 GiB/s >= {kv / bw:.3f} s")
    rep = hash_suite.run(SuiteOptions(quick=True))
    r = rep.results
    click.echo(f"chained keys: {r['blocks_per_second_256']:,} blocks/s of 256 tokens "
               f"({r['vs_raw_hash_256']:.2f} of raw xxh3-128)")
