"""Input checks the kernels' references share: one ValueError per broken contract, naming the argument."""

from __future__ import annotations


def ranks(**named) -> None:
    """`name=(array, rank)` for each argument: ValueError for the first whose rank is not `rank`."""
    for name, (x, rank) in named.items():
        if x.ndim != rank:
            raise ValueError(f"{name} must have rank {rank}, got shape {x.shape}")


def batch(b: int, **sizes: int) -> None:
    """`name=leading size` for each argument: ValueError unless all are the queries' batch `b`."""
    if any(v != b for v in sizes.values()):
        raise ValueError(f"batch sizes disagree: q has B={b}, " + ", ".join(f"{k} {v}" for k, v in sizes.items()))
