"""Codec registry: ``get_codec(codec_id, **params)`` and ``codec_ids()``.

Codec classes are registered by their ``codec_id`` when their module is imported: ``raw`` and
``lossless`` (numpy + zstandard, core) at import of :mod:`kvport.codec`, the lossy ones (numba
kernels, the ``codecs`` extra) on the first ``get_codec`` of their id, which raises
:class:`~kvport.errors.MissingExtraError` naming the extra where numba is not installed. Construction
validates the params, so an id + params pair read from a block key or a wire header either rebuilds
the exact codec that wrote the payload or raises :class:`~kvport.errors.UnknownCodecError` /
:class:`~kvport.errors.CodecParamsError`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from kvport.codec.base import Codec
from kvport.errors import CodecParamsError, UnknownCodecError
from kvport.extras import require

_REGISTRY: dict[str, type[Codec]] = {}
# codecs whose module is imported on first use: id -> module (each needs the ``codecs`` extra)
_LAZY: dict[str, str] = {"int8": "kvport.codec.int8", "kivi4": "kvport.codec.kivi4", "mixed": "kvport.codec.mixed"}


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make ``cls`` available under ``cls.codec_id``."""
    if cls.codec_id in _REGISTRY and _REGISTRY[cls.codec_id] is not cls:
        raise CodecParamsError(f"codec id {cls.codec_id!r} registered twice")
    _REGISTRY[cls.codec_id] = cls
    return cls


def codec_ids() -> list[str]:
    """Every codec id kvport knows, installed extra or not."""
    return sorted(set(_REGISTRY) | set(_LAZY))


def codec_class(codec_id: str) -> type[Codec]:
    """The class registered as ``codec_id``, importing its module on first use."""
    cls = _REGISTRY.get(codec_id)
    if cls is None and codec_id in _LAZY:
        require("codecs", f"the {codec_id} codec")
        importlib.import_module(_LAZY[codec_id])
        cls = _REGISTRY.get(codec_id)
    if cls is None:
        raise UnknownCodecError(f"unknown codec {codec_id!r}: expected one of {', '.join(codec_ids())}")
    return cls


def get_codec(codec_id: str, **params: Any) -> Codec:
    """The codec ``codec_id`` built from ``params`` (as found in ``Codec.params``)."""
    cls = codec_class(codec_id)
    try:
        return cls(**params)
    except TypeError as exc:
        raise CodecParamsError(f"{codec_id}: invalid params {params!r}: {exc}") from exc


def codec_from_dict(d: Mapping[str, Any]) -> Codec:
    """Inverse of :func:`codec_to_dict`: ``{"id": ..., "params": {...}}`` -> codec."""
    if not isinstance(d, Mapping) or not isinstance(d.get("id"), str) or not isinstance(d.get("params", {}), Mapping):
        raise CodecParamsError(f"a codec is described by {{'id': str, 'params': dict}}, got {d!r}")
    return get_codec(d["id"], **dict(d.get("params", {})))


def codec_to_dict(codec: Codec) -> dict[str, Any]:
    """msgpack-able description of a codec, for wire metadata."""
    return {"id": codec.codec_id, "params": codec.params}


def codec_key(codec: Codec) -> str:
    """Canonical string naming codec + params, for ``KeyContext.codec_id`` (sorted, stable)."""
    if not codec.params:
        return codec.codec_id
    items = ",".join(f"{k}={codec.params[k]!r}" for k in sorted(codec.params))
    return f"{codec.codec_id}({items})"
