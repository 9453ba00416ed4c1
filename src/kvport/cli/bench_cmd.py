"""``kvport bench SUITE [--quick] [--json PATH]``: run a benchmark suite, print its JSON report."""

from __future__ import annotations

import click

from kvport.bench.harness import SuiteOptions
from kvport.bench.run import run_suite
from kvport.cli._params import writable_file
from kvport.cli._run import parse_key_values
from kvport.errors import UserInputError


@click.command(context_settings={"ignore_unknown_options": False})
@click.argument("suite")
@click.option("--quick", is_flag=True, help="smaller sizes and fewer trials (CI, smoke runs)")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), help="also write the report here")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="suite-specific option (repeatable)")
@click.option("--trace", "trace_path", default=None, type=click.Path(dir_okay=False), help="trace suite: trace file")
@click.option("--capacity", default=None, help="trace suite: capacity (10%, a block count, or a size like 20GiB)")
def bench(suite: str, quick: bool, json_path: str | None, sets: tuple[str, ...], trace_path: str | None,
          capacity: str | None) -> None:
    """Run benchmark SUITE and print its JSON report (suite, conditions, limits, results)."""
    extra = parse_key_values(sets, "--set")
    if json_path:
        writable_file(json_path, "--json")  # now, not after a run of minutes
    if trace_path is not None:
        extra["trace"] = trace_path
    if capacity is not None:
        extra["capacity"] = capacity
    report = run_suite(suite, SuiteOptions(quick=quick, extra=extra))
    click.echo(report.to_json())  # printed first: a failed write below does not lose the run
    if json_path:
        try:
            report.write(json_path)
        except OSError as exc:
            raise UserInputError(f"--json {json_path}: cannot write the report: {exc.strerror or exc}") from exc
