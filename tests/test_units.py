import pytest

from kvport.errors import UnitError, UserInputError
from kvport.units import format_bytes, parse_bandwidth, parse_size


@pytest.mark.parametrize(("text", "expected"), [
    ("80GiB", 80 * 1024**3), ("1.5 KiB", 1536), ("25GB", 25 * 10**9), ("4096", 4096), ("1g", 1024**3),
    ("2 MiB", 2 * 1024**2),
])
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("20GiB/s", 20 * 1024**3), ("25 GB/s", 25e9), ("100Gbps", 12.5e9), ("100 gbit/s", 12.5e9),
    ("400MB/s", 400e6), ("8 Mbps", 1e6),
])
def test_parse_bandwidth(text: str, expected: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize("bad", ["", "GiB", "-5GiB", "0GiB", "5 parsecs", "1e999GiB", "nan"])
def test_bad_sizes_are_typed_user_errors(bad: str) -> None:
    with pytest.raises(UnitError) as info:
        parse_size(bad)
    assert isinstance(info.value, UserInputError)
    assert "expected" in str(info.value) or "positive" in str(info.value)


@pytest.mark.parametrize("bad", ["20GiB", "20XB/s", "fast", "0Gbps", "-1GB/s"])
def test_bad_bandwidths(bad: str) -> None:
    with pytest.raises(UnitError):
        parse_bandwidth(bad)


def test_format_bytes() -> None:
    assert format_bytes(8 * 1024**3) == "8.00 GiB"
    assert format_bytes(512) == "512 B"


@pytest.mark.parametrize("bad", ["0.4", "0.5", "1e-10GiB", "0.0001 KiB"])
def test_a_size_below_one_byte_is_refused_not_zero(bad: str) -> None:
    # round() made these 0, and callers read 0 as "unset" (`size or default`) or divide by it
    with pytest.raises(UnitError, match="less than one byte"):
        parse_size(bad)


def test_a_size_too_large_for_a_float_is_a_unit_error() -> None:
    with pytest.raises(UnitError, match="too large"):  # was OverflowError from round(inf)
        parse_size("1e300GiB")
    assert parse_size("0.6") == 1 and parse_size("1e3 kB") == 10**6


@pytest.mark.parametrize("bad", ["1e300GiB/s", "1e-300GiB/s", "0.5B/s", "1e-12Gbps"])
def test_bandwidths_beyond_a_float_or_below_one_byte_per_second(bad: str) -> None:
    with pytest.raises(UnitError, match=r"too large|less than one byte"):
        parse_bandwidth(bad)
