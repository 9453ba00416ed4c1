"""The tiers' checksum thread: large batches are hashed beside the caller, small ones inline, with
the same results and errors either way."""

import threading

import pytest
import xxhash

from kvport.tiers import checksums


def test_large_batches_run_on_the_checksum_thread_and_small_ones_inline() -> None:
    bufs = [bytes([i]) * 1000 for i in range(5)]
    where: list[str] = []

    def job() -> list[int]:
        where.append(threading.current_thread().name)
        return checksums.xxh3_each(bufs)

    small = checksums.aside(job, 10).result()
    big = checksums.aside(job, checksums.ASIDE_MIN_BYTES).result()
    assert small == big == [xxhash.xxh3_64_intdigest(b) for b in bufs]
    assert where[0] == threading.current_thread().name
    assert where[1].startswith("kvport-tier-xxh3") == checksums.PARALLEL


@pytest.mark.parametrize("nbytes", [1, checksums.ASIDE_MIN_BYTES])
def test_an_error_in_the_job_reaches_the_caller(nbytes: int) -> None:
    def bad() -> int:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        checksums.aside(bad, nbytes).result()
