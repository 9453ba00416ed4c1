"""What holds a store's state still: its one re-entrant lock, and the blocks a call is writing.

* :class:`StoreLock`: every part of a store shares it; a public call takes it once and the parts it
  calls run under it. It knows whether the calling thread holds it (:meth:`StoreLock.owned`): a put
  nested in another store call, or inside ``holding()``, must not wait for the write-behind thread,
  which needs this lock to read the blocks it copies.
* :class:`Busy`: ``with busy(keys):`` -- the block being written and its parent are never a victim
  while the room for it is made (an eviction must not take the parent the new block links to).
  Scopes nest: an inner one adds its keys to the outer one's and gives them back on exit.

Both are plain classes with ``__enter__``/``__exit__`` (no generator per call): they sit on every
put, reserve and lookup.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from threading import get_ident
from types import TracebackType

from kvport.deadline import Deadline, within
from kvport.errors import DeadlineExceeded

_NONE: frozenset[bytes] = frozenset()


class StoreLock:
    """A re-entrant lock that records its owner thread (set and cleared only while held)."""

    __slots__ = ("_depth", "_lock", "_owner")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._owner = 0
        self._depth = 0

    def __enter__(self) -> None:
        self._lock.acquire()
        self._depth += 1
        self._owner = get_ident()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self._depth -= 1
        if not self._depth:
            self._owner = 0
        self._lock.release()

    def owned(self) -> bool:
        """True when the calling thread holds the lock."""
        return self._owner == get_ident()

    def locked(self, deadline: Deadline | None) -> contextlib.AbstractContextManager[None]:
        """The lock, waited for at most until ``deadline`` (DeadlineExceeded past it); tier calls
        inside see ``deadline`` as the current one (remote tiers set their socket timeouts from it).
        Without a deadline: the lock itself."""
        return self if deadline is None else self._until(deadline)

    @contextlib.contextmanager
    def _until(self, deadline: Deadline) -> Iterator[None]:
        if not self._lock.acquire(timeout=deadline.remaining()):
            raise DeadlineExceeded("the store was busy past the load's deadline")
        self._depth += 1
        self._owner = get_ident()
        try:
            with within(deadline):
                yield
        finally:
            self.__exit__(None, None, None)


class Busy:
    """The keys no eviction may take while a write is under way (guarded by the store's lock)."""

    __slots__ = ("_outer", "keys")

    def __init__(self) -> None:
        self.keys: AbstractSet[bytes] = _NONE
        self._outer: list[AbstractSet[bytes]] = []

    def __call__(self, keys: AbstractSet[bytes]) -> Busy:
        self._outer.append(self.keys)
        self.keys = keys | self.keys if self.keys else keys
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.keys = self._outer.pop()


def around(key: bytes, parent: bytes | None) -> set[bytes]:
    """The busy keys of one block's write: itself and its parent."""
    return {key} if parent is None else {key, parent}
