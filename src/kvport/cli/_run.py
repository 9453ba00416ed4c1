"""Run a click command with kvport's exit codes: 2 for bad input (one line, no traceback), 1 for other
kvport errors, 130 when aborted. Shared by ``kvport`` and the lean ``python -m kvport.cli.serve_cmd``.

Bad input is one line on stderr whichever layer found it::

    kvport: error: Invalid value for '--http-port': 99999 is not in the range 0<=x<=65535 (see kvport serve --help)
    kvport: error: --http-port 8080: cannot listen on 127.0.0.1:8080: Address already in use

the first from click (a value's type or range, a missing or unknown option), the second a
:class:`UserInputError` raised further down.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import click

from kvport import logs
from kvport.config import Settings
from kvport.errors import KVPortError, UserInputError


def setup_logging() -> None:
    try:
        level = Settings.from_env().log_level
    except UserInputError:
        level = "WARNING"
    logs.setup(level)


# click >= 8.2 answers ``kvport`` alone (a group without its command) with a UsageError that shows the help
_ASKS_FOR_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


def run_click(command: click.Command, argv: list[str] | None, prog_name: str) -> int:
    try:
        command.main(args=argv, prog_name=prog_name, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.UsageError as exc:
        if isinstance(exc, _ASKS_FOR_HELP):
            exc.show()
            return 2
        hint = f" (see {exc.ctx.command_path} --help)" if exc.ctx is not None else ""
        message = " ".join(exc.format_message().split())  # click's messages can wrap a value over lines
        click.echo(f"kvport: error: {message.rstrip('.')}{hint}", err=True)
        return 2
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


def parse_key_values(items: Iterable[str], flag: str) -> dict[str, object]:
    """``KEY=VALUE`` options (``--set``, ``--param``): VALUE is JSON when it parses, else a string."""
    out: dict[str, object] = {}
    for item in items:
        if "=" not in item:
            raise UserInputError(f"{flag} expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out
