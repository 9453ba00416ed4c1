"""``kvport`` entry point. User errors print one line and exit 2; no traceback.

Each command's module is imported when that command runs (``kvport --help`` imports them all): so
``kvport serve`` and ``kvport doctor`` start without the other commands' imports, and a command whose
extra is missing (``kvport eval`` without torch) answers with one line naming the extra, never an
ImportError traceback.
"""

from __future__ import annotations

import importlib
import sys

import click

from kvport.cli._run import run_click, setup_logging
from kvport.extras import missing_extra_for

# command name -> (module, attribute): imported on use
COMMANDS: dict[str, tuple[str, str]] = {
    "size": ("kvport.cli.size_cmd", "size"),
    "serve": ("kvport.cli.serve_cmd", "serve_cmd"),
    "proxy": ("kvport.cli.proxy_cmd", "proxy_cmd"),
    "inspect": ("kvport.cli.inspect_cmd", "inspect_cmd"),
    "plan": ("kvport.cli.plan_cmd", "plan"),
    "simulate": ("kvport.cli.simulate_cmd", "simulate_cmd"),
    "calibrate": ("kvport.cli.calibrate_cmd", "calibrate_cmd"),
    "eval": ("kvport.cli.eval_cmd", "eval_group"),
    "bench": ("kvport.cli.bench_cmd", "bench"),
    "demo": ("kvport.cli.demo_cmd", "demo"),
    "doctor": ("kvport.cli.doctor_cmd", "doctor"),
    "config": ("kvport.cli.config_cmd", "config_group"),
    "report": ("kvport.cli.report_cmd", "report_cmd"),
}


class LazyGroup(click.Group):
    """A group whose subcommands are imported by name, on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        cmd = getattr(importlib.import_module(target[0]), target[1])
        if not isinstance(cmd, click.Command):
            raise TypeError(f"{target[0]}.{target[1]} is not a click command")
        return cmd


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvport")
def cli() -> None:
    """kvport: KV-cache transfer and tiering for LLM serving."""
    setup_logging()


def main(argv: list[str] | None = None) -> int:
    try:
        return run_click(cli, argv, "kvport")
    except ImportError as exc:  # an optional package imported without a guard (``import torch`` in a command)
        args = sys.argv[1:] if argv is None else argv
        words = [a for a in args if not a.startswith("-")][:1]  # the command's name
        err = missing_extra_for(exc, " ".join(["kvport", *words]))
        if err is None:
            raise
        click.echo(f"kvport: error: {err}", err=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
