"""Fit the prefill cost model ``t(s, e) = a + x [s>0] + b q + c q^2 + d q s`` (q = e - s) to points.

Non-negative least squares on *relative* error (each row divided by its measured time, so a 50 ms
point counts as much as a 5 s one). Five unknowns, so the exact solution is found by trying every
subset of free coefficients (at most 31 small solves) and keeping the best feasible one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from kvport.errors import ProfileError
from kvport.planner.profile import PrefillModel, PrefillPoint


def _design(points: Sequence[PrefillPoint]) -> tuple[np.ndarray, np.ndarray]:
    rows = []
    for p in points:
        q = float(p.end - p.start)
        rows.append((1.0, q, q * q, q * float(p.start), 1.0 if p.start > 0 else 0.0))
    x = np.asarray(rows, dtype=np.float64)
    y = np.asarray([p.seconds for p in points], dtype=np.float64)
    return x, y


def fit_prefill(points: Sequence[PrefillPoint], *, model_id: str, threads: int, measured_at: float) -> PrefillModel:
    """Needs >= 3 points with positive times; incremental points (start > 0) make ``d`` and ``x``
    identifiable (two or more contexts are needed to tell them apart)."""
    good = [p for p in points if p.end > p.start >= 0 and p.seconds > 0]
    if len(good) < 3:
        raise ProfileError(f"need >= 3 valid prefill measurements to fit, got {len(good)}")
    mat, y = _design(good)
    w = 1.0 / y
    xw, yw = mat * w[:, None], y * w
    best: tuple[float, np.ndarray] | None = None
    has_ctx = any(p.start > 0 for p in good)
    cols_all = (0, 1, 2, 3, 4) if has_ctx else (0, 1, 2)
    for k in range(1, len(cols_all) + 1):
        for cols in itertools.combinations(cols_all, k):
            sol, *_ = np.linalg.lstsq(xw[:, cols], yw, rcond=None)
            if np.any(sol < 0):
                continue
            coef = np.zeros(5)
            coef[list(cols)] = sol
            err = float(np.sum((xw @ coef - yw) ** 2))
            if best is None or err < best[0] - 1e-15:
                best = (err, coef)
    if best is None:  # unreachable: the single column "b" always gives a positive solution
        raise ProfileError("prefill fit found no non-negative solution")
    a, b, c, d, x = (float(v) for v in best[1])
    if not has_ctx:  # no incremental points: attention to the context costs like causal attention (2 c)
        d = 2.0 * c
    return PrefillModel(model_id=model_id, threads=threads, a=a, b=b, c=c, d=d, x=x, measured_at=measured_at,
                        points=tuple(good))
