"""A decode request whose KV never arrives (the prefill worker connected over the hand-off, then stalled) is answered
by recomputing once its load deadline passes: the same tokens, no hang, the stalled transfer void."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from kvport.deadline import DeadlinePolicy
from kvport.transfer import links


@pytest.mark.slow
def test_a_stalled_transfer_ends_at_the_deadline_and_the_request_recomputes(model_dir: Path, tmp_path: Path) -> None:
    from kvport.demo.shared_tier import SharedTier
    from kvport.engines.hf import HFEngine
    from kvport.refmodel import load
    from kvport.spec import DType, from_hf_config
    from kvport.workers.decode import DecodeWorker

    shared = SharedTier(tmp_path / "shared")
    port = shared.start()
    w = DecodeWorker(model_dir, port, 1, 4 << 20, 64, deadlines=DeadlinePolicy(min_s=0.5, factor=1.0, max_s=1.0))
    stalled = links.dial(w.address, w.secret)  # connects and authenticates, never sends a transfer
    try:
        model, _ = load(model_dir, prepare_if_missing=False)
        plain = HFEngine(model, from_hf_config(model_dir, dtype=DType.FP32), None)
        prompt = np.asarray(list(range(100, 180)), dtype=np.int64)
        ref = plain.generate(prompt, 4)
        w.expect("r1", len(prompt))
        t0 = time.monotonic()
        ans = w.decode({"rid": "r1", "prompt": prompt, "first_token": ref.tokens[0], "max_new": 4, "hit_blocks": 0,
                        "shared_prefix_tokens": 0, "expected_s": 0.01})
        assert time.monotonic() - t0 < 30.0  # the deadline (1 s) ended the wait, not a 60-120 s timeout
        assert ans["fallback"] is not None and "DeadlineExceeded" in ans["fallback"]
        assert ans["tokens"] == list(ref.tokens)  # recomputed: the same answer
        assert ans["owned_after"] == 0
    finally:
        stalled.close()
        w.close()
        shared.stop()
