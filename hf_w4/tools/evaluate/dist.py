"""Data parallel evaluation: the ranks of an ``accelerate launch`` (or any torch.distributed group)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List

import torch


@dataclass
class Dist:
    """Rank/world of this process and the two collectives the evaluation needs (no-ops for one process)."""

    def __init__(self, rank: int = 0, world: int = 1):
        self.rank, self.world = rank, world

    @classmethod
    def detect(cls) -> "Dist":
        """The current process group; under ``accelerate launch`` (``WORLD_SIZE`` > 1) it is initialized
        through ``accelerate.PartialState(cpu=True)`` (gloo on CPU)."""
        import torch.distributed as td
        if not td.is_available():
            return cls()
        if not td.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from accelerate import PartialState
            PartialState(cpu=not torch.cuda.is_available())
        if td.is_initialized():
            return cls(td.get_rank(), td.get_world_size())
        return cls()

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as td
            td.all_reduce(t, op=td.ReduceOp.SUM)
        return t

    def per_rank(self, value: float) -> List[float]:
        """Every rank's ``value`` (as a list indexed by rank), on every rank."""
        t = torch.zeros(self.world, dtype=torch.float64)
        t[self.rank] = float(value)
        return self.all_reduce_sum(t).tolist()

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as td
            td.barrier()

    def close(self) -> None:
        """Destroys the process group (after a barrier). Left for interpreter exit, gloo's teardown sometimes
        aborted a rank after its work was done ("terminate called without an active exception", exit -6)."""
        import torch.distributed as td
        if self.world > 1 and td.is_available() and td.is_initialized():
            td.barrier()
            td.destroy_process_group()

    def __repr__(self) -> str:
        return f"Dist(rank={self.rank}, world={self.world})"
