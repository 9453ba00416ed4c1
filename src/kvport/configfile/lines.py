"""Where each key of a TOML file is written: ``tomllib`` parses values but gives no line numbers.

A scan of the text, line by line, after ``tomllib`` accepted it (so the text is valid TOML)::

    [server]                 -> ("server",)                 line 1
    listen = "0.0.0.0:7878"  -> ("server", "listen")        line 2
    tls.cert = "a.pem"       -> ("server", "tls", "cert")   line 3   (a dotted key)
    [[tenants]]              -> ("tenants", 0)              line 4   (the n-th table of an array)
    name = "a"               -> ("tenants", 0, "name")      line 5

A key inside an inline table (``tls = {cert = "a"}``) or an array of tables written inline is not
found by the scan: :func:`line_of` answers the line of its closest written ancestor (the ``tls =``
line), never no line while an ancestor is known. Lines inside multi-line strings are skipped.
"""

from __future__ import annotations

import re

Path = tuple[str | int, ...]

_BARE = r"[A-Za-z0-9_-]+"
_QUOTED = r'"(?:[^"\\]|\\.)*"|\'[^\']*\''
_KEY = rf"(?:{_BARE}|{_QUOTED})(?:\s*\.\s*(?:{_BARE}|{_QUOTED}))*"
_ARRAY_TABLE = re.compile(rf"^\s*\[\[\s*({_KEY})\s*\]\]")
_TABLE = re.compile(rf"^\s*\[\s*({_KEY})\s*\]")
_ASSIGN = re.compile(rf"^\s*({_KEY})\s*=")
_PART = re.compile(rf"{_BARE}|{_QUOTED}")


def _parts(key: str) -> tuple[str, ...]:
    out = []
    for m in _PART.finditer(key):
        p = m.group(0)
        out.append(p[1:-1] if p[0] in "\"'" else p)
    return tuple(out)


def key_lines(text: str) -> dict[Path, int]:
    """Every table header and ``key =`` line of ``text``: its full path -> 1-based line number."""
    lines: dict[Path, int] = {}
    counts: dict[tuple[str, ...], int] = {}  # array-of-tables path -> tables seen so far
    table: Path = ()
    fence: str | None = None  # inside a multi-line string opened by this fence
    for n, raw in enumerate(text.splitlines(), 1):
        if fence is not None:
            if raw.count(fence) % 2 == 1:
                fence = None
            continue
        m = _ARRAY_TABLE.match(raw)
        if m:
            name = _parts(m.group(1))
            i = counts.get(name, 0)
            counts[name] = i + 1
            table = (*_resolve(name, counts), i)
            lines.setdefault(table, n)
            lines.setdefault(table[:-1], n)
            continue
        m = _TABLE.match(raw)
        if m:
            table = _resolve(_parts(m.group(1)), counts)
            lines.setdefault(table, n)
            continue
        m = _ASSIGN.match(raw)
        if m:
            key = (*table, *_parts(m.group(1)))
            for i in range(len(table) + 1, len(key) + 1):  # a dotted key also writes its parents
                lines.setdefault(key[:i], n)
            rest = raw[m.end():]
            for q in ('"""', "'''"):
                if rest.count(q) % 2 == 1:
                    fence = q
                    break
    return lines


def _resolve(name: tuple[str, ...], counts: dict[tuple[str, ...], int]) -> Path:
    """``[tenants.limits]`` under ``[[tenants]]`` belongs to the latest tenant: index the arrays."""
    out: list[str | int] = []
    for i, part in enumerate(name):
        out.append(part)
        prefix = name[: i + 1]
        if prefix in counts and i < len(name) - 1:
            out.append(counts[prefix] - 1)
    return tuple(out)


def line_of(lines: dict[Path, int], path: Path) -> int | None:
    """The line of ``path``, else of its closest ancestor written in the file (None: not in the file)."""
    for i in range(len(path), 0, -1):
        n = lines.get(path[:i])
        if n is not None:
            return n
    return None


def dotted(path: Path) -> str:
    """``("tenants", 1, "quota")`` -> ``tenants[1].quota``."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out
