"""vLLM's idle spin, shortened when asked (``kvport_idle_spin_ms``).

vLLM's engine core and its worker process talk through a shared-memory queue whose reader, after
each message, keeps polling with ``sched_yield`` for one second before it sleeps on a socket
(``shm_broadcast.SpinCondition``, ``busy_loop_s=1``, not configurable). On a GPU host that costs an
otherwise idle core. On a CPU host where a prefill and a decode engine share the cores, the two
processes of the engine that just answered spin for that second on the cores the other engine
needs: measured here (2 cores, 200-token hand-offs), a decode request sent at once after its
prefill took 0.5-1.0 s to its first token, and 0.06-0.1 s when sent 1.5 s later.

:func:`limit_idle_spin` caps that window in this process (the connector calls it in both the engine
core and the worker, which both import it). Under load nothing changes: reads come every step,
well inside any window, and an idle reader wakes on the socket notification vLLM sends anyway.
"""

from __future__ import annotations

from typing import Any

from kvport.extras import require

try:
    from vllm.distributed.device_communicators import shm_broadcast
except ImportError:
    require("vllm", __name__)
    raise

_ATTR = "_kvport_idle_spin_s"
_ORIGINAL = "_kvport_original_wait"


def limit_idle_spin(seconds: float) -> None:
    """Cap every shared-memory queue reader's busy-poll window in this process at ``seconds``
    (readers made before the call too: the cap applies at their next wait)."""
    cls: Any = shm_broadcast.SpinCondition
    if not hasattr(cls, _ATTR):
        original = cls.wait
        setattr(cls, _ORIGINAL, original)

        def wait(self: Any, timeout_ms: int | None = None) -> None:
            cap = getattr(type(self), _ATTR)
            if self.is_reader and self.busy_loop_s > cap:
                self.busy_loop_s = cap
            original(self, timeout_ms)

        cls.wait = wait
    setattr(cls, _ATTR, max(0.0, float(seconds)))


def idle_spin_s() -> float | None:
    """The cap in force in this process (None: vLLM's own one second)."""
    return getattr(shm_broadcast.SpinCondition, _ATTR, None)


def restore_idle_spin() -> None:
    """vLLM's own behaviour again in this process (readers whose window was cut keep the cap)."""
    cls: Any = shm_broadcast.SpinCondition
    if hasattr(cls, _ORIGINAL):
        cls.wait = getattr(cls, _ORIGINAL)
        delattr(cls, _ORIGINAL)
        delattr(cls, _ATTR)
