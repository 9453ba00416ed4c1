"""Run a suite by name, and stamp its report with how it was made.

Every report then says, beside the machine (:func:`~kvport.bench.harness.conditions`): its
``mode`` (``quick`` for smoke runs and CI, ``full`` for the figures the docs quote), the
``command`` that regenerates it, and the ``commit`` of the source it ran (``-dirty`` with
uncommitted changes; None outside a git checkout). ``kvport report`` shows all three on top of
every figure.
"""

from __future__ import annotations

import importlib
import json
import shlex
import subprocess
from pathlib import Path

from kvport.bench import SUITES
from kvport.bench.harness import Report, SuiteOptions
from kvport.errors import UserInputError


def run_suite(name: str, opts: SuiteOptions) -> Report:
    suite = SUITES.get(name)
    if suite is None:
        raise UserInputError(f"unknown suite {name!r}: expected one of {', '.join(sorted(SUITES))}")
    unknown = sorted(set(opts.extra) - suite.keys)
    if unknown:
        valid = ", ".join(sorted(suite.keys)) if suite.keys else "none"
        raise UserInputError(f"--set {', '.join(unknown)}: not an option of bench {name} (its keys: {valid})")
    mod = importlib.import_module(suite.module)
    report: Report = mod.run(opts)
    report.conditions.update(mode="quick" if opts.quick else "full", command=command_line(name, opts),
                             commit=source_commit())
    return report


def command_line(name: str, opts: SuiteOptions) -> str:
    """The ``kvport bench`` command that runs ``name`` with ``opts`` again."""
    argv = ["kvport", "bench", name, *(["--quick"] if opts.quick else [])]
    for key, value in sorted(opts.extra.items()):  # --set parses JSON values: they go back as JSON
        argv += ["--set", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return shlex.join(argv)


def source_commit() -> str | None:
    """The commit of the checkout this package runs from (``-dirty`` with uncommitted changes), or None
    (an installed wheel, no git)."""
    root = Path(__file__).resolve().parents[3]  # <checkout>/src/kvport/bench/run.py
    if not (root / "pyproject.toml").is_file() or not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=12"],
                             capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None
