"""The kinds of value a config key holds: each parses a TOML value (or a ``KVPORT_*`` variable's text)
into its typed form, or raises :class:`Bad` with the reason a person reads.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvport.deadline import DeadlinePolicy
from kvport.errors import ConfigError, UnitError
from kvport.units import format_bytes, parse_size


class Bad(Exception):
    """A value that does not fit its key (the reason, without the key)."""


class Kind:
    """A key's kind: :meth:`parse` a TOML value; :meth:`from_text` a variable's text first."""

    what = "a value"

    def parse(self, value: Any) -> Any:
        raise NotImplementedError

    def from_text(self, text: str) -> Any:
        return self.parse(text)


@dataclass(frozen=True)
class Size(Kind):
    """``"8GiB"``, ``"512 MiB"``, ``"8GB"`` (SI) or an integer of bytes, at least ``least`` bytes."""

    least: int = 1
    zero: bool = False  # 0 allowed (means "none")
    what = "a size such as \"8GiB\""

    def parse(self, value: Any) -> int:
        if self.zero and ((type(value) is int and value == 0) or value == "0"):  # not False, not 0.0
            return 0
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise Bad(f"expected a size such as \"8GiB\" or an integer of bytes, got {value!r}")
        if isinstance(value, str) and value.strip().startswith("-"):
            raise Bad(f"size must be positive, got {value!r}")
        try:
            n = parse_size(value)
        except UnitError as exc:
            raise Bad(str(exc)) from None
        if n < self.least:
            hint = " (a unit missing? sizes without a unit are bytes)" if isinstance(value, int) or \
                str(value).strip().isdecimal() else ""
            raise Bad(f"{value!r} is {format_bytes(n)}: at least {format_bytes(self.least)} expected{hint}")
        return n

    def from_text(self, text: str) -> int:
        return self.parse(int(text) if text.strip().isascii() and text.strip().isdecimal() else text)


@dataclass(frozen=True)
class Integer(Kind):
    lo: int
    hi: int | None = None

    def parse(self, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise Bad(f"expected an integer, got {value!r}")
        if value < self.lo or (self.hi is not None and value > self.hi):
            span = f">= {self.lo}" if self.hi is None else f"in {self.lo}..{self.hi}"
            raise Bad(f"must be {span}, got {value}")
        return value

    def from_text(self, text: str) -> int:
        try:
            return self.parse(int(text))
        except ValueError:
            raise Bad(f"expected an integer, got {text!r}") from None


@dataclass(frozen=True)
class Seconds(Kind):
    def parse(self, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise Bad(f"expected a number of seconds, got {value!r}")
        if not math.isfinite(value) or value <= 0:
            raise Bad(f"must be a positive, finite number of seconds, got {value}")
        return float(value)

    def from_text(self, text: str) -> float:
        try:
            return self.parse(float(text))
        except ValueError:
            raise Bad(f"expected a number of seconds, got {text!r}") from None


@dataclass(frozen=True)
class Boolean(Kind):
    def parse(self, value: Any) -> bool:
        if not isinstance(value, bool):
            raise Bad(f"expected true or false, got {value!r}")
        return value

    def from_text(self, text: str) -> bool:
        t = text.strip().lower()
        if t in ("1", "true", "yes", "on"):
            return True
        if t in ("0", "false", "no", "off"):
            return False
        raise Bad(f"expected true or false, got {text!r}")


@dataclass(frozen=True)
class Text(Kind):
    pattern: str | None = None  # a full match, when given
    hint: str = ""
    secret: bool = False  # a token, or where one may be pasted by mistake: never echoed in a message

    def parse(self, value: Any) -> str:
        shown = "the value given" if self.secret else repr(value)
        if not isinstance(value, str) or not value:
            raise Bad(f"expected a non-empty string, got {shown if self.secret else repr(value)}")
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            raise Bad(f"{shown}: expected {self.hint}")
        return value


@dataclass(frozen=True)
class Choice(Kind):
    options: Callable[[], Sequence[str]]
    hint: str = ""

    def parse(self, value: Any) -> str:
        opts = list(self.options())
        if value not in opts:
            close = difflib.get_close_matches(str(value), opts, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise Bad(f"{value!r} is not one of {', '.join(opts)}{self.hint}{hint}")
        return str(value)


@dataclass(frozen=True)
class Address(Kind):
    """``HOST:PORT`` (``[::1]:7878`` for IPv6)."""

    least_port: int = 0

    def parse(self, value: Any) -> tuple[str, int]:
        host, sep, port = str(value).rpartition(":") if isinstance(value, str) else ("", "", "")
        if not sep or not host or not (port.isascii() and port.isdecimal()) or not self.least_port <= int(port) < 65536:
            raise Bad(f"expected HOST:PORT (port {self.least_port}..65535), got {value!r}")
        return host.strip("[]"), int(port)


def join_address(address: tuple[str, int]) -> str:
    """The inverse of :class:`Address`: ``("::1", 7878)`` -> ``[::1]:7878``."""
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class PathText(Kind):
    """A file or folder (``~`` expanded); whether it exists is checked where it is used."""

    def parse(self, value: Any) -> Path:
        if not isinstance(value, str) or not value.strip():
            raise Bad(f"expected a path, got {value!r}")
        return Path(value).expanduser()


@dataclass(frozen=True)
class Networks(Kind):
    """CIDRs: a list, or one string of them separated by commas."""

    def parse(self, value: Any) -> tuple[str, ...]:
        items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not all(isinstance(v, str) for v in items):
            raise Bad(f"expected a list of networks such as \"10.0.0.0/8\", got {value!r}")
        for v in items:
            try:
                ipaddress.ip_network(v, strict=False)
            except ValueError:
                raise Bad(f"{v!r} is not a network (CIDR such as \"10.0.0.0/8\")") from None
        return tuple(items)


@dataclass(frozen=True)
class DeadlineText(Kind):
    """``"MIN_S:FACTOR:MAX_S"`` (as ``KVPORT_LOAD_DEADLINE``)."""

    def parse(self, value: Any) -> DeadlinePolicy:
        try:
            return DeadlinePolicy.parse(value)
        except ConfigError as exc:
            raise Bad(str(exc)) from None


ENV_NAME = Text(r"[A-Za-z_][A-Za-z0-9_]*", "the name of an environment variable", secret=True)
