import pytest
import torch

from kvport.errors import TierError
from kvport.tiers import DeviceTier


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_device_tier_needs_cuda() -> None:
    with pytest.raises(TierError):
        DeviceTier(1 << 20, 1 << 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_tier_round_trip() -> None:
    t = DeviceTier(4 << 10, 1 << 10)
    t.put(b"k" * 16, bytes(range(256)) * 3)
    out = bytearray(1024)
    assert t.get_into(b"k" * 16, out) == 768
    assert bytes(out[:768]) == bytes(range(256)) * 3
    assert t.used_bytes == 1024 and t.delete(b"k" * 16) and t.used_bytes == 0
