"""One pass over a parsed file: every key converted to its kind, every problem kept with its line."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvport.config import MIN_TOKEN_CHARS
from kvport.configfile.fields import Bad
from kvport.configfile.keys import KEYS, NO_ENV, TENANT_KEYS, env_name
from kvport.configfile.lines import dotted, key_lines, line_of
from kvport.configfile.schema import Problem, TenantEntry

# who reads the file, and so which checks of this machine apply: the server's own files, RAM and disk
# where it runs; the engines' tiers where they run; the tokens of the server's tenants only where
# the server runs (an engine's host need not hold them). "all": every check (`kvport config check`).
ROLES = ("all", "server", "engine")


class FileReader:
    """Collects typed values and problems for one file (+ environment)."""

    def __init__(self, path: Path | None, text: str, env: Mapping[str, str], role: str = "all") -> None:
        self.serving = role in ("all", "server")
        self.engine = role in ("all", "engine")
        self.file = str(path) if path is not None else "environment"
        self.lines = key_lines(text)
        self.env = env
        self.values: dict[str, Any] = {}
        self.problems: list[Problem] = []
        self.inline_secret: tuple[str | int, ...] | None = None  # where the file writes a token itself
        self.in_file: set[str] = set()  # keys the file itself sets (before the variables)
        self.unresolved: set[int] = set()  # tenants whose token was given but is not usable
        self.tenant_at: list[int] = []  # the n-th tenant kept -> its [[tenants]] table in the file

    def problem(self, path: tuple[str | int, ...], reason: str, warning: bool = False) -> None:
        self.problems.append(Problem(self.file, line_of(self.lines, path), dotted(path), reason, warning))

    def at(self, key: str, reason: str, warning: bool = False) -> None:
        """A problem with a key's value, wherever it came from (the variable's name when it did)."""
        name = env_name(key)
        if key not in NO_ENV and self.env.get(name):
            self.problems.append(Problem("environment", None, f"{name} ({key})", reason, warning))
        else:
            self.problem(tuple(key.split(".")), reason, warning)

    def walk(self, table: Mapping[str, Any], prefix: tuple[str | int, ...]) -> None:
        known = _children(".".join(str(p) for p in prefix))
        for k, v in table.items():
            path = (*prefix, k)
            key = ".".join(str(p) for p in path)
            if prefix == () and k == "tenants":
                self.tenants(v)
            elif key in KEYS:
                self.convert(path, key, v)
            elif k in known and isinstance(v, dict):
                self.walk(v, path)
            elif k in known:
                self.problem(path, f"expected a table ([{key}]), got {v!r}")
            else:
                self.problem(path, _unknown(k, known))

    def convert(self, path: tuple[str | int, ...], key: str, value: Any) -> None:
        self.in_file.add(key)
        if key == "server.auth_token":
            self.inline_secret = path
        try:
            self.values[key] = KEYS[key].parse(value)
        except Bad as exc:
            self.problem(path, str(exc))

    def overrides(self) -> None:
        for key, kind in KEYS.items():
            name = env_name(key)
            text = self.env.get(name)
            if key in NO_ENV or not text:
                continue
            try:
                self.values[key] = kind.from_text(text)
            except Bad as exc:
                self.problems.append(Problem("environment", None, f"{name} ({key})", str(exc)))

    def tenants(self, items: Any) -> None:
        if not isinstance(items, list) or not all(isinstance(t, dict) for t in items):
            self.problem(("tenants",), "expected tables: [[tenants]] name = ...")
            return
        out: list[TenantEntry] = []
        seen: dict[str, int] = {}
        for i, item in enumerate(items):
            got: dict[str, Any] = {}
            for k, v in item.items():
                if k == "token":
                    self.inline_secret = ("tenants", i, k)
                if k not in TENANT_KEYS:
                    self.problem(("tenants", i, k), _unknown(k, set(TENANT_KEYS)))
                    continue
                try:
                    got[k] = TENANT_KEYS[k].parse(v)
                except Bad as exc:
                    self.problem(("tenants", i, k), str(exc))
            if "name" not in got:
                if "name" not in item:
                    self.problem(("tenants", i), "every tenant needs a name")
                continue
            name = got["name"]
            if name in seen:
                self.problem(("tenants", i, "name"), f"tenant {name!r} is listed twice (first: tenants[{seen[name]}])")
                continue
            seen[name] = i
            token = self.secret(("tenants", i), got.get("token"), got.get("token_env"), "token")
            if token is None and ("token" in got or "token_env" in got):
                self.unresolved.add(i)  # its problem is said already
            out.append(TenantEntry(name, token, got.get("quota"), got.get("admin", False)))
            self.tenant_at.append(i)
        self.values["tenants"] = tuple(out)

    def secret(self, at: tuple[str | int, ...], inline: str | None, env: str | None, key: str) -> str | None:
        """A token given inline or by the name of the variable holding it (never both)."""
        if inline is not None and env is not None:
            self.problem((*at, f"{key}_env"), f"give {key} or {key}_env, not both")
            return None
        token = inline
        if env is not None and not self.serving:  # only the server reads its tenants' tokens
            return None
        if env is not None:
            token = self.env.get(env) or None
            if token is None:
                self.problem((*at, f"{key}_env"), f"the variable {env} is not set (or empty)")
                return None
        if token is not None and len(token) < MIN_TOKEN_CHARS:
            self.problem((*at, key if inline is not None else f"{key}_env"),
                         f"a token must have at least {MIN_TOKEN_CHARS} characters")
            return None
        return token


def _children(prefix: str) -> set[str]:
    """The names one level below ``prefix`` (tables and keys)."""
    depth = 0 if not prefix else prefix.count(".") + 1
    names = {k.split(".")[depth] for k in [*KEYS, "tenants"] if not prefix or k.startswith(prefix + ".")}
    return {n for n in names if n}


def _unknown(name: str, known: set[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (expected one of {', '.join(sorted(known))})"
    return f"unknown key{hint}"
