"""The in-kernel fp16 / bf16 conversions agree bit for bit with numpy and torch."""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from kvport.codec._kernels import f16_bits, f16_value, load, to_out


@njit(cache=False)
def _to_f16(x: np.ndarray, out: np.ndarray) -> None:
    for i in range(x.shape[0]):
        out[i] = f16_bits(x[i])


@njit(cache=False)
def _from_f16(b: np.ndarray, out: np.ndarray) -> None:
    for i in range(b.shape[0]):
        out[i] = f16_value(b[i])


@njit(cache=False)
def _bf16_round(x: np.ndarray, out: np.ndarray) -> None:
    like = out[0]
    for i in range(x.shape[0]):
        out[i] = to_out(x[i], like)


@njit(cache=False)
def _bf16_widen(b: np.ndarray, out: np.ndarray) -> None:
    for i in range(b.shape[0]):
        out[i] = load(b[i])


def _samples() -> np.ndarray:
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal(20000) * 10.0 ** rng.integers(-9, 5, 20000),
             np.array([0.0, -0.0, 6.1e-5, 6.0e-8, 2.0**-24, 3 * 2.0**-25, 65504.0, 65519.0, -65504.0, 1.0 + 2**-11])]
    return np.concatenate(parts).astype(np.float32)


def test_fp16_conversion_matches_numpy() -> None:
    x = _samples()
    x = x[np.abs(x) < 65520]
    got = np.empty(x.shape, np.uint16)
    _to_f16(x, got)
    want = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(got, want)
    back = np.empty(x.shape, np.float32)
    _from_f16(got, back)
    assert np.array_equal(back, want.view(np.float16).astype(np.float32))


def test_fp16_saturates_instead_of_overflowing() -> None:
    got = np.empty(2, np.uint16)
    _to_f16(np.array([1e6, -np.inf], np.float32), got)
    assert got.view(np.float16).tolist() == [65504.0, -65504.0]


def test_bf16_rounding_matches_torch() -> None:
    x = _samples()
    got = np.empty(x.shape, np.uint16)
    _bf16_round(x, got)
    want = torch.from_numpy(x).bfloat16().view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(got, want)
    wide = np.empty(x.shape, np.float32)
    _bf16_widen(got, wide)
    assert np.array_equal(wide, torch.from_numpy(x).bfloat16().float().numpy())
