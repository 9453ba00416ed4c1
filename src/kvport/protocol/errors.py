"""One error mapping for every kvport protocol: an exception to ERROR/REFUSE/ABORT metadata and back.

::

    error_meta(exc)  -> {"error": class name, "message": str, ["field", "expected", "got"]}
    remote_error(meta, default) -> the kvport exception of that name (any class of kvport.errors'
                                   tree), its message prefixed "peer: "; a name kvport does not know
                                   becomes ``default`` (TransferError on a transfer connection,
                                   ServerError on a server connection)

Only names from :mod:`kvport.errors` are ever instantiated (a peer cannot make this side build an
arbitrary class), and every string is capped.
"""

from __future__ import annotations

from typing import Any

from kvport import errors
from kvport.errors import IncompatibleSpecError, KVPortError

MAX_MESSAGE = 1000


def _known() -> dict[str, type[KVPortError]]:
    out: dict[str, type[KVPortError]] = {}
    for name in dir(errors):
        obj = getattr(errors, name)
        if isinstance(obj, type) and issubclass(obj, KVPortError) and obj is not IncompatibleSpecError:
            out[name] = obj
    return out


_KNOWN = _known()


def _scalar(v: object) -> str | int | float | bool | bytes | None:
    return v if isinstance(v, str | int | float | bool | bytes) or v is None else repr(v)[:MAX_MESSAGE]


def error_meta(exc: BaseException) -> dict[str, Any]:
    """Metadata of an ERROR / REFUSE / ABORT frame for an exception (class name, message, field)."""
    out: dict[str, Any] = {"error": type(exc).__name__, "message": str(exc)[:MAX_MESSAGE]}
    if isinstance(exc, IncompatibleSpecError):
        out.update(field=exc.field, expected=_scalar(exc.expected), got=_scalar(exc.got))
    return out


def remote_error(meta: dict[str, Any], default: type[KVPortError] = errors.TransferError) -> KVPortError:
    """The typed error a peer's ERROR / REFUSE / ABORT metadata names."""
    name = str(meta.get("error", ""))[:100]
    msg = str(meta.get("message", ""))[:MAX_MESSAGE]
    if name == "IncompatibleSpecError":
        return IncompatibleSpecError(str(meta.get("field", "?"))[:100], meta.get("expected"), meta.get("got"))
    cls = _KNOWN.get(name)
    if cls is None:
        return default(f"peer reported {name or 'an error'}: {msg}" if msg else f"peer reported {name or 'an error'}")
    if issubclass(cls, IncompatibleSpecError):  # pragma: no cover - excluded above
        return default(msg)
    try:
        return cls(f"peer: {msg}" if msg else f"peer reported {name}")
    except TypeError:  # a class whose constructor takes more than a message
        return default(f"peer reported {name}: {msg}")
