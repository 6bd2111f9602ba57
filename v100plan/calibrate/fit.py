"""What every calibration builder shares: a least-squares line, and the error for a bench that lacks a figure."""

from __future__ import annotations


class BenchProblem(ValueError):
    """A bench document that lacks what a profile needs, with what is missing."""


def line_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = intercept + slope x over (x, y) points: (intercept, slope)."""
    if len(points) < 2:
        raise BenchProblem("a fit over contexts needs two or more decode contexts")
    mx = sum(p[0] for p in points) / len(points)
    my = sum(p[1] for p in points) / len(points)
    sxx = sum((p[0] - mx) ** 2 for p in points)
    if sxx == 0:
        raise BenchProblem("a fit over contexts needs two or more different decode contexts")
    slope = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx
    return my - slope * mx, slope
