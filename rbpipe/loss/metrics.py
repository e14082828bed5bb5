"""``MetricsAccumulator``: metrics that reduce across micro-batches (and ranks) exactly.

Each metric keeps sums and counts (added), or maxima/minima (taken), and is divided only at the end, so
k micro-batches give the same value as one batch of the same data.
"""

from __future__ import annotations

import math

import torch


def _f(x) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


class MetricsAccumulator:
    def __init__(self) -> None:
        self._sums: dict[str, list[float]] = {}  # name -> [sum, count]
        self._ext: dict[str, tuple[str, float]] = {}
        self._mom: dict[str, list[float]] = {}  # name -> [sum, sumsq, count, max, min]
        self._ess: dict[str, list[float]] = {}  # name -> [sum w, sum w^2, n]

    def mean(self, name: str, total, count) -> None:
        s = self._sums.setdefault(name, [0.0, 0.0])
        s[0] += _f(total)
        s[1] += _f(count)

    def extreme(self, name: str, value, how: str) -> None:
        if value is None:
            return
        v = _f(value)
        old = self._ext.get(name)
        if old is None:
            self._ext[name] = (how, v)
        else:
            self._ext[name] = (how, max(old[1], v) if how == "max" else min(old[1], v))

    def moments(self, name: str, values: torch.Tensor) -> None:
        m = self._mom.setdefault(name, [0.0, 0.0, 0.0, -math.inf, math.inf])
        if values.numel():
            v = values.detach().double()
            m[0] += _f(v.sum())
            m[1] += _f(v.square().sum())
            m[2] += v.numel()
            m[3] = max(m[3], _f(v.max()))
            m[4] = min(m[4], _f(v.min()))

    def ess(self, name: str, weights: torch.Tensor) -> None:
        e = self._ess.setdefault(name, [0.0, 0.0, 0.0])
        w = weights.detach().double()
        e[0] += _f(w.sum())
        e[1] += _f(w.square().sum())
        e[2] += w.numel()

    def merge(self, other: MetricsAccumulator) -> MetricsAccumulator:
        for k, (s, c) in other._sums.items():
            self.mean(k, s, c)
        for k, (how, v) in other._ext.items():
            self.extreme(k, v, how)
        for k, (s, q, c, mx, mn) in other._mom.items():
            m = self._mom.setdefault(k, [0.0, 0.0, 0.0, -math.inf, math.inf])
            m[0] += s
            m[1] += q
            m[2] += c
            m[3], m[4] = max(m[3], mx), min(m[4], mn)
        for k, (a, b, n) in other._ess.items():
            e = self._ess.setdefault(k, [0.0, 0.0, 0.0])
            e[0] += a
            e[1] += b
            e[2] += n
        return self

    def result(self) -> dict[str, float]:
        out = {k: (s / c if c else float("nan")) for k, (s, c) in self._sums.items()}
        out.update({k: v for k, (_, v) in self._ext.items()})
        for k, (s, q, c, mx, mn) in self._mom.items():
            mean = s / c if c else float("nan")
            var = max(0.0, q / c - mean * mean) if c > 1 else 0.0
            out.update({f"{k}_mean": mean, f"{k}_std": math.sqrt(var * c / (c - 1)) if c > 1 else 0.0,
                        f"{k}_max": mx if c else float("nan"), f"{k}_min": mn if c else float("nan")})
        for k, (a, b, n) in self._ess.items():
            out[k] = (a * a) / (n * b) if n and b else float("nan")
        return out
