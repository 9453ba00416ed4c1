"""Build a report: run the suites the figures need (or read their JSON), write the page and the Markdown."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvport.bench.harness import SuiteOptions
from kvport.bench.run import run_suite
from kvport.errors import KVPortError
from kvport.report import markdown
from kvport.report.results import Inputs, load

log = logging.getLogger(__name__)

# the suites behind the page's figures, quickest first, and the options the figures need of them
REPORT_SUITES = ("hash", "tiers", "trace", "transfer", "planner", "codec")
REPORT_OPTIONS: dict[str, dict[str, str]] = {"trace": {"traces": "all"}}  # every trace, 5/10/20% of its blocks


@dataclass(slots=True)
class Built:
    inputs: Inputs
    html: Path | None = None
    markdown: Path | None = None
    figures: int = 0  # drawn
    unknown: list[str] = field(default_factory=list)  # figure keys drawn as unknown
    failed: list[tuple[str, str]] = field(default_factory=list)  # (suite, why) for runs that failed


def run_suites(suites: Sequence[str], quick: bool, results_dir: Path,
               progress: Callable[[str], None] = lambda _: None) -> list[tuple[str, str]]:
    """Run each suite and write ``results_dir/<suite>.json``; a suite that fails is reported, the others go on."""
    results_dir.mkdir(parents=True, exist_ok=True)
    failed = []
    for name in suites:
        progress(f"kvport bench {name}{' --quick' if quick else ''}")
        try:
            opts = SuiteOptions(quick=quick, extra=dict(REPORT_OPTIONS.get(name, {})))
            run_suite(name, opts).write(results_dir / f"{name}.json")
        except KVPortError as exc:
            log.warning("kvport report: bench %s failed: %s", name, exc)
            failed.append((name, f"{type(exc).__name__}: {exc}"))
    return failed


def build(paths: Sequence[Path], *, html: Path | None, markdown_path: Path | None) -> Built:
    inputs = load(paths)
    out = Built(inputs)
    if html is not None:
        from kvport.report import figures, page  # matplotlib: the report extra

        drawn = figures.draw_all(inputs)
        html.parent.mkdir(parents=True, exist_ok=True)
        html.write_text(page.render(drawn, inputs))
        out.html = html
        out.figures = sum(d.svg is not None for d in drawn)
        out.unknown = [d.key for d in drawn if d.svg is None]
    if markdown_path is not None:
        markdown_path.parent.mkdir(parents=True, exist_ok=True)
        markdown.write(markdown_path, inputs)
        out.markdown = markdown_path
    return out
