"""``kvport`` entry point. User errors print one line and exit 2; no traceback."""

from __future__ import annotations

import sys

import click

from kvport.cli import bench_cmd, demo_cmd, eval_cmd, size_cmd
from kvport.cli._run import run_click, setup_logging
from kvport.cli.calibrate_cmd import calibrate_cmd
from kvport.cli.inspect_cmd import inspect_cmd
from kvport.cli.plan_cmd import plan
from kvport.cli.serve_cmd import serve_cmd


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvport")
def cli() -> None:
    """kvport: KV-cache transfer and tiering for LLM serving."""
    setup_logging()


cli.add_command(size_cmd.size)
cli.add_command(bench_cmd.bench)
cli.add_command(demo_cmd.demo)
cli.add_command(eval_cmd.eval_group)
cli.add_command(serve_cmd)
cli.add_command(inspect_cmd)
cli.add_command(plan)
cli.add_command(calibrate_cmd, name="calibrate")


def main(argv: list[str] | None = None) -> int:
    return run_click(cli, argv, "kvport")


if __name__ == "__main__":
    sys.exit(main())
