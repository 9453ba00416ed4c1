import threading

import pytest

from kvport.errors import BackpressureTimeout, ConfigError, ProtocolError
from kvport.metrics import sample
from kvport.transfer.credits import Admitted, Backpressure, CreditPool, CreditWindow, Rejected, RejectReason, wait_for


def test_window_never_sends_beyond_grant() -> None:
    w = CreditWindow(Backpressure())
    w.on_grant(100, budget=100)
    w.consume(60)
    assert w.available == 40 and w.in_use == 60
    with pytest.raises(BackpressureTimeout):
        w.consume(41)
    with pytest.raises(ProtocolError):
        w.on_grant(50)  # grants are cumulative: never backwards


def test_wait_for_times_out_then_wakes_on_grant() -> None:
    w = CreditWindow(Backpressure())
    w.on_grant(10, budget=10)
    w.consume(10)
    before = sample("transfer_credit_waits_total") or 0
    with pytest.raises(BackpressureTimeout):
        wait_for(w, 5, timeout=0.01)
    threading.Timer(0.05, lambda: w.on_grant(20)).start()
    wait_for(w, 5, timeout=5)
    assert w.available == 10
    assert (sample("transfer_credit_waits_total") or 0) >= before + 2


def test_watermark_hysteresis() -> None:
    w = CreditWindow(Backpressure(high_watermark=0.8, low_watermark=0.5))
    w.on_grant(100, budget=100)
    w.consume(70)
    assert isinstance(w.admission(), Admitted)
    w.consume(15)  # 85 in use > 80
    r = w.admission()
    assert isinstance(r, Rejected) and r.reason is RejectReason.BUSY
    assert r.retry_after_s is not None and r.retry_after_s > 0 and "high watermark" in r.detail
    w.on_grant(125)  # 60 in use: below high but above low -> still rejected (hysteresis)
    assert isinstance(w.admission(), Rejected)
    w.on_grant(140)  # 45 in use < 50
    assert isinstance(w.admission(), Admitted)


def test_disabled_backpressure_admits_everything() -> None:
    w = CreditWindow(Backpressure(enabled=False))
    w.consume(10**9)
    assert isinstance(w.admission(), Admitted)


def test_pool_grants_batched_and_overrun_detected() -> None:
    p = CreditPool(1000, Backpressure(min_grant_fraction=0.25))
    p.on_received(1000)
    with pytest.raises(ProtocolError, match="overran"):
        p.on_received(1)
    assert p.release(100) == 1100  # the sender holds no credit: announce at once, however small


def test_pool_release_rules() -> None:
    p = CreditPool(1000, Backpressure(min_grant_fraction=0.25))
    p.on_received(100)
    assert p.release(100) is None  # sender still holds 900 >= 250 and only 100 unannounced
    p.on_received(800)
    assert p.release(200) == 1300  # 300 unannounced >= 250
    with pytest.raises(ProtocolError):
        p.release(10**6)


def test_config_validation() -> None:
    with pytest.raises(ConfigError):
        Backpressure(high_watermark=0.3, low_watermark=0.5)
    with pytest.raises(ConfigError):
        CreditPool(0, Backpressure())
