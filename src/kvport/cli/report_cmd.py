"""``kvport report``: the benchmarks' JSON as one HTML page of figures (and the Markdown reference)."""

from __future__ import annotations

from pathlib import Path

import click

from kvport.bench import SUITES
from kvport.errors import UserInputError
from kvport.report.run import REPORT_SUITES, build, run_suites


@click.command()
@click.argument("reports", nargs=-1, type=click.Path(exists=True))
@click.option("--run", "run_mode", type=click.Choice(["quick", "full"]), default=None,
              help="run the suites first (quick: smoke sizes, as CI does; full: the figures the docs quote)")
@click.option("--suites", default=",".join(REPORT_SUITES), show_default=True, metavar="NAMES",
              help="with --run: the suites to run, comma-separated")
@click.option("--results", "results_dir", default=None, type=click.Path(file_okay=False),
              help="with --run: where each suite's JSON goes (default: FOLDER-OF-OUT/kvport-results)")
@click.option("--out", "out_path", default="kvport-report.html", show_default=True, type=click.Path(dir_okay=False),
              help="the HTML page")
@click.option("--no-html", is_flag=True, help="write no page (with --markdown: the Markdown alone, no matplotlib)")
@click.option("--markdown", "md_path", default=None, type=click.Path(dir_okay=False),
              help="also write the per-suite Markdown reference here (e.g. docs/benchmarks.md)")
@click.option("--check", is_flag=True, help="open the page in headless Chromium: exit 1 unless every figure "
                                            "that was drawn renders and the console stays clean")
def report_cmd(reports: tuple[str, ...], run_mode: str | None, suites: str, results_dir: str | None, out_path: str,
               no_html: bool, md_path: str | None, check: bool) -> None:
    """Figures of the benchmark REPORTS (JSON files or folders of them), with their conditions on top.

    Figures whose suite was not run, or whose fields a report lacks, are shown as unknown.
    """
    if not reports and run_mode is None:
        raise UserInputError("nothing to report: give reports (kvport bench ... --json files, or folders of them) "
                             "or --run quick|full")
    html = None if no_html else Path(out_path)
    if html is None and md_path is None:
        raise UserInputError("--no-html without --markdown writes nothing")
    if check and html is None:
        raise UserInputError("--check opens the HTML page: leave out --no-html")
    paths = [Path(r) for r in reports]
    failed: list[tuple[str, str]] = []
    if run_mode is not None:
        names = [s.strip() for s in suites.split(",") if s.strip()]
        unknown = sorted(set(names) - set(SUITES))
        if unknown or not names:
            raise UserInputError(f"--suites {suites!r}: unknown {', '.join(unknown) or '(none given)'}; "
                                 f"expected some of {', '.join(sorted(SUITES))}")
        folder = Path(results_dir) if results_dir else Path(out_path).parent / "kvport-results"
        failed = run_suites(names, run_mode == "quick", folder, lambda s: click.echo(f"running {s}", err=True))
        paths.append(folder)
    built = build(paths, html=html, markdown_path=Path(md_path) if md_path else None)
    for name, why in failed:
        click.echo(f"kvport report: bench {name} failed: {why}", err=True)
    for path, why in built.inputs.refused:
        click.echo(f"kvport report: not read: {path}: {why}", err=True)
    if built.html is not None:
        unknown_note = f" (unknown: {', '.join(built.unknown)})" if built.unknown else ""
        click.echo(f"{built.html}: {built.figures} figures{unknown_note}")
    if built.markdown is not None:
        click.echo(f"{built.markdown}: {len(built.inputs.reports)} suites")
    if check and built.html is not None:
        from kvport.report.browser import check as browser_check

        res = browser_check(built.html)
        click.echo(f"browser: figures loaded {res.figures_loaded}, page errors {len(res.page_errors)}, "
                   f"console lines {len(res.console)}")
        for line in (*res.page_errors, *res.console):
            click.echo(f"  {line}", err=True)
        if not res.ok or res.figures_loaded != f"{built.figures}/{built.figures}":
            raise SystemExit(1)
