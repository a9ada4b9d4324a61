"""Robust trend of a memory series: the peak envelope and a Theil-Sen slope with its interval.

Pure numpy, no scipy: the gateway image stays small. ``theil_sen`` matches
``scipy.stats.theilslopes`` (Sen 1968, ties in x and y corrected) when ``n_eff`` is None.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Slope:
    slope: float  # units of y per unit of t
    low: float  # confidence interval of the slope
    high: float
    intercept: float  # median(y) - slope * median(t), as scipy


def _tie_term(values: FloatArray) -> float:
    _, counts = np.unique(values, return_counts=True)
    k = counts[counts > 1].astype(np.float64)
    return float(np.sum(k * (k - 1) * (2 * k + 5)))


def theil_sen(t: FloatArray, y: FloatArray, confidence: float = 0.95, n_eff: float | None = None) -> Slope:
    """Median of pairwise slopes, with Sen's distribution-free interval.

    ``n_eff`` (< len(t)) widens the interval for serially correlated points, such as a
    running max: the interval's half-width in ranks is scaled as if only ``n_eff``
    independent points had been seen.
    """
    t = np.asarray(t, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n = len(t)
    if n < 2:
        raise ValueError("need at least two points")
    i, j = np.triu_indices(n, k=1)
    dt = t[j] - t[i]
    keep = dt != 0
    if not np.any(keep):
        raise ValueError("all points share one time")
    slopes = np.sort((y[j] - y[i])[keep] / dt[keep])
    median = float(np.median(slopes))
    intercept = float(np.median(y) - median * np.median(t))
    pairs = len(slopes)
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    var = (n * (n - 1) * (2 * n + 5) - _tie_term(t) - _tie_term(y)) / 18.0
    half = z * np.sqrt(max(var, 0.0))  # in ranks among n(n-1)/2 pairs
    if n_eff is not None and 2 <= n_eff < n:
        full = n * (n - 1) / 2.0
        m = n_eff
        half_eff = z * np.sqrt(m * (m - 1) * (2 * m + 5) / 18.0) / (m * (m - 1) / 2.0)
        half = max(half, half_eff * full)
    lo_rank = max(int(np.round((pairs - half) / 2.0)) - 1, 0)
    hi_rank = min(int(np.round((pairs + half) / 2.0)), pairs - 1)
    return Slope(median, float(slopes[lo_rank]), float(slopes[hi_rank]), intercept)


def peak_envelope(
    t: FloatArray, y: FloatArray, width_s: float, max_points: int = 400
) -> tuple[FloatArray, FloatArray]:
    """Binned trailing maximum: the peak over the last ``width_s`` at each bin's end.

    Reserved memory moves in steps and cache clears cut it down for a moment; what runs a
    device out of memory is the peak, so the trend is fitted to the peak. The maximum
    trails (it forgets after ``width_s``), so a clear or a lone spike stops counting.
    Bins (at most ``max_points``) keep the pairwise fit cheap whatever the history length.
    """
    t = np.asarray(t, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if len(t) == 0:
        return t, y
    span = float(t[-1] - t[0])
    bin_s = max(span / max_points, 1e-9)
    idx = np.minimum(((t - t[0]) / bin_s).astype(np.int64), max_points - 1)
    starts = np.flatnonzero(np.r_[True, idx[1:] != idx[:-1]])
    bin_max = np.maximum.reduceat(y, starts)
    bin_end = t[np.r_[starts[1:] - 1, len(t) - 1]]
    out = np.empty_like(bin_max)
    lo = 0
    for k in range(len(bin_max)):
        while bin_end[k] - bin_end[lo] > width_s:
            lo += 1
        out[k] = bin_max[lo : k + 1].max()
    return bin_end, out
