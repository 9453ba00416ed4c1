"""Typed messages <-> msgpack maps: one codec, every field checked against its type and its cap.

A message is a frozen dataclass; its annotations are the schema::

    @dataclass(frozen=True, slots=True)
    class LeaseRequest(Message):
        TYPE = MsgType.LEASE
        keys: Annotated[tuple[Key, ...], Len(4096)]
        ttl_s: Annotated[float, Range(0.001, 3600)]

``decode(cls, meta)`` builds the value from a peer's map or raises :class:`ProtocolError` naming the
field: wrong type, out of range, too long, missing (fields with a default may be absent; unknown
keys are ignored, so a newer peer may add fields). Supported: ``int``, ``float`` (finite), ``bool``,
``str``, ``bytes``, ``X | None``, ``tuple[X, ...]`` / ``list[X]``, ``dict[str, X]``, enums (by value)
and nested dataclasses. Every ``str``, ``bytes``, ``tuple``, ``list`` and ``dict`` field must carry a
:class:`Len` (an uncapped length from a peer is a bug). Nothing is ever unpickled or evaluated.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, TypeVar, Union, get_args, get_origin, get_type_hints

from kvport.errors import ProtocolError
from kvport.keys import KEY_BYTES

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Len:
    """Length cap of a str, bytes, list, tuple or dict field (``lo`` <= len <= ``hi``)."""

    hi: int
    lo: int = 0


@dataclass(frozen=True, slots=True)
class Range:
    """Value range of an int or float field (both ends included)."""

    lo: float
    hi: float


Key = Annotated[bytes, Len(KEY_BYTES, KEY_BYTES)]  # a 16-byte block key
Name = Annotated[str, Len(128, 1)]  # a holder, tenant, tier or owner name


@dataclass(frozen=True, slots=True)
class _Spec:
    tp: Any
    caps: tuple[object, ...]


_HINTS: dict[type, dict[str, _Spec]] = {}


def _spec(tp: Any) -> _Spec:
    if get_origin(tp) is Annotated:
        base, *caps = get_args(tp)
        inner = _spec(base)
        return _Spec(inner.tp, (*inner.caps, *caps))
    return _Spec(tp, ())


def _fields(cls: type) -> dict[str, _Spec]:
    out = _HINTS.get(cls)
    if out is None:
        hints = get_type_hints(cls, include_extras=True)
        out = {f.name: _spec(hints[f.name]) for f in dataclasses.fields(cls)}
        _HINTS[cls] = out
    return out


def _cap(caps: tuple[object, ...], kind: type) -> Any:
    for c in caps:
        if isinstance(c, kind):
            return c
    return None


def _len_ok(v: Any, caps: tuple[object, ...], where: str) -> None:
    cap = _cap(caps, Len)
    if cap is None:
        raise ProtocolError(f"{where}: no length cap declared")  # a schema bug, never a peer's
    if not cap.lo <= len(v) <= cap.hi:
        raise ProtocolError(f"{where}: length {len(v)} outside [{cap.lo}, {cap.hi}]")


def _decode(tp: Any, caps: tuple[object, ...], v: Any, where: str) -> Any:
    origin = get_origin(tp)
    if origin is Annotated:
        s = _spec(tp)
        return _decode(s.tp, (*caps, *s.caps), v, where)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if v is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise ProtocolError(f"{where}: unsupported union")  # pragma: no cover - schema bug
        return _decode(rest[0], caps, v, where)
    if origin in (tuple, list):
        if not isinstance(v, list):
            raise ProtocolError(f"{where}: expected a list")
        _len_ok(v, caps, where)
        item = get_args(tp)[0]
        items = [_decode(item, (), x, f"{where}[{i}]") for i, x in enumerate(v)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        kt, vt = get_args(tp)
        if not isinstance(v, dict) or kt is not str:
            raise ProtocolError(f"{where}: expected a map with str keys")
        _len_ok(v, caps, where)
        return {_decode(str, (Len(128),), k, f"{where} key"): _decode(vt, (), x, f"{where}[{k!r}]")
                for k, x in v.items()}
    if tp is bool:
        if not isinstance(v, bool):
            raise ProtocolError(f"{where}: expected a bool")
        return v
    if tp is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ProtocolError(f"{where}: expected an int")
        r = _cap(caps, Range)
        if r is not None and not r.lo <= v <= r.hi:
            raise ProtocolError(f"{where}: {v} outside [{r.lo}, {r.hi}]")
        return v
    if tp is float:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ProtocolError(f"{where}: expected a finite number")
        r = _cap(caps, Range)
        if r is not None and not r.lo <= v <= r.hi:
            raise ProtocolError(f"{where}: {v} outside [{r.lo}, {r.hi}]")
        return float(v)
    if tp is str or tp is bytes:
        if not isinstance(v, tp):
            raise ProtocolError(f"{where}: expected {tp.__name__}")
        _len_ok(v, caps, where)
        return v
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(v)
        except ValueError as exc:
            raise ProtocolError(f"{where}: {v!r} is not one of {[m.value for m in tp]}") from exc
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(v, dict):
            raise ProtocolError(f"{where}: expected a map")
        return decode(tp, v, where)
    raise ProtocolError(f"{where}: unsupported field type {tp!r}")  # pragma: no cover - schema bug


def decode(cls: type[T], meta: dict[str, Any], where: str = "") -> T:
    """Build ``cls`` from a peer's map; ProtocolError names the first bad field."""
    name = where or cls.__name__
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        spec = _fields(cls)[f.name]
        if f.name not in meta:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{name}: missing field {f.name!r}")
            continue
        kwargs[f.name] = _decode(spec.tp, spec.caps, meta[f.name], f"{name}.{f.name}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"{name}: {exc}") from exc


def encode(value: Any) -> Any:
    """A message (or any field value) as msgpack-ready data: maps, lists, scalars."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [encode(x) for x in value]
    if isinstance(value, dict):
        return {k: encode(x) for k, x in value.items()}
    return value


class Message:
    """Base of every typed message: ``TYPE`` is its frame type; requests and answers share it."""

    TYPE: ClassVar[Any]

    def to_meta(self) -> dict[str, Any]:
        out: dict[str, Any] = encode(self)
        return out

    @classmethod
    def from_meta(cls: type[T], meta: dict[str, Any]) -> T:
        return decode(cls, meta)


__all__ = ["Key", "Len", "Message", "Name", "Range", "decode", "encode"]
