"""Weight prefetch on a spare core: read layer i+1's weights while layer i computes.

A forward over few tokens (a decode step, or the short suffix after a loaded prefix) is bound by
streaming the weights from memory, not by arithmetic: the reference model reads its 424 MB of fp32
weights once per forward, and a matrix multiply of 128 rows waits on them. When the process computes
on fewer cores than the machine has, a background thread can read the next layer's weights into the
shared cache while the current layer computes, so the multiply finds them there. On the reference
model, one compute thread, a 128-token suffix over 1920 cached tokens, that is ~8% of the forward
(measured by ``kvport bench prefix``, which reports it in its conditions).

It never changes a result (it only reads the weights) and never runs ahead of the forward by more
than ``ahead`` layers. It is off by default: with no spare core it competes with the compute threads.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Sequence
from typing import Any

import torch


class WeightPrefetcher:
    """Hooks on ``layers``: entering layer i queues layers i+1..i+ahead for one reader thread."""

    def __init__(self, layers: Sequence[torch.nn.Module], ahead: int = 1) -> None:
        self._params = [[p for p in layer.parameters() if p.device.type == "cpu"] for layer in layers]
        self._ahead = max(1, ahead)
        self.active = True  # False: the hooks do nothing (for a comparison without prefetch)
        self._q: queue.Queue[int | None] = queue.Queue(maxsize=2 * self._ahead + 2)
        self._hooks = [layer.register_forward_pre_hook(self._hook(i)) for i, layer in enumerate(layers)]
        self._thread = threading.Thread(target=self._run, name="kvport-weight-prefetch", daemon=True)
        self._thread.start()

    def _hook(self, i: int) -> Any:
        def pre(module: torch.nn.Module, args: Any) -> None:
            if not self.active:
                return
            # entering layer 0 queues the whole window, every later layer the window's new end
            for j in range(1, self._ahead + 1) if i == 0 else (i + self._ahead,):
                if j < len(self._params):
                    with contextlib.suppress(queue.Full):  # the reader is behind: skip, never block the forward
                        self._q.put_nowait(j)
        return pre

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                j = self._q.get()
                if j is None:
                    return
                for p in self._params[j]:
                    torch.sum(p)  # one read of the tensor (vectorized, releases the GIL)

    @property
    def closed(self) -> bool:
        return not self._hooks

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        with contextlib.suppress(queue.Full):
            self._q.put(None, timeout=1.0)
        self._thread.join(2.0)


def decoder_layers(model: Any) -> Sequence[torch.nn.Module]:
    """The decoder layers of a Llama-style model (``model.model.layers``); empty if not found."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []


_ATTR = "_kvport_weight_prefetch"


def weight_prefetch(model: Any, ahead: int = 1) -> WeightPrefetcher | None:
    """The model's prefetcher, made on first use (one per model, however many engines share it);
    None when the model has no Llama-style decoder layers."""
    pf: WeightPrefetcher | None = getattr(model, _ATTR, None)
    if pf is None or pf.closed:
        layers = decoder_layers(model)
        if not layers:
            return None
        pf = WeightPrefetcher(layers, ahead)
        setattr(model, _ATTR, pf)
    pf.active = True
    return pf
