"""Checks across keys, and of this machine: conflicts, sizes that cannot work, room that is not there."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import psutil

from kvport.configfile.keys import env_name
from kvport.configfile.reader import FileReader
from kvport.configfile.schema import LimitsSection, ServerSection
from kvport.protocol.net import is_loopback


def _is(path: Path, test: Callable[[Path], bool]) -> bool:
    """``test(path)``, False where the answer cannot be read (a folder on the way this user may not enter)."""
    try:
        return test(path)
    except OSError:
        return False

def check_across(r: FileReader, file: Path | None) -> None:
    v = r.values
    if r.env.get(env_name("server.auth_token")):  # the variable wins over the file, whichever way it gave one
        token = v.get("server.auth_token")
    else:
        token = r.secret(("server",), v.get("server.auth_token"), v.get("server.auth_token_env"), "auth_token")
    v["server.token"] = token
    tenants = v.get("tenants")
    if (v.get("server.tls.cert") is None) != (v.get("server.tls.key") is None):
        given, missing = ("server.tls.cert", "key") if "server.tls.cert" in v else ("server.tls.key", "cert")
        r.at(given, f"given without server.tls.{missing}: a TLS listener needs both")
    for key in ("server.tls.cert", "server.tls.key"):
        if r.serving and key in v and not _is(v[key], Path.is_file):
            r.at(key, f"{str(v[key])!r} is not a file" + ("" if _is(v[key], Path.exists) else " (not found)"))
    host = v.get("server.listen", ServerSection().listen)[0]
    if tenants is not None and ("server.auth_token" in r.in_file or "server.auth_token_env" in v):
        r.at("server.auth_token" if "server.auth_token" in v else "server.auth_token_env",
             "applies only to the default tenant, without [[tenants]]: give each tenant its token")
    if r.serving and not is_loopback(host):
        if tenants is None and token is None:
            r.at("server.listen", f"listening on {host!r} (beyond loopback) needs a token: set "
                 "server.auth_token_env (or KVPORT_AUTH_TOKEN), or give every [[tenants]] a token")
        for i, t in zip(r.tenant_at, tenants or (), strict=True):
            if t.token is None and i not in r.unresolved:
                r.problem(("tenants", i, "name"), f"tenant {t.name!r} has no token: listening on {host!r} "
                          "(beyond loopback) needs one for every tenant")
    if "server.disk_capacity" in v and "server.disk" not in v:  # a warning: --disk may give the folder
        r.at("server.disk_capacity", "sizes the server's disk tier: without server.disk (or kvport serve "
             "--disk) there is none", warning=True)
    if "tiers.disk.capacity" in v and "tiers.disk.path" not in v:  # a connector's kvport_disk_dir may give it
        r.at("tiers.disk.capacity", "sizes the disk tier: without tiers.disk.path (or a connector's "
             "kvport_disk_dir) there is none", warning=True)
    _check_sizes(r)
    _check_room(r)
    if r.inline_secret is not None and file is not None and _world_readable(file):
        r.problem(r.inline_secret,
                  f"{file} holds a token and is readable by every user: chmod 600 it, or name a variable "
                  "(auth_token_env, token_env)", warning=True)


def _check_sizes(r: FileReader) -> None:
    v = r.values
    lim = LimitsSection()
    max_value = v.get("limits.max_value", lim.max_value_bytes)
    inflight = v.get("limits.inflight", lim.inflight_bytes)
    staging = 1 << (max_value - 1).bit_length()  # the power-of-two staging buffer one value takes
    if staging > inflight:
        r.at("limits.inflight" if "limits.inflight" in v else "limits.max_value",
             f"must hold a staging buffer for the largest value: {staging} bytes or more (limits.max_value "
             f"{max_value} rounded up to a power of two), got {inflight}")
    page = v.get("server.page_size", ServerSection().page_bytes)
    if page & (page - 1):
        r.at("server.page_size", f"must be a power of two, got {page}")
    capacity = v.get("server.capacity", ServerSection().capacity_bytes)
    if capacity <= inflight + 4 * page:
        r.at("server.capacity", f"{capacity} bytes leave no room for a host pool beside limits.inflight "
             f"({inflight}) and four pages")
    if v.get("server.disk_capacity", page) < page:
        r.at("server.disk_capacity", f"must hold at least one page (server.page_size {page})")


def _check_room(r: FileReader) -> None:
    """Capacities this machine cannot give: memory beyond its RAM, a disk beyond its filesystem."""
    v = r.values
    ram = int(psutil.virtual_memory().total)
    for key in ("server.capacity", "tiers.host.capacity"):
        if not (r.serving if key.startswith("server.") else r.engine):
            continue
        if v.get(key, 0) > ram:
            r.at(key, f"{v[key]} bytes is more than this machine's memory ({ram} bytes)")
    for folder, key in (("server.disk", "server.disk_capacity"), ("tiers.disk.path", "tiers.disk.capacity")):
        if folder not in v or key not in v or not (r.serving if key.startswith("server.") else r.engine):
            continue
        place = Path(v[folder])
        while not _is(place, Path.exists) and place != place.parent:  # the filesystem the folder will be made on
            place = place.parent
        try:
            usage = shutil.disk_usage(place)
        except OSError as exc:
            r.at(folder, f"cannot read the filesystem of {place}: {exc}")
            continue
        if v[key] > usage.total:
            r.at(key, f"{v[key]} bytes is more than the whole filesystem of {place} ({usage.total} bytes)")
        elif v[key] > usage.free:
            r.at(key, f"{v[key]} bytes is more than the free space of {place} ({usage.free} bytes): the tier "
                 "will be lowered to what fits", warning=True)


def _world_readable(file: Path) -> bool:
    try:
        return bool(os.stat(file).st_mode & stat.S_IROTH)
    except OSError:
        return False
