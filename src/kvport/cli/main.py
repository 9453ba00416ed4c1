"""``kvport`` entry point. User errors print one line and exit 2; no traceback."""

from __future__ import annotations

import logging
import sys

import click

from kvport.cli import bench_cmd, demo_cmd, eval_cmd, size_cmd
from kvport.cli.calibrate_cmd import calibrate_cmd
from kvport.cli.inspect_cmd import inspect_cmd
from kvport.cli.plan_cmd import plan
from kvport.cli.serve_cmd import serve_cmd
from kvport.config import Settings
from kvport.errors import KVPortError, UserInputError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvport")
def cli() -> None:
    """kvport: KV-cache transfer and tiering for LLM serving."""
    try:
        level = Settings.from_env().log_level
    except UserInputError:
        level = "WARNING"
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


cli.add_command(size_cmd.size)
cli.add_command(bench_cmd.bench)
cli.add_command(demo_cmd.demo)
cli.add_command(eval_cmd.eval_group)
cli.add_command(serve_cmd)
cli.add_command(inspect_cmd)
cli.add_command(plan)
cli.add_command(calibrate_cmd, name="calibrate")


def main(argv: list[str] | None = None) -> int:
    try:
        cli.main(args=argv, prog_name="kvport", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except UserInputError as exc:
        click.echo(f"kvport: error: {exc}", err=True)
        return 2
    except KVPortError as exc:
        click.echo(f"kvport: {type(exc).__name__}: {exc}", err=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
