"""Summary statistics."""
from collections.abc import Sequence


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def spread(values: Sequence[float]) -> float:
    """Largest minus smallest value."""
    return max(values) - min(values)
