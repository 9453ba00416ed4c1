"""Option values parsed where click still knows the flag's name.

Each ``as_*`` is a click ``callback``: a bad value fails as click's ``BadParameter`` ("Invalid value
for '--memory': ..."), which :func:`kvport.cli._run.run_click` prints as one line with exit code 2.
The value objects downstream (``ServerLimits``, ``ServerConfig``, the planner's ``Request``) check
again; these exist so that the message names the flag a person typed, not a dataclass field::

    @click.option("--capacity", default="8GiB", callback=as_size, metavar="SIZE")
"""

from __future__ import annotations

import math
from pathlib import Path

import click

from kvport.errors import SpecError, UnitError
from kvport.units import parse_bandwidth, parse_size


def as_size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """``80GiB``, ``512MiB``, ``4096``: a whole number of bytes, at least one."""
    if value is None:
        return None
    try:
        return parse_size(value)
    except UnitError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


def as_bandwidth(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    """``20GiB/s``, ``100Gbps``: bytes per second, finite and at least one."""
    if value is None:
        return None
    try:
        return parse_bandwidth(value)
    except UnitError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


def _seconds(ctx: click.Context, param: click.Parameter, value: float | None, allow_zero: bool) -> float | None:
    if value is None:
        return None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        want = "a finite number >= 0" if allow_zero else "a positive, finite number"
        raise click.BadParameter(f"must be {want} of seconds, got {value}", ctx, param)
    return value


def as_seconds(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A ``type=float`` option of seconds: positive and finite (click's float takes ``nan`` and ``inf``)."""
    return _seconds(ctx, param, value, allow_zero=False)


def as_seconds_or_zero(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """As :func:`as_seconds`, 0 allowed."""
    return _seconds(ctx, param, value, allow_zero=True)


def as_fraction(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A ``type=float`` option that is a fraction in (0, 1] (an efficiency, a share of memory)."""
    if value is None:
        return None
    if not math.isfinite(value) or not 0 < value <= 1:
        raise click.BadParameter(f"must be a fraction in (0, 1], got {value}", ctx, param)
    return value


def as_dtype(value: str, flag: str) -> str:
    """A dtype's canonical name (``bfloat16`` -> ``bf16``); BadParameter naming ``flag`` otherwise."""
    from kvport.spec import DType

    try:
        return DType.parse(value).value
    except SpecError as exc:
        raise click.BadParameter(str(exc), param_hint=f"'{flag}'") from exc


def as_device(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An accelerator preset's name or ``cpu`` (:mod:`kvport.planner.devices`), lower-cased; not
    measured here (``cpu`` is timed only where its numbers are used)."""
    if value is None:
        return None
    from kvport.planner.devices import device_names

    key = value.lower().strip()
    if key not in device_names():
        raise click.BadParameter(f"unknown device {value!r}: expected one of {', '.join(device_names())}", ctx, param)
    return key


def writable_file(path: str, flag: str) -> Path:
    """``path`` of an output file written at the end of a long run: its folder is created now and a
    file there must be writable, so a typo fails before the run, not after it (``BadParameter``).
    A file that was not there is not left behind."""
    p = Path(path)
    if p.is_dir():
        raise click.BadParameter(f"{path!r} is a folder", param_hint=f"'{flag}'")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        existed = p.exists()
        with open(p, "a"):  # open for writing without truncating what is there
            pass
        if not existed:
            p.unlink()
    except (FileExistsError, NotADirectoryError) as exc:  # a file where a folder on the way should be
        raise click.BadParameter(f"cannot write {path!r}: a part of its folder is a file", param_hint=f"'{flag}'") \
            from exc
    except OSError as exc:
        raise click.BadParameter(f"cannot write {path!r}: {exc.strerror or exc}", param_hint=f"'{flag}'") from exc
    return p
