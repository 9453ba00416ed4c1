"""Weight prefetch: the reader thread follows the forward layer by layer, never changes a result, and
goes away with its hooks."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import torch

from kvport.engines.hf import HFEngine
from kvport.engines.hf.prefetch import WeightPrefetcher, decoder_layers, weight_prefetch
from kvport.spec import DType, from_hf_config


class _Recorder(WeightPrefetcher):
    def __init__(self, layers: list[torch.nn.Module], ahead: int) -> None:
        self.seen: list[int] = []
        self.done = threading.Event()
        super().__init__(layers, ahead)

    def _run(self) -> None:
        while True:
            j = self._q.get()
            if j is None:
                self.done.set()
                return
            self.seen.append(j)


def test_entering_layer_i_queues_the_layers_ahead_of_it_once() -> None:
    layers = [torch.nn.Linear(4, 4) for _ in range(6)]
    seq = torch.nn.Sequential(*layers)
    pf = _Recorder(layers, ahead=2)
    seq(torch.randn(1, 4))
    deadline = time.monotonic() + 5
    while len(pf.seen) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pf.seen == [1, 2, 3, 4, 5]  # layer 0 queues 1 and 2, layer i then i + 2; never past the end
    pf.active = False
    seq(torch.randn(1, 4))
    time.sleep(0.05)
    assert pf.seen == [1, 2, 3, 4, 5]  # inactive hooks queue nothing
    pf.close()
    assert pf.done.wait(5)
    assert all(not layer._forward_pre_hooks for layer in layers)  # the hooks are gone


def test_prefetch_never_changes_the_output(model_dir: Path) -> None:
    from kvport.refmodel import load

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, _ = load(model_dir)
        spec = from_hf_config(model_dir, dtype=DType.FP32)
        prompt = np.random.default_rng(3).integers(10, 49_000, 80)
        plain = HFEngine(model, spec, None).generate(prompt, 6).tokens
        eng = HFEngine(model, spec, None, prefetch_weights=True)
        pf = weight_prefetch(model)
        assert pf is not None and len(pf._params) == len(decoder_layers(model))
        assert weight_prefetch(model) is pf  # one per model, however many engines share it
        assert eng.generate(prompt, 6).tokens == plain
        pf.close()
        assert pf.closed and weight_prefetch(model) is not pf  # a closed one is replaced, not reused
        weight_prefetch(model).close()
    finally:
        torch.set_num_threads(threads)
