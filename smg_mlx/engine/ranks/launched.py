"""Which rank of a distributed launch this process is, read from what the
launchers set (no MLX: the front door reads it before the engine starts)."""

from __future__ import annotations

import os

# mlx.launch sets MLX_RANK for each backend it starts (ring, JACCL, NCCL); MPI
# launchers (its mpi backend too) set one of the others.
_RANK_VARIABLES = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def launched_rank() -> int | None:
    """This process's rank, or None when no distributed launcher started it."""
    for name in _RANK_VARIABLES:
        if os.environ.get(name):
            return int(os.environ[name])
    return None
