"""Benchmark suites: ``kvport bench SUITE [--quick] [--json PATH]``.

Every suite returns a :class:`~kvport.bench.harness.Report` with ``suite``, ``conditions`` (machine,
CPU count, load, versions, model, sizes), ``limits`` (physical limits measured *in the same run*)
and ``results`` (ratios against those limits). What a suite did not measure is reported as
``None`` ("unknown"), never guessed. Suites are imported lazily, by module path.
"""

from __future__ import annotations

# suite name -> module that defines ``run(opts: SuiteOptions) -> Report``
SUITES: dict[str, str] = {
    "codec": "kvport.bench.codec",
    "faults": "kvport.bench.faults",
    "hash": "kvport.bench.hash",
    "pd": "kvport.bench.pd",
    "planner": "kvport.bench.planner",
    "server": "kvport.bench.server",
    "soak": "kvport.bench.soak",
    "prefix": "kvport.bench.prefix",
    "tiers": "kvport.bench.tiers",
    "transfer": "kvport.bench.transfer",
    "trace": "kvport.bench.trace",
}
